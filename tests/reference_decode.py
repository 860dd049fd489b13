"""The batch-1 decoding loops fledge started with, kept as the reference the one loop (``decode/loop.py``) is checked
against, as the dense attention is the TTT kernel's: a verifier KV cache of one row with crop and compaction
(``VerifierState``), plain decoding, the chain loop and the EAGLE-2 tree loop with its own 4D mask, and the
EAGLE-3 draft stepping one row with its own cache (``ReferenceEagle``), each written in the simplest form. Tests
decode with both and compare their tokens and acceptance; the χ² checks of ``eval/exactness.py`` run on the one
loop itself, at batch 1 and batch B.

Invariant of every loop: the cache holds keys/values of every committed token except the newest one; the newest
token is the first input of the next verifier forward (the "root" of the next chain or tree).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from fledge.decode.accept import greedy_accept, leviathan_accept, pick_token, walk_greedy, walk_sampled
from fledge.decode.drafters import EagleDrafter
from fledge.decode.loop import topk_ranks
from fledge.decode.proposals import (
    ChainDraft, Drafter, DraftTree, TreeShape, empty_tree, grow_tree, propose_chain_with,
)
from fledge.decode.result import DecodeResult, RoundTimer, clock, stop_index
from fledge.decode.session import sliding_window_of
from fledge.models.capture import Captured, capture_hidden
from fledge.models.draft import DraftKVCache, Eagle3Draft
from fledge.models.sampling import SamplingParams, target_probs
from fledge.models.verifier import cache_kwarg


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


@torch.inference_mode()
def generate_chain(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    aux_layer_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` [T]; lossless with respect to ``generate_plain``."""
    if drafter.needs_aux and not aux_layer_ids:
        raise ValueError("this drafter reads the verifier's aux hidden states: pass aux_layer_ids")
    device = next(model.parameters()).device
    result = DecodeResult(tokens=[])
    start = clock(device)
    with VerifierState(model, aux_layer_ids if drafter.needs_aux else None) as state:
        drafter.start(prompt_ids.cpu(), state.prefill(prompt_ids))
        result.prefill_seconds = clock(device) - start
        tokens: list[int] = []
        root = prompt_ids[-1:].clone().to(device)
        done = max_new_tokens <= 0
        timer = RoundTimer(device, result)
        while not done:
            # A round emits at most n+1 tokens; drafting past the budget would only cost time.
            draft = drafter.propose_chain(min(num_draft_tokens, max_new_tokens - len(tokens) - 1), sampling, generator)
            timer.lap("draft")
            n = draft.tokens.numel()
            draft_tokens = draft.tokens.to(device)
            verifier_input = torch.cat([root, draft_tokens])
            timer.lap("other")
            logits, aux = state.forward(verifier_input)
            timer.lap("verify")
            if sampling.greedy:
                accepted, next_token, predicted = greedy_accept(logits, draft_tokens)
                if draft.top_ids is not None:
                    result.topk_ranks += topk_ranks(predicted, draft.top_ids.to(device), accepted)
                    result.topk_width = int(draft.top_ids.shape[1])
            else:
                q = None if draft.q is None else draft.q.to(device)
                accepted, next_token = leviathan_accept(target_probs(logits, sampling), draft_tokens, q, generator)
            timer.lap("accept")
            # Keep the root and the accepted drafts; the rejected drafts' keys/values go.
            state.crop(state.length - n + accepted)
            timer.lap("kv_update")
            new_tokens = draft.tokens[:accepted].tolist() + [next_token]
            tokens.extend(new_tokens)
            root.fill_(next_token)
            result.accepted.append(accepted)
            result.proposed.append(n)
            result.tree_nodes.append(n)
            done = len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(new_tokens)
            timer.lap("other")
            if not done:
                drafter.advance(torch.tensor(new_tokens), None if aux is None else aux[: accepted + 1])
                timer.lap("draft_update")
        timer.close()
    result.tokens = tokens[: stop_index(tokens, stop_ids, max_new_tokens)]
    result.seconds = clock(device) - start
    return result


def tree_attention_mask(
    parents: torch.Tensor,
    depths: torch.Tensor,
    prefix_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[1, 1, M+1, prefix_length + M+1] additive mask (0 = attend, dtype min = masked) for [root, nodes]."""
    size = parents.numel() + 1
    device = parents.device
    parent_rows = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parents + 1])
    sees = torch.eye(size, dtype=torch.bool, device=device)
    # Each pass adds one more generation of ancestors; the deepest path needs depth passes.
    for _ in range(int(depths.max()) if depths.numel() else 0):
        sees = sees | sees[parent_rows]
    visible = torch.cat([torch.ones(size, prefix_length, dtype=torch.bool, device=device), sees], dim=1)
    if sliding_window is not None:
        row_depth = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths])
        key_pos = torch.cat([torch.arange(prefix_length, device=device), prefix_length + row_depth])
        query_pos = prefix_length + row_depth
        # The models' own rule (masking_utils.sliding_window_overlay): key visible iff q - k < window.
        visible &= (query_pos[:, None] - key_pos[None, :]) < sliding_window
    mask = torch.zeros(size, prefix_length + size, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, size, prefix_length + size)



@torch.inference_mode()
def generate_tree(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    *,
    shape: TreeShape,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    aux_layer_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` [T] with a draft tree per verifier call."""
    if not drafter.supports_tree:
        raise ValueError(f"{type(drafter).__name__} cannot propose trees; use the chain loop")
    if drafter.needs_aux and not aux_layer_ids:
        raise ValueError("this drafter reads the verifier's aux hidden states: pass aux_layer_ids")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    window = sliding_window_of(model)
    result = DecodeResult(tokens=[])
    start = clock(device)
    with VerifierState(model, aux_layer_ids if drafter.needs_aux else None) as state:
        drafter.start(prompt_ids.cpu(), state.prefill(prompt_ids))
        result.prefill_seconds = clock(device) - start
        tokens: list[int] = []
        root = prompt_ids[-1:].clone().cpu()
        done = max_new_tokens <= 0
        timer = RoundTimer(device, result)
        while not done:
            budget = max_new_tokens - len(tokens) - 1  # a path longer than this would be cut anyway
            if budget > 0:
                round_shape = shape.capped(budget)
                tree = drafter.propose_tree(round_shape, sampling, generator)
            else:
                tree = empty_tree()
            timer.lap("draft")
            prefix = state.length
            root_and_nodes = torch.cat([root, tree.tokens.cpu()]).to(device)
            depths = tree.depths.to(device)
            positions = prefix + torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths])
            mask = tree_attention_mask(tree.parents.to(device), depths, prefix, dtype, window)
            timer.lap("other")
            logits, aux = state.forward(root_and_nodes, positions, mask)
            timer.lap("verify")
            if sampling.greedy:
                path, next_token = walk_greedy(logits, tree)
            else:
                path, next_token = walk_sampled(logits, tree, sampling, generator)
            timer.lap("accept")
            state.keep(prefix + 1, path)
            timer.lap("kv_update")
            new_tokens = tree.tokens[path].tolist() + [next_token]
            tokens.extend(new_tokens)
            root.fill_(next_token)
            result.accepted.append(len(path))
            result.proposed.append(int(tree.depths.max()) if tree.size else 0)
            result.tree_nodes.append(tree.size)
            done = len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(new_tokens)
            timer.lap("other")
            if not done:
                rows = torch.tensor([0] + [node + 1 for node in path], device=device)
                drafter.advance(torch.tensor(new_tokens), None if aux is None else aux[rows])
                timer.lap("draft_update")
        timer.close()
    result.tokens = tokens[: stop_index(tokens, stop_ids, max_new_tokens)]
    result.seconds = clock(device) - start
    return result


class ReferenceEagle(EagleDrafter):
    """The EAGLE-3 draft stepping one row on its own, the reference ``BatchedEagle`` is checked against: the
    draft's KV cache holds one entry per position whose verifier features are known (``committed``); each round
    extends it with the features of the tokens the verifier just accepted, after dropping the speculative entries
    of the last proposal. A node at depth d sits at position committed - 1 + d and attends to the committed entries
    and its own ancestors (a 4D mask unless it is the chain's next node)."""

    def __init__(self, draft: Eagle3Draft, min_prob: float = 0.0):
        super().__init__(draft, min_prob)
        self.cache = DraftKVCache()
        self.committed = 0
        self.last_hidden: torch.Tensor | None = None
        self._reset_slots()

    def _reset_slots(self) -> None:
        self.slot_hidden: list[torch.Tensor] = []
        self.slot_depth: list[int] = []
        self.slot_entries: list[list[int]] = []  # cache indices of the slot's ancestors and itself

    @torch.inference_mode()
    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.cache = DraftKVCache()
        self.committed = 0
        self.last_hidden = None
        self._reset_slots()
        if aux is not None and aux.shape[0]:
            self._extend(context[1:].to(self.device), aux)

    @torch.inference_mode()
    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        if aux is None:
            raise ValueError("ReferenceEagle needs the verifier's aux states of the committed tokens")
        self._extend(new_tokens.to(self.device), aux)

    def _extend(self, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """Cache positions committed..committed+n-1: features aux[i] with the token after them, tokens[i]."""
        self.cache.crop(self.committed)
        n = tokens.numel()
        positions = torch.arange(self.committed, self.committed + n, device=self.device).view(1, n)
        fused = self.draft.fuse(aux.to(self.device).unsqueeze(0))
        hidden = self.draft(fused, tokens.view(1, n), positions, kv_cache=self.cache)
        self.committed += n
        self.last_hidden = hidden[0, -1]
        self._reset_slots()

    @torch.inference_mode()
    def root_logits(self) -> torch.Tensor:
        if self.last_hidden is None:
            # A one-token prompt: no verifier features yet, so no opinion; the loop stays lossless regardless.
            return torch.zeros(self.draft.config.draft_vocab_size, device=self.device)
        return self.draft.logits(self.last_hidden.view(1, 1, -1))[0, 0].float()

    @torch.inference_mode()
    def expand(self, parent_slots: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        if self.last_hidden is None:
            zeros = torch.zeros(len(parent_slots), self.draft.config.draft_vocab_size, device=self.device)
            return zeros, [-1] * len(parent_slots)
        k = len(parent_slots)
        base = len(self.cache)
        hidden = torch.stack([self.last_hidden if s < 0 else self.slot_hidden[s] for s in parent_slots]).unsqueeze(0)
        depths = [1 if s < 0 else self.slot_depth[s] + 1 for s in parent_slots]
        ancestors = [[] if s < 0 else self.slot_entries[s] for s in parent_slots]
        positions = (self.committed - 1 + torch.tensor(depths, device=self.device)).view(1, k)
        mask = None
        if not (k == 1 and ancestors[0] == list(range(self.committed, base))):
            # Several nodes, or a node whose cached ancestors are not all speculative entries: a tree mask.
            mask = torch.zeros(k, base + k, dtype=torch.bool, device=self.device)
            mask[:, : self.committed] = True
            for row, entries in enumerate(ancestors):
                mask[row, entries + [base + row]] = True
            mask = mask.view(1, 1, k, base + k)
        out = self.draft(hidden, tokens.to(self.device).view(1, k), positions, kv_cache=self.cache, attn_mask=mask)
        logits = self.draft.logits(out)[0].float()
        slots = list(range(len(self.slot_hidden), len(self.slot_hidden) + k))
        for row in range(k):
            self.slot_hidden.append(out[0, row])
            self.slot_depth.append(depths[row])
            self.slot_entries.append(ancestors[row] + [base + row])
        return logits, slots

    def propose_chain(self, n: int, sampling: SamplingParams, generator: torch.Generator | None) -> ChainDraft:
        with torch.inference_mode():
            return propose_chain_with(self, n, sampling, generator, self.min_prob, self.rank_top_k)

    def propose_tree(self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        with torch.inference_mode():
            return grow_tree(self, shape, sampling, generator)
