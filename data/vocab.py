"""The draft vocabulary: the verifier tokens the draft head can propose, and the maps between the two id spaces.

Convention (EAGLE-3, vLLM, SGLang): ``d2t[i]`` is an offset, ``target_id = i + d2t[i]``; ``t2d`` is a bool mask over
the verifier vocabulary marking the chosen tokens. The chosen target ids are sorted ascending, so draft id order
follows target id order and ``target_probs[..., t2d]`` lines up column for column with the draft's logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fledge.core.files import atomic_write
from fledge.data.template import Tokenized
from fledge.models.draft import draft_vocab_problems


def count_tokens(samples: Iterable[Tokenized], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: how often each token id occurs at loss-masked positions (the ones the draft must predict)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for sample in samples:
        ids = torch.tensor(sample.input_ids, dtype=torch.int64)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        if ids.shape != mask.shape:
            raise ValueError(f"a sample has {ids.numel()} input ids but {mask.numel()} loss-mask entries")
        masked = ids[mask]
        if masked.numel() and (masked.min() < 0 or masked.max() >= vocab_size):
            bad = masked[(masked < 0) | (masked >= vocab_size)][0].item()
            raise ValueError(f"token id {bad} is outside the verifier vocabulary of {vocab_size}")
        counts += torch.bincount(masked, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab_size], t2d bool [V]) for the ``draft_vocab_size`` most frequent tokens.

    Ties go to the lower id. When fewer distinct tokens were seen than the draft vocabulary holds, the lowest unseen
    ids fill it, so the map stays a valid injection whatever the corpus size.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D [vocab_size], got shape {tuple(counts.shape)}")
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} must be between 1 and the verifier's vocab_size {vocab_size}"
        )
    # A stable descending sort keeps equal counts in ascending id order: that is both the tie-break and, for the
    # zero counts at the tail, the padding with the lowest unused ids.
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    chosen = order[:draft_vocab_size].sort().values
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Verifier token ids for draft token ids (any shape)."""
    return draft_ids + d2t[draft_ids]


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError naming the first thing wrong with a (d2t, t2d) pair; return None when it is valid."""
    if d2t.dim() != 1 or d2t.dtype != torch.int64:
        raise ValueError(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} of shape {tuple(d2t.shape)}")
    if t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise ValueError(f"t2d must be a 1-D bool tensor, got {t2d.dtype} of shape {tuple(t2d.shape)}")
    k, vocab_size = d2t.numel(), t2d.numel()
    if k == 0 or k > vocab_size:
        raise ValueError(f"draft vocab size {k} must be between 1 and the verifier's vocab_size {vocab_size}")
    problems = draft_vocab_problems(d2t, t2d)
    if problems:
        raise ValueError(problems[0].message)


def save_draft_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor) -> None:
    """One safetensors file with ``d2t``, ``t2d`` and the ``counts`` they were chosen from."""
    check_draft_vocab(d2t, t2d)
    if counts.numel() != t2d.numel():
        raise ValueError(f"counts cover {counts.numel()} ids but t2d covers {t2d.numel()}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "counts": counts.to(torch.int64).contiguous()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))


def load_token_counts(path: Path) -> torch.Tensor:
    """The token counts [vocab_size] a draft vocabulary file was chosen from (``save_draft_vocab``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no draft vocabulary file")
    tensors = load_file(str(path))
    if "counts" not in tensors:
        raise ValueError(f"{path}: holds no token counts (written before they were kept)")
    return tensors["counts"]


def load_draft_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a file written by ``save_draft_vocab``, checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no draft vocabulary file")
    tensors = load_file(str(path))
    missing = {"d2t", "t2d"} - set(tensors)
    if missing:
        raise ValueError(f"{path}: not a draft vocabulary (missing {sorted(missing)})")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    try:
        check_draft_vocab(d2t, t2d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return d2t, t2d
