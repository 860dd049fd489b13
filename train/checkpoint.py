"""Checkpoints: step-numbered folders that hold everything a resume needs, valid only once complete.

    checkpoints/step-000100/
        model.safetensors     the draft's trainable weights + d2t / t2d (``trainable_state_dict``): what export reads
        draft_config.json     ``Eagle3Config``
        fledge.json           verifier (name, path, fingerprint), aux layer ids, cache, step
        train_state.pt        step, data position (epoch, batch), skipped steps, tokens seen, world size
        rng-00000.pt ...      python / numpy / torch RNG states, one file per rank
        train_config.yaml     the resolved training config (a resume checks it against the new one)
        optimizer.pt, scheduler.pt    single process / DDP
        deepspeed/state/...   DeepSpeed's own engine checkpoint (optimizer partitions, scheduler) instead

A folder is written as ``step-000100.tmp`` and renamed when every rank has finished, so ``step-*`` folders are
always complete: a run killed at any moment resumes from the latest one and ends bitwise where an uninterrupted
run ends (same seed and world size, CPU). ``torch.load`` runs with ``weights_only=True`` throughout.
The final ``draft/`` of a run has the first three files only; ``models/draft_folder.py`` owns that format (and
finding the latest complete step folder), which evaluation and export read.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file

from fledge.core.config import FieldRef
from fledge.core.dist import DistInfo, barrier
from fledge.core.errors import ConfigError, MismatchError
from fledge.core.files import publish_dir
from fledge.models.draft import Eagle3Config
from fledge.models.draft_folder import WEIGHTS, complete_checkpoints, step_name, write_draft

if TYPE_CHECKING:
    from fledge.train.engine import Engine

log = logging.getLogger(__name__)

STATE = "train_state.pt"
TRAIN_CONFIG = "train_config.yaml"


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Where step folders go; None means <output_dir>/checkpoints."""
    every: int = 500
    """Save every N optimizer steps (and after the last step); 0 saves only at the end."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after each save."""
    resume: bool = True
    """Resume from the latest complete checkpoint in ``dir`` when there is one."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ConfigError(f"checkpoint.every must be >= 0 and checkpoint.keep_last >= 1 (got {self.every}, {self.keep_last})")


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken (skipped ones included)."""
    epoch: int = 0
    batch: int = 0
    """Data position: the next global micro-batch of ``epoch`` (see train/sampler.py)."""
    skipped_steps: int = 0
    """Steps whose update the non-finite guard skipped."""
    tokens_seen: int = 0
    """Real (non-padding) tokens of all ranks trained on so far."""
    seconds: float = 0.0
    """Loop time spent so far as rank 0 counts it, over every process of the run (``train.time_budget_minutes``)."""
    world_size: int = 1


def remove_stale(ckpt_dir: Path) -> None:
    """Delete half-written ``.tmp`` folders a killed run left behind."""
    if ckpt_dir.is_dir():
        for p in ckpt_dir.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)


def prune(ckpt_dir: Path, keep_last: int) -> None:
    for _, path in complete_checkpoints(ckpt_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        # numpy's key array becomes a tensor: weights_only loading accepts tensors, not numpy arrays.
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, key, gauss = state["python"]
    random.setstate((version, tuple(key), gauss))
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fault_point(where: str, step: int) -> None:
    """Tests kill the process here with SIGKILL (``FLEDGE_TRAIN_FAULT=save:4``: while writing step 4's folder)."""
    if os.environ.get("FLEDGE_TRAIN_FAULT") == f"{where}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(
    ckpt_dir: Path,
    engine: Engine,
    state: TrainState,
    draft_config: Eagle3Config,
    meta: dict[str, Any],
    train_config: dict[str, Any],
    info: DistInfo,
    keep_last: int,
) -> Path:
    """Write ``step-NNNNNN`` (every rank must call it: ZeRO shards are saved by their owners)."""
    final = ckpt_dir / step_name(state.step)
    tmp = ckpt_dir / f"{final.name}.tmp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    weights = engine.trainable_state_dict()  # a collective under ZeRO-3
    if info.is_main:
        write_draft(tmp, weights, draft_config, {**meta, "step": state.step})
        torch.save(asdict(state), tmp / STATE)
        from omegaconf import OmegaConf

        (tmp / TRAIN_CONFIG).write_text(OmegaConf.to_yaml(train_config))
    torch.save(rng_state(), tmp / f"rng-{info.rank:05d}.pt")
    _fault_point("save", state.step)
    engine.save_state(tmp, info)
    barrier()
    if info.is_main:
        publish_dir(tmp, final)  # replaces the same step saved by an earlier attempt of this run
        prune(ckpt_dir, keep_last)
    barrier()
    return final


RENAMED_SECTIONS = {"eval": "validation"}
"""Sections of the training config renamed since (old name -> new): a checkpoint of an earlier fledge is compared
under the new names (``eval`` was the held-out evaluation's section before 2026-12-05)."""


def check_resume(folder: Path, current: dict[str, Any], invariants: Iterable[FieldRef]) -> None:
    """Refuse to resume when one of ``invariants`` changed; the error names each field and the fix."""
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(OmegaConf.load(folder / TRAIN_CONFIG))
    for old, new in RENAMED_SECTIONS.items():
        if isinstance(saved, dict) and old in saved and new not in saved:
            saved[new] = saved.pop(old)
    changed = [
        f"{ref}: checkpoint has {ref.get(saved)!r}, this run has {ref.get(current)!r}"
        for ref in invariants
        if ref.get(saved) != ref.get(current)
    ]
    if changed:
        raise MismatchError(
            f"cannot resume from {folder}: these settings changed and would silently change which data each step "
            "sees or what the saved optimizer state means:\n  " + "\n  ".join(changed),
            fix="resume with the checkpoint's values, or start a fresh run (another output_dir / checkpoint.dir, "
            "or checkpoint.resume=false)",
        )


def load_checkpoint(folder: Path, engine: Engine, info: DistInfo) -> TrainState:
    """Restore weights, optimizer, scheduler, this rank's RNG states; returns the step and data position."""
    weights = load_file(str(folder / WEIGHTS))
    engine.load_state(folder, weights)
    state = TrainState(**torch.load(folder / STATE, weights_only=True))
    rng_file = folder / f"rng-{info.rank:05d}.pt"
    if not rng_file.is_file():
        raise MismatchError(
            f"{rng_file}: no RNG state for rank {info.rank} (the checkpoint has {state.world_size} ranks)",
            fix=f"resume with {state.world_size} ranks",
        )
    set_rng_state(torch.load(rng_file, weights_only=True))
    return state
