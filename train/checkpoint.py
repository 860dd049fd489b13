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
The final ``draft/`` of a run has the first three files only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from launch.dist import DistInfo
from models.draft import Eagle3Config, Eagle3Draft

if TYPE_CHECKING:
    from train.engine import Engine

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
DRAFT_CONFIG = "draft_config.json"
META = "fledge.json"
STATE = "train_state.pt"
TRAIN_CONFIG = "train_config.yaml"
STEP_DIR = re.compile(r"^step-(\d{6,})$")

# Config fields a resume must not change: they decide which data each step sees or what the optimizer state means.
# Everything else may change (max_steps / epochs extend or shorten the run and the cosine is recomputed from the
# resumed step; lr, warmup, clipping, dtype, logging, eval and checkpoint cadence apply from the resumed step on).
RESUME_INVARIANTS = (
    "train.seed",
    "train.micro_batch_size",
    "train.max_tokens",
    "train.grad_accum",
    "ttt.ttt_steps",
    "ttt.step_decay",
    "engine.kind",
    "engine.zero_stage",
    "eval.holdout",
    "world_size",
    "cache.num_conversations",
    "cache.verifier_fingerprint",
)


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
            raise ValueError(f"checkpoint.every must be >= 0 and checkpoint.keep_last >= 1 (got {self.every}, {self.keep_last})")


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
    world_size: int = 1


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first; ``.tmp`` folders are not checkpoints."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = complete_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def remove_stale(ckpt_dir: Path) -> None:
    """Delete half-written ``.tmp`` folders a killed run left behind."""
    if ckpt_dir.is_dir():
        for p in ckpt_dir.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)


def prune(ckpt_dir: Path, keep_last: int) -> None:
    for _, path in complete_checkpoints(ckpt_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def write_draft(folder: Path, weights: dict[str, torch.Tensor], config: Eagle3Config, meta: dict[str, Any]) -> None:
    """The draft's weights, config and provenance: a checkpoint's export part and the run's final ``draft/``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / DRAFT_CONFIG).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")


def write_final_draft(output_dir: Path, weights: dict[str, torch.Tensor], config: Eagle3Config, meta: dict[str, Any]) -> Path:
    final = output_dir / "draft"
    tmp = output_dir / "draft.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_draft(tmp, weights, config, meta)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


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


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


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
    _barrier()
    weights = engine.trainable_state_dict()  # a collective under ZeRO-3
    if info.is_main:
        write_draft(tmp, weights, draft_config, {**meta, "step": state.step})
        torch.save(asdict(state), tmp / STATE)
        from omegaconf import OmegaConf

        (tmp / TRAIN_CONFIG).write_text(OmegaConf.to_yaml(train_config))
    torch.save(rng_state(), tmp / f"rng-{info.rank:05d}.pt")
    _fault_point("save", state.step)
    engine.save_state(tmp, info)
    _barrier()
    if info.is_main:
        if final.exists():  # the same step saved by an earlier attempt of this run
            shutil.rmtree(final)
        tmp.rename(final)
        prune(ckpt_dir, keep_last)
    _barrier()
    return final


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def check_resume(folder: Path, current: dict[str, Any]) -> None:
    """Refuse to resume when a field of ``RESUME_INVARIANTS`` changed; the error names each field and the fix."""
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(OmegaConf.load(folder / TRAIN_CONFIG))
    changed = [
        f"{key}: checkpoint has {_get(saved, key)!r}, this run has {_get(current, key)!r}"
        for key in RESUME_INVARIANTS
        if _get(saved, key) != _get(current, key)
    ]
    if changed:
        raise ValueError(
            f"cannot resume from {folder}: these settings changed and would silently change which data each step "
            "sees or what the saved optimizer state means:\n  " + "\n  ".join(changed) + "\n"
            "Resume with the checkpoint's values, or start a fresh run (another output_dir / checkpoint.dir, "
            "or checkpoint.resume=false)."
        )


def load_checkpoint(folder: Path, engine: Engine, info: DistInfo) -> TrainState:
    """Restore weights, optimizer, scheduler, this rank's RNG states; returns the step and data position."""
    weights = load_file(str(folder / WEIGHTS))
    engine.load_state(folder, weights)
    state = TrainState(**torch.load(folder / STATE, weights_only=True))
    rng_file = folder / f"rng-{info.rank:05d}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file}: no RNG state for rank {info.rank} (the checkpoint has {state.world_size} ranks)")
    set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def draft_folder(path: str | Path) -> Path:
    """The folder holding draft weights for a run dir (its ``draft/``, else its latest checkpoint), a checkpoints
    dir (the latest), a step folder or a draft folder."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    if (path / "draft" / WEIGHTS).is_file():
        return path / "draft"
    for ckpt_dir in (path, path / "checkpoints"):
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"{path}: no draft weights (neither {WEIGHTS}, draft/, nor a complete step-* checkpoint)")


def load_draft(
    path: str | Path, verifier_dir: str | Path | None = None, device: str | torch.device = "cpu", check_verifier: bool = True
) -> Eagle3Draft:
    """A trained draft, ready for inference: config, weights, d2t / t2d, and the verifier's embedding (read from
    the verifier recorded at training time, or ``verifier_dir``; a verifier with other weights is refused)."""
    from models.verifier import load_embed_and_head, weight_fingerprint

    folder = draft_folder(path)
    config = Eagle3Config.from_dict(json.loads((folder / DRAFT_CONFIG).read_text()))
    meta = json.loads((folder / META).read_text())
    vdir = Path(verifier_dir) if verifier_dir is not None else Path(meta["verifier"]["path"])
    if check_verifier and meta["verifier"].get("fingerprint"):
        found = weight_fingerprint(vdir)
        if found != meta["verifier"]["fingerprint"]:
            raise ValueError(
                f"{vdir} is not the verifier the draft in {folder} was trained against (weight fingerprint "
                f"{found[:12]} != {meta['verifier']['fingerprint'][:12]}); pass the right verifier_dir"
            )
    draft = Eagle3Draft(config)
    embed, _ = load_embed_and_head(vdir)
    draft.load_verifier_embedding(embed.float())
    weights = load_file(str(folder / WEIGHTS))
    draft.set_draft_vocab(weights["d2t"], weights["t2d"])
    draft.load_trainable_state_dict(weights)
    return draft.to(device).eval()
