"""Where a trained draft lives on disk, and reading it back: the folder format training writes, evaluation and
export read.

A draft folder holds three files::

    model.safetensors     the draft's trainable weights + d2t / t2d (``Eagle3Draft.trainable_state_dict``)
    draft_config.json     ``Eagle3Config``
    fledge.json           provenance: verifier (name, path, fingerprint), aux layer ids, cache, step

A training run keeps them in ``<run>/draft/`` (the final weights) and in each complete checkpoint
``<run>/checkpoints/step-NNNNNN/`` (beside the training state, see ``train/checkpoint.py``). ``draft_folder`` finds
the draft in any of those places. The verifier's embedding is never stored: ``load_draft`` reads it from the
verifier, and refuses a verifier with other weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fledge.core.errors import FledgeError
from fledge.core.files import publish_dir, staging_dir
from fledge.models.draft import Eagle3Config, Eagle3Draft

WEIGHTS = "model.safetensors"
DRAFT_CONFIG = "draft_config.json"
META = "fledge.json"
FINAL_DRAFT = "draft"
"""A run's final weights: ``<run>/draft/``."""
CHECKPOINTS = "checkpoints"
"""A run's checkpoints: ``<run>/checkpoints/step-NNNNNN/``."""
STEP_DIR = re.compile(r"^step-(\d{6,})$")


class DraftNotFound(FledgeError, FileNotFoundError):
    """No trained draft where one was expected."""


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


def write_draft(folder: Path, weights: dict[str, torch.Tensor], config: Eagle3Config, meta: dict[str, Any]) -> None:
    """The draft's weights, config and provenance into ``folder`` (a checkpoint's export part)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / DRAFT_CONFIG).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")


def write_final_draft(
    output_dir: Path, weights: dict[str, torch.Tensor], config: Eagle3Config, meta: dict[str, Any]
) -> Path:
    """``<output_dir>/draft/``, written aside and swapped into place: a reader never sees half of it."""
    final = Path(output_dir) / FINAL_DRAFT
    tmp = staging_dir(final)
    write_draft(tmp, weights, config, meta)
    publish_dir(tmp, final)
    return final


def draft_folder(path: str | Path) -> Path:
    """The folder holding draft weights for a run dir (its ``draft/``, else its latest checkpoint), a checkpoints
    dir (the latest), a step folder or a draft folder."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    if (path / FINAL_DRAFT / WEIGHTS).is_file():
        return path / FINAL_DRAFT
    for ckpt_dir in (path, path / CHECKPOINTS):
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            return latest
    raise DraftNotFound(
        f"{path}: no draft weights (neither {WEIGHTS}, {FINAL_DRAFT}/, nor a complete step-* checkpoint)",
        fix="point at a `fledge train` output dir, one of its step folders, or an exported checkpoint",
    )


def read_meta(folder: Path) -> dict[str, Any]:
    """The provenance record of a draft folder ({} when it has none)."""
    path = Path(folder) / META
    return json.loads(path.read_text()) if path.is_file() else {}


def read_draft_config(folder: Path) -> Eagle3Config:
    """The ``Eagle3Config`` a draft folder or checkpoint was written with."""
    return Eagle3Config.from_dict(json.loads((Path(folder) / DRAFT_CONFIG).read_text()))


def load_draft(
    path: str | Path, verifier_dir: str | Path | None = None, device: str | torch.device = "cpu",
    check_verifier: bool = True,
) -> Eagle3Draft:
    """A trained draft, ready for inference: config, weights, d2t / t2d, and the verifier's embedding (read from
    the verifier recorded at training time, or ``verifier_dir``; a verifier with other weights is refused)."""
    from fledge.models.verifier import check_fingerprint, load_embed_and_head

    folder = draft_folder(path)
    config = read_draft_config(folder)
    meta = read_meta(folder)
    vdir = Path(verifier_dir) if verifier_dir is not None else Path(meta["verifier"]["path"])
    if check_verifier and meta["verifier"].get("fingerprint"):
        check_fingerprint(vdir, meta["verifier"]["fingerprint"], f"the draft in {folder}")
    draft = Eagle3Draft(config)
    embed, _ = load_embed_and_head(vdir)
    draft.load_verifier_embedding(embed.float())
    weights = load_file(str(folder / WEIGHTS))
    draft.set_draft_vocab(weights["d2t"], weights["t2d"])
    draft.load_trainable_state_dict(weights)
    return draft.to(device).eval()
