"""Sweeps the Hydra way, and one table from a sweep's folder.

    fledge train -m train.head_init=random,verifier ttt.ttt_steps=2,4 cache_dir=runs/quickstart/cache ...
    fledge eval draft=runs/sweeps/train/<time> eval.out_dir=runs/sweeps/train/<time>/eval   # every job's draft
    fledge sweep table runs/sweeps/train/<time>                                              # table.md + tau.png

Under ``-m`` each job writes its outputs (``Stage.out_keys``) into its own job folder, ``<sweep>/<job number>/``,
with ``sweep.json``: the stage, the job's overrides, its start, its seconds and whether it finished. ``fledge eval``
given a sweep folder evaluates every finished training job's draft side by side, interleaved prompt by prompt, as
rows ``eagle3#<job>``. The table joins what each job trained (steps, tokens, minutes, held-out acc_0) with what
the evaluation measured (τ, speed-up and its interval).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from fledge.core.errors import ConfigError
from fledge.core.files import atomic_write_text
from fledge.core.sweep import SWEEP_FILE, sweep_jobs

log = logging.getLogger(__name__)


@contextlib.contextmanager
def sweep_job(stage: str, cfg: Any, out_keys: tuple[str, ...]) -> Iterator[None]:
    """Inside a Hydra multirun job: point the stage's output folders at the job's folder (unless the job's
    overrides set them) and record the job in ``sweep.json``; outside a multirun, nothing."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        yield
        return
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    # An output folder the job's overrides set per job (``output_dir='runs/x/${hydra:job.num}'`` or a swept value)
    # is kept; one that every job shares would have each job resume or overwrite the one before it.
    per_job = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "${" in o or _swept(o)}
    with open_dict(cfg):
        for key in out_keys:
            if key in per_job:
                continue
            if any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides):
                log.warning("sweep: %s=%s is the same for every job; job %s writes into %s instead",
                            key, OmegaConf.select(cfg, key), hc.job.num, job_dir)
            OmegaConf.update(cfg, key, str(job_dir), merge=False)
    record = {"stage": stage, "job": int(hc.job.num), "overrides": overrides, "started": time.time(),
              "finished": False}
    job_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(job_dir / SWEEP_FILE, json.dumps(record, indent=1))
    start = time.perf_counter()
    yield
    record.update(finished=True, seconds=time.perf_counter() - start)
    atomic_write_text(job_dir / SWEEP_FILE, json.dumps(record, indent=1))


def _swept(override: str) -> bool:
    """Whether the command line swept this override's key (``key=a,b``): its job value differs from the argument."""
    key = override.split("=", 1)[0]
    given = [a for a in sys.argv[1:] if a.split("=", 1)[0] == key]
    return bool(given) and given[-1] != override


def varying_overrides(per_job: list[list[str]]) -> list[list[str]]:
    """Each job's overrides whose key takes more than one value across the sweep (the levers; the settings every
    job shares are left out). A sweep of one job keeps all of its overrides."""
    if len(per_job) < 2:
        return per_job
    values: dict[str, set[str]] = {}
    for overrides in per_job:
        for o in overrides:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    counts = {k: sum(any(o.partition("=")[0] == k for o in ov) for ov in per_job) for k in values}
    return [[o for o in ov if len(values[o.partition("=")[0]]) > 1 or counts[o.partition("=")[0]] < len(per_job)]
            for ov in per_job]


def short_overrides(overrides: list[str]) -> str:
    """``train.head_init=verifier ttt.ttt_steps=2`` -> ``head_init=verifier ttt_steps=2``."""
    return " ".join(o.split("=", 1)[0].rsplit(".", 1)[-1] + "=" + o.split("=", 1)[1] if "=" in o else o
                    for o in overrides)


def _training_figures(job_dir: Path) -> dict[str, Any]:
    """Steps, tokens trained, training minutes and the last held-out figures from a run's metrics.jsonl."""
    path = job_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/acc_0" in r]
    out: dict[str, Any] = {}
    if steps:
        out["steps"] = steps[-1]["step"]
        out["tokens"] = steps[-1].get("tokens_seen")
        out["minutes"] = (records[-1]["time"] - records[0]["time"]) / 60
    if evals:
        out["acc_0"] = evals[-1]["eval/acc_0"]
        out["tau_sim"] = evals[-1].get("eval/tau_sim")
    return out


def _eval_rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{row name: {set, tau, speedup, interval}}`` for every drafter row of the first prompt set."""
    rows: dict[str, dict[str, Any]] = {}
    for set_name, entry in report.get("sets", {}).items():
        for name, d in entry.get("drafters", {}).items():
            if d.get("method") != "plain" and name not in rows:
                rows[name] = {"set": set_name, "tau": d.get("tau"), "speedup": d.get("speedup"),
                              "interval": d.get("speedup_interval")}
    return rows


def sweep_table(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per (job, drafter): the job's overrides and training figures with the τ and speed-up measured for it,
    either by an evaluation of the whole sweep (``<sweep>/eval/report.json`` or any ``*/report.json`` whose rows
    name the jobs) or by the job's own report (an eval sweep)."""
    sweep_dir = Path(sweep_dir)
    jobs = sweep_jobs(sweep_dir)
    if not jobs:
        raise ConfigError(f"{sweep_dir} holds no sweep jobs (no */{SWEEP_FILE})",
                          fix="give the folder a `fledge <stage> -m ...` run printed (runs/sweeps/<stage>/<time>)")
    joint: dict[str, dict[str, Any]] = {}
    for report_path in sorted(sweep_dir.glob("*/report.json")):
        if not (report_path.parent / SWEEP_FILE).is_file():
            joint.update(_eval_rows(json.loads(report_path.read_text())))
    varying = varying_overrides([r.get("overrides", []) for _, r in jobs])
    table = []
    for (job_dir, record), lever in zip(jobs, varying):
        base = {"job": record.get("job"), "stage": record.get("stage"), "overrides": short_overrides(lever),
                "finished": record.get("finished"),
                **_training_figures(job_dir)}
        own = job_dir / "report.json"
        rows = {name: r for name, r in joint.items() if name.endswith(f"#{record.get('job')}")}
        if own.is_file():
            rows.update(_eval_rows(json.loads(own.read_text())))
        if not rows:
            table.append(base)
        for name, r in rows.items():
            table.append({**base, "drafter": name.split("#")[0], **r})
    return table


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table_markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| job | overrides | drafter | τ | speed-up [95% interval] | steps | tokens trained | train min "
            "| held-out acc_0 |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lo, hi = r.get("interval") or (None, None)
        speed = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x [{_fmt(lo, '.2f')}, {_fmt(hi, '.2f')}]"
        lines.append(
            f"| {r['job']} | {r['overrides'] or '(defaults)'}{'' if r.get('finished') else ' (unfinished)'} | "
            f"{r.get('drafter', '-')} | {_fmt(r.get('tau'), '.2f')} | {speed} | {_fmt(r.get('steps'), 'd')} | "
            f"{_fmt(r.get('tokens'), ',d')} | {_fmt(r.get('minutes'), '.1f')} | {_fmt(r.get('acc_0'), '.3f')} |"
        )
    return "\n".join(lines)


def plot_tau(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """τ against training minutes, one point per (job, drafter), labelled with the job's overrides."""
    points = [r for r in rows if r.get("tau") is not None and r.get("minutes") is not None]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for drafter in sorted({r["drafter"] for r in points}):
        mine = [r for r in points if r["drafter"] == drafter]
        ax.scatter([r["minutes"] for r in mine], [r["tau"] for r in mine], label=drafter)
        for r in mine:
            ax.annotate(r["overrides"] or "(defaults)", (r["minutes"], r["tau"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("acceptance length τ")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table_main(argv: list[str]) -> int:
    """``fledge sweep table SWEEP_DIR``: print the table, write ``table.md`` and ``tau.png`` into the folder."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: fledge sweep table SWEEP_DIR   (the folder of a `fledge <stage> -m ...` run: "
              "runs/sweeps/<stage>/<time>)")
        return 2
    sweep_dir = Path(argv[0])
    rows = sweep_table(sweep_dir)
    text = table_markdown(rows)
    atomic_write_text(sweep_dir / "table.md", text + "\n")
    print(text)
    print(f"\ntable: {sweep_dir / 'table.md'}")
    png = plot_tau(rows, sweep_dir / "tau.png")
    if png is not None:
        print(f"plot:  {png}")
    return 0
