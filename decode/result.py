"""What one generation returns (``DecodeResult``) and how a round's time is charged to its parts (``RoundTimer``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeResult:
    """One generation: the tokens and what the loop measured on the way."""

    tokens: list[int]
    """Generated token ids (prompt excluded), cut after the first stop token or at max_new_tokens."""
    accepted: list[int] = field(default_factory=list)
    """Per verifier call after the prefill: how many draft tokens it accepted."""
    proposed: list[int] = field(default_factory=list)
    """Per verifier call: the longest draft path it checked (chain: drafts proposed; tree: tree depth)."""
    tree_nodes: list[int] = field(default_factory=list)
    """Per verifier call: draft tokens sent to the verifier (equals ``proposed`` for chains)."""
    topk_ranks: list[tuple[int, int]] = field(default_factory=list)
    """Greedy chains whose drafter recorded its top-k (``ChainDraft.top_ids``): per depth a round reached, (depth,
    rank of the verifier's token among the draft's top-k there; k when absent)."""
    topk_width: int = 0
    """The k of ``topk_ranks``."""
    draft_seconds: float = 0.0
    """Time spent proposing and updating the drafter (the ``draft`` and ``draft_update`` parts)."""
    verify_seconds: float = 0.0
    """Time spent in verifier forwards after the prefill, acceptance and cache rollback included (every part but
    the drafter's)."""
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    """Wall time of the whole generation, prefill included."""
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of the rounds after the prefill by part (``ROUND_PARTS``)."""

    @property
    def verifier_calls(self) -> int:
        return len(self.accepted)


ROUND_PARTS = ("draft", "verify", "accept", "kv_update", "draft_update", "other")
"""What a speculative round spends its time on: proposing (``draft``), the verifier's forward (``verify``),
deciding what is accepted (``accept``; with token recycling it includes the block's top-k, which gives the greedy
walk its argmax and the drafter the verifier's next tokens), rolling back or compacting the verifier's KV cache
(``kv_update``), feeding the committed tokens to the drafter (``draft_update``), and the loop's own bookkeeping and
inputs (``other``)."""


class RoundTimer:
    """Charges the wall time since the previous lap to a part of the round (a GPU is synchronised at each lap)."""

    def __init__(self, device: torch.device, result: DecodeResult) -> None:
        self.device = device
        self.result = result
        self.last = clock(device)

    def lap(self, part: str) -> None:
        now = clock(self.device)
        self.result.parts[part] = self.result.parts.get(part, 0.0) + now - self.last
        self.last = now

    def close(self) -> None:
        """Fill the result's two totals from its parts."""
        parts = self.result.parts
        self.result.draft_seconds = parts.get("draft", 0.0) + parts.get("draft_update", 0.0)
        self.result.verify_seconds = sum(v for k, v in parts.items() if k not in ("draft", "draft_update"))


def clock(device: torch.device) -> float:
    """perf_counter that waits for queued GPU work, so that draft and verifier times do not bleed into each other."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def stop_index(tokens: list[int], stop_ids: frozenset[int], limit: int) -> int | None:
    """Length to cut ``tokens`` to when it contains a stop token (kept) or exceeds ``limit``; None to go on."""
    for i, t in enumerate(tokens[:limit]):
        if t in stop_ids:
            return i + 1
    return limit if len(tokens) >= limit else None
