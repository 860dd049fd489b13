"""What sweeps and budgets bought, as tables and plots: a Hydra sweep's jobs (``fledge sweep table``) and whole runs
at several budgets (``fledge sweep budget``), each joining what was trained (a run's ``metrics.jsonl``, a
quickstart's ``budget.json``) with what ``fledge eval`` measured on its draft (``report.json``). The commands
themselves, and the sweep's job records, are in ``launch/sweep.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.core.files import renamed_file
from fledge.core.sweep import SWEEP_FILE, sweep_jobs
from fledge.eval.metrics import REFERENCE_DRAFTER
from fledge.eval.report import EvalReport
from fledge.eval.summary import new_figure, save_figure


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


def _draft_vocab(job_dir: Path) -> int | None:
    """The trained draft's vocabulary (its ``draft/draft_config.json``), for runs whose plan did not choose it."""
    path = job_dir / "draft" / "draft_config.json"
    return json.loads(path.read_text()).get("draft_vocab_size") if path.is_file() else None


def _eval_rows(report: EvalReport) -> dict[str, dict[str, Any]]:
    """``{row name: {set, tau, speedup, interval}}`` for every drafter row of the first prompt set."""
    rows: dict[str, dict[str, Any]] = {}
    for set_name, name, d in report.drafter_rows():
        if name not in rows:
            rows[name] = {"set": set_name, "tau": d.tau, "speedup": d.speedup, "interval": d.speedup_interval}
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
            joint.update(_eval_rows(EvalReport.load(report_path)))
    varying = varying_overrides([r.get("overrides", []) for _, r in jobs])
    table = []
    for (job_dir, record), lever in zip(jobs, varying):
        base = {"job": record.get("job"), "stage": record.get("stage"), "overrides": short_overrides(lever),
                "finished": record.get("finished"),
                **_training_figures(job_dir)}
        own = job_dir / "report.json"
        rows = {name: r for name, r in joint.items() if name.endswith(f"#{record.get('job')}")}
        if own.is_file():
            rows.update(_eval_rows(EvalReport.load(own)))
        if not rows:
            table.append(base)
        for name, r in rows.items():
            table.append({**base, "drafter": name.split("#")[0], **r})
    return table


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _ratio(value: Any, interval: Any) -> str:
    if value is None:
        return "-"
    lo, hi = interval or (None, None)
    return f"{value:.2f}x [{_fmt(lo, '.2f')}, {_fmt(hi, '.2f')}]"


def table_markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| job | overrides | drafter | τ | speed-up [95% interval] | steps | tokens trained | train min "
            "| held-out acc_0 |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['job']} | {r['overrides'] or '(defaults)'}{'' if r.get('finished') else ' (unfinished)'} | "
            f"{r.get('drafter', '-')} | {_fmt(r.get('tau'), '.2f')} | {_ratio(r.get('speedup'), r.get('interval'))} | "
            f"{_fmt(r.get('steps'), 'd')} | {_fmt(r.get('tokens'), ',d')} | {_fmt(r.get('minutes'), '.1f')} | "
            f"{_fmt(r.get('acc_0'), '.3f')} |"
        )
    return "\n".join(lines)


def _save_tau_figure(fig: Any, ax: Any, path: Path) -> Path:
    """τ against training minutes: label the axes, save the PNG, close the figure."""
    ax.set(xlabel="training minutes", ylabel="acceptance length τ")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=120)


def plot_tau(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """τ against training minutes, one point per (job, drafter), labelled with the job's overrides."""
    points = [r for r in rows if r.get("tau") is not None and r.get("minutes") is not None]
    if not points:
        return None
    fig, ax = new_figure(figsize=(7, 4.5))
    for drafter in sorted({r["drafter"] for r in points}):
        mine = [r for r in points if r["drafter"] == drafter]
        ax.scatter([r["minutes"] for r in mine], [r["tau"] for r in mine], label=drafter)
        for r in mine:
            ax.annotate(r["overrides"] or "(defaults)", (r["minutes"], r["tau"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    return _save_tau_figure(fig, ax, path)


# ---- what a larger budget buys: whole runs, not one sweep's jobs

BUDGET_FILE = "budget.json"
"""What ``fledge quickstart`` writes into its run folder (``plan/budget.py: BudgetPlan``): the budget, the plan's
sizes and plan against actual."""
OLD_BUDGET_FILE = "plan.json"
"""Its name in run folders of fledge before 2026-12-05 (still read)."""


def _runs_and_reports(folders: list[Path]) -> tuple[list[dict[str, Any]], list[tuple[Path, EvalReport, bool]]]:
    """Split the folders given into runs (a quickstart run folder, with ``budget.json``; or a training output, with
    ``metrics.jsonl``) and evaluations (a folder with ``report.json`` and no plan), each evaluation with whether it
    was named (True) or is a quickstart run's own ``eval/`` (False)."""
    runs, reports = [], []
    for folder in folders:
        budget = renamed_file(folder, BUDGET_FILE, OLD_BUDGET_FILE)
        if budget.is_file():
            plan = json.loads(budget.read_text())
            runs.append({"folder": folder, "draft": folder / "train", "plan": plan})
            if (folder / "eval" / "report.json").is_file():
                reports.append((folder / "eval", EvalReport.load(folder / "eval"), False))
        elif (folder / "metrics.jsonl").is_file():
            runs.append({"folder": folder, "draft": folder, "plan": None})
        elif (folder / "report.json").is_file():
            reports.append((folder, EvalReport.load(folder), True))
        else:
            raise ConfigError(f"{folder} is neither a run nor an evaluation (no {BUDGET_FILE}, metrics.jsonl or "
                              "report.json)",
                              fix="give quickstart run folders, training output folders and fledge eval out_dirs")
    if not runs:
        raise ConfigError("no run among the folders given",
                          fix=f"give at least one quickstart run folder (with {BUDGET_FILE}) or training output folder")
    return runs, reports


def budget_table(folders: list[str | Path]) -> list[dict[str, Any]]:
    """One row per (run, prompt set, drafter): the run's budget, data, training figures and wall time beside τ,
    speed-up and throughput over prompt lookup from the largest evaluation of its draft (most prompts; the later
    folder given on a tie). An evaluation named among the folders wins over a quickstart run's own, whatever their
    sizes: the named ones are those run with one setting for every run compared (the quickstart's own stops at its
    time limit and decodes fewer tokens). An evaluation of a draft that none of the runs trained is refused by
    name."""
    runs, reports = _runs_and_reports([Path(f) for f in folders])
    by_draft = {run["draft"].resolve(): run for run in runs}
    chosen: dict[tuple[Path, str], tuple[Path, EvalReport, tuple[bool, int]]] = {}
    for folder, report, named in reports:
        path = (report.draft or {}).get("path")
        draft = Path(path or "").resolve()
        if draft not in by_draft:
            raise ConfigError(f"{folder}/report.json evaluates {path}, which none of the runs given trained",
                              fix="give the run folder too, or leave the evaluation out")
        for set_name, entry in report.sets.items():
            best, rank = chosen.get((draft, set_name)), (named, entry.num_prompts)
            if best is None or rank >= best[2]:
                chosen[(draft, set_name)] = (folder, report, rank)
    table = []
    for run in runs:
        plan = run["plan"] or {}
        base = {"run": run["folder"].name,
                "budget": plan["budget_s"] / 60 if plan.get("budget_s") else None,
                "conversations": plan.get("sizes", {}).get("cache"), "epochs": plan.get("sizes", {}).get("train"),
                "vocab": plan.get("shapes", {}).get("draft_vocab_size") or _draft_vocab(run["draft"]),
                "wall_minutes": sum(plan["actual_s"].values()) / 60 if plan.get("actual_s") else None,
                **_training_figures(run["draft"])}
        sets = [(s, f, r) for (d, s), (f, r, _) in chosen.items() if d == run["draft"].resolve()]  # as reported
        if not sets:
            table.append(base)
        for set_name, folder, report in sets:
            entry = report.sets[set_name]
            for name, d in entry.drafters.items():
                vs = d.vs_prompt_lookup or {}
                table.append({**base, "set": set_name, "drafter": name, "prompts": entry.num_prompts,
                              "report": str(folder), "tau": d.tau, "speedup": d.speedup,
                              "interval": d.speedup_interval, "vs_lookup": vs.get("throughput_ratio"),
                              "vs_lookup_interval": vs.get("interval")})
    return table


def budget_markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| run | budget min | conversations planned | epochs | draft vocab | steps | tokens trained | train min "
            "| wall min "
            "| held-out acc_0 | set | prompts | drafter | τ | speed-up [95%] | vs prompt lookup [95%] |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['run']} | {_fmt(r.get('budget'), '.0f')} | {_fmt(r.get('conversations'), 'd')} | "
            f"{_fmt(r.get('epochs'), '.2f')} | {_fmt(r.get('vocab'), ',d')} | {_fmt(r.get('steps'), 'd')} | "
            f"{_fmt(r.get('tokens'), ',d')} | "
            f"{_fmt(r.get('minutes'), '.1f')} | {_fmt(r.get('wall_minutes'), '.1f')} | {_fmt(r.get('acc_0'), '.3f')} | "
            f"{r.get('set', '-')} | {_fmt(r.get('prompts'), 'd')} | {r.get('drafter', '-')} | "
            f"{_fmt(r.get('tau'), '.2f')} | {_ratio(r.get('speedup'), r.get('interval'))} | "
            f"{_ratio(r.get('vs_lookup'), r.get('vs_lookup_interval'))} |"
        )
    return "\n".join(lines)


def plot_budget(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """τ against training minutes, one line per (prompt set, drafter) through the runs, each point labelled with
    its budget; prompt lookup, which trains nothing, as a dotted level per set."""
    points = [r for r in rows if r.get("tau") is not None and r.get("minutes") is not None]
    if not points:
        return None
    fig, ax = new_figure(figsize=(7.5, 4.5))
    markers = {}
    for set_name, drafter in sorted({(r["set"], r["drafter"]) for r in points}):
        mine = sorted((r for r in points if r["set"] == set_name and r["drafter"] == drafter),
                      key=lambda r: r["minutes"])
        marker = markers.setdefault(set_name, "os^vDP"[len(markers) % 6])
        xs, ys = [r["minutes"] for r in mine], [r["tau"] for r in mine]
        if drafter == REFERENCE_DRAFTER:  # trains nothing: the same τ at every budget
            ax.axhline(sum(ys) / len(ys), linestyle=":", color="grey", linewidth=1)
            ax.annotate(f"{set_name}/{drafter}", (max(xs), sum(ys) / len(ys)), fontsize=7, color="grey",
                        xytext=(3, 3), textcoords="offset points")
            continue
        ax.plot(xs, ys, marker=marker, label=f"{set_name}/{drafter}")
        for r in mine:
            label = r["run"] if r.get("budget") is None else f"{r['budget']:.0f} min"
            ax.annotate(label, (r["minutes"], r["tau"]), fontsize=7, xytext=(3, -9), textcoords="offset points")
    return _save_tau_figure(fig, ax, path)
