"""The folder of a Hydra sweep (``fledge <stage> -m ...``): one job folder per job, each with ``sweep.json``.

``launch/sweep.py`` writes the records, ``eval/sweeps.py`` tabulates a sweep; ``fledge eval`` reads a training
sweep's jobs to evaluate their drafts side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SWEEP_FILE = "sweep.json"
"""In each job folder: ``{"stage", "job", "overrides", "started", "finished", "seconds"}``."""


def sweep_jobs(sweep_dir: str | Path, stage: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The job folders of a sweep (those with ``sweep.json``), by job number; optionally of one stage only."""
    jobs = []
    for path in Path(sweep_dir).glob(f"*/{SWEEP_FILE}"):
        record = json.loads(path.read_text())
        if stage is None or record.get("stage") == stage:
            jobs.append((path.parent, record))
    return sorted(jobs, key=lambda j: j[1].get("job", 0))


def is_sweep_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and any(Path(path).glob(f"*/{SWEEP_FILE}"))
