"""The verifier side of decoding: its KV cache with rollback, aux-feature capture, and plain decoding (the baseline).

Invariant kept by every loop in ``eval/``: the cache holds keys/values of every committed token except the newest
one; the newest token is the first input of the next verifier forward (the "root" of the next chain or tree).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from fledge.models.capture import Captured, capture_hidden
from fledge.models.sampling import SamplingParams, sample, target_probs
from fledge.models.verifier import cache_kwarg


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
    draft_steps: int = 0
    """Draft forward passes (tree: one per depth), for the draft/verifier cost ratio."""
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
deciding what is accepted (``accept``), rolling back or compacting the verifier's KV cache (``kv_update``), feeding
the committed tokens to the drafter (``draft_update``), and the loop's own bookkeeping and inputs (``other``)."""


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


class VerifierState:
    """A verifier's KV cache over the committed sequence, rolled back or compacted after each verification.

    With ``aux_layer_ids`` the hooks of ``capture_hidden`` stay installed for the state's lifetime (use it as a
    context manager), so that each forward also returns the three aux states of its positions, concatenated
    [n, 3H], for drafters that read the verifier's features.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        # No config: every layer is a plain DynamicLayer that keeps all positions, which ``keep`` relies on; a
        # sliding window is then enforced by the masks alone (the model's own masks, or ``tree_attention_mask``).
        self.cache = DynamicCache()
        self._cache_kwarg = cache_kwarg(model)
        self._hooks = ExitStack()
        self._captured: Captured | None = None
        if aux_layer_ids:
            self._captured = self._hooks.enter_context(capture_hidden(model, list(aux_layer_ids), final=False))

    def __enter__(self) -> VerifierState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._hooks.close()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``input_ids`` [n] to the cache; returns logits [n, V] (or [1, V]) and aux [n, 3H] or None.

        ``position_ids`` [n] and a 4D additive ``attention_mask`` [1, 1, n, length + n] are for tree inputs;
        without them the tokens continue the sequence causally.
        """
        out = self.model(
            input_ids=input_ids.view(1, -1),
            position_ids=None if position_ids is None else position_ids.view(1, -1),
            attention_mask=attention_mask,
            use_cache=True,
            **{self._cache_kwarg: self.cache},
            logits_to_keep=1 if last_only else 0,
        )
        aux = None
        if self._captured is not None:
            # with a device_map the captured layers and the head may sit on other GPUs than the inputs
            aux = torch.cat([a[0].to(self.device) for a in self._captured.aux], dim=-1)
        return out.logits[0].to(self.device), aux

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor | None:
        """Cache every prompt token but the last, which becomes the root of the first speculative round, so that
        even the first generated token comes out of a verification. Returns those positions' aux states."""
        if prompt_ids.numel() < 2:
            return None
        _, aux = self.forward(prompt_ids[:-1].to(self.device), last_only=True)
        return aux

    def crop(self, length: int) -> None:
        """Drop every cached position from ``length`` on."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep positions ``[0, start)`` and ``start + offsets`` (ascending), packed contiguously; drop the rest.

        After a tree pass only the accepted path survives; its positions are scattered through the tree block.
        The kept keys/values are moved down in place (a copy of a few rows), and the tail is cut off by a view.
        """
        contiguous = offsets == list(range(len(offsets)))
        if not contiguous:
            src = torch.tensor(offsets, device=self.device) + start
            for layer in self.cache.layers:
                if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer):
                    raise TypeError(f"cannot compact a {type(layer).__name__}; VerifierState needs DynamicLayer")
                # Advanced indexing copies first, so the overlapping destination cannot corrupt the source.
                layer.keys[..., start : start + len(offsets), :] = layer.keys[..., src, :]
                layer.values[..., start : start + len(offsets), :] = layer.values[..., src, :]
        self.crop(start + len(offsets))


def pick_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """The verifier's own next token from logits [V]: argmax, or a sample of its processed distribution."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return int(sample(target_probs(logits, sampling), generator))


@torch.inference_mode()
def generate_plain(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Plain autoregressive decoding with a KV cache: the baseline every speculative loop is measured against.

    It prefills as the speculative loops do (``VerifierState.prefill``: every prompt token but the last), and its
    first step is the last prompt token, as their first round's root is. Both then hold the same cached prompt,
    bit for bit, so in bf16 the two can part only where one verification forward of k+1 tokens rounds otherwise
    than k+1 forwards of one token; a prefill of the whole prompt would round the prompt's own keys differently too.
    """
    device = next(model.parameters()).device
    start = clock(device)
    state = VerifierState(model)
    state.prefill(prompt_ids)
    prefill = clock(device) - start
    tokens: list[int] = []
    step_input = prompt_ids[-1:].clone().to(device)
    logits, _ = state.forward(step_input, last_only=True)
    while True:
        token = pick_token(logits[-1], sampling, generator)
        tokens.append(token)
        if token in stop_ids or len(tokens) >= max_new_tokens:
            break
        step_input.fill_(token)
        logits, _ = state.forward(step_input, last_only=True)
    seconds = clock(device) - start
    return DecodeResult(tokens=tokens, prefill_seconds=prefill, seconds=seconds, verify_seconds=seconds - prefill,
                        parts={"verify": seconds - prefill})
