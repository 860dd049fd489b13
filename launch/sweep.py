"""Sweeps the Hydra way (each job's folder and ``sweep.json``), and the ``fledge sweep table|budget`` commands; the
tables and plots themselves are built in ``eval/sweeps.py``.

    fledge train -m train.head_init=random,verifier ttt.ttt_steps=2,4 cache_dir=runs/quickstart/cache ...
    fledge eval draft=runs/sweeps/train/<time> eval.out_dir=runs/sweeps/train/<time>/eval   # every job's draft
    fledge sweep table runs/sweeps/train/<time>                                              # table.md + tau.png

Under ``-m`` each job writes its outputs (``Stage.out_keys``) into its own job folder, ``<sweep>/<job number>/``,
with ``sweep.json``: the stage, the job's overrides, its start, its seconds and whether it finished. ``fledge eval``
given a sweep folder evaluates every finished training job's draft side by side, interleaved prompt by prompt, as
rows ``eagle3#<job>``. The table joins what each job trained (steps, tokens, minutes, held-out acc_0) with what
the evaluation measured (τ, speed-up and its interval).

What a larger budget buys is a table of whole runs rather than of one sweep's jobs:

    fledge quickstart budget_minutes=60 run_dir=runs/qs60
    fledge eval draft=runs/qs60/train eval.out_dir=runs/qs60_e24 eval.max_prompts=24 ...   # optional, larger eval
    fledge sweep budget runs/qs20 runs/qs60 runs/qs60_e24 --out runs/budget                 # budget.md + budget.png

Each quickstart run gives its budget, plan against actual and training figures; each set's τ comes from the largest
``fledge eval`` of ``<run>/train`` among the folders given, and from the quickstart's own evaluation only where none
was given (its own stops at a time limit, so its prompts differ from run to run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from fledge.core.files import atomic_write_text
from fledge.core.sweep import SWEEP_FILE
from fledge.eval.sweeps import budget_markdown, budget_table, plot_budget, plot_tau, sweep_table, table_markdown

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


def table_main(argv: list[str]) -> int:
    """``fledge sweep table SWEEP_DIR``: print the table, write ``table.md`` and ``tau.png`` into the folder."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: fledge sweep table SWEEP_DIR   (the folder of a `fledge <stage> -m ...` run: "
              "runs/sweeps/<stage>/<time>)")
        return 2
    sweep_dir = Path(argv[0])
    rows = sweep_table(sweep_dir)
    return _write_table(table_markdown(rows), sweep_dir / "table.md", plot_tau(rows, sweep_dir / "tau.png"))


def _write_table(text: str, path: Path, png: Path | None) -> int:
    """Write and print a table, then say where it and its plot are."""
    atomic_write_text(path, text + "\n")
    print(text)
    print(f"\ntable: {path}")
    if png is not None:
        print(f"plot:  {png}")
    return 0


def budget_main(argv: list[str]) -> int:
    """``fledge sweep budget FOLDER... [--out DIR]``: print the table, write ``budget.md`` and ``budget.png``."""
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        if at + 1 >= len(argv):
            argv = []
        else:
            out, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: fledge sweep budget FOLDER... [--out DIR]   (quickstart run folders, training output folders "
              "and fledge eval out_dirs of their drafts)")
        return 2
    rows = budget_table(argv)
    out = out or Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    return _write_table(budget_markdown(rows), out / "budget.md", plot_budget(rows, out / "budget.png"))
