"""Training logs: wandb (offline by default), the same records in a local JSONL, and a tqdm bar on rank 0.

Records are flat dicts: ``loss``, ``ploss_i``, ``acc_i``, ``tau_sim``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``skipped_steps``, ... and ``eval/...`` for evaluations, each with its optimizer ``step``.

``tau_sim`` is the acceptance length that the per-step accuracies imply for chain drafting,
``tau_sim = 1 + sum_k prod_{i<=k} acc_i``: draft token k is accepted only if tokens 0..k are, and acc_i stands in
for the conditional acceptance of depth i (the TTT unroll conditions step i on the draft's own earlier steps, as
inference does). It is an estimate for comparing runs; eval/ measures the real tau with the speculative loop.
``tau_chain`` is counted rather than implied: from each position, the unroll's steps in a row whose top-1 is the
teacher's (``train.ttt.ttt_forward``), which does not assume the steps' agreements independent.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LogConfig:
    wandb_mode: str = "offline"
    """'offline' (a local run under <output_dir>/wandb, `wandb sync` uploads it later), 'online' or 'disabled'."""
    project: str = "fledge"
    """wandb project."""
    run_name: str | None = None
    """wandb run name; None uses the output directory's name."""
    jsonl: str | None = None
    """Path of the JSONL log; None means <output_dir>/metrics.jsonl."""
    every: int = 1
    """Log a training record every N optimizer steps (metrics are averaged over the steps in between)."""
    progress: bool = True
    """Show a tqdm progress bar with ETA on rank 0."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"log.wandb_mode must be one of {WANDB_MODES}, got {self.wandb_mode!r}")
        if self.every < 1:
            raise ConfigError(f"log.every must be >= 1, got {self.every}")


def tau_sim(accs: list[float]) -> float:
    """Simulated acceptance length of chain drafting: 1 + sum_k prod_{i<=k} acc_i."""
    total, survive = 1.0, 1.0
    for a in accs:
        survive *= a
        total += survive
    return total


def with_tau(record: dict[str, float], prefix: str = "") -> dict[str, float]:
    accs = []
    while f"{prefix}acc_{len(accs)}" in record:
        accs.append(record[f"{prefix}acc_{len(accs)}"])
    if accs:
        record[f"{prefix}tau_sim"] = tau_sim(accs)
    return record


class MetricsLogger:
    """wandb + JSONL on rank 0; every other rank gets a logger that does nothing."""

    def __init__(
        self, cfg: LogConfig, output_dir: Path, jsonl_path: Path, config: dict[str, Any], is_main: bool,
        start_step: int, total_steps: int | None,
    ) -> None:
        """``total_steps``: where the progress bar ends (None: a run sized by time, counted without an end)."""
        self.is_main = is_main
        self.run = None
        self.bar = None
        self.jsonl = None
        if not is_main:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        # A resumed run repeats the steps after its checkpoint: drop their old records so each step appears once.
        if jsonl_path.is_file():
            kept = [line for line in jsonl_path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
            jsonl_path.write_text("".join(line + "\n" for line in kept))
        self.jsonl = open(jsonl_path, "a", buffering=1)
        if cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                mode=cfg.wandb_mode,
                project=cfg.project,
                name=cfg.run_name or output_dir.resolve().name,
                dir=str(output_dir),
                config=config,
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any], step: int) -> None:
        if not self.is_main:
            return
        row = {"step": step, "time": time.time(), **record}
        self.jsonl.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log(record, step=step)
        if self.bar is not None and "loss" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record.get('acc_0', 0):.2f}", refresh=False)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()
        if self.jsonl is not None:
            self.jsonl.close()
