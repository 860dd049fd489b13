"""Batched decoding: plain, chain and tree speculative decoding of B prompts at once, as a server decodes them.

Every row advances by its own accepted length. The verifier's KV cache holds the B rows left-aligned at their own
start column: row r's committed keys/values are the contiguous columns ``[start_r, end_r)``, and the columns after
``end_r`` (up to the cache's length, the longest row's end) are holes that the attention mask hides. A round appends
the rows' inputs as one block (padded to the longest), runs one verifier forward with a 4D mask (each row sees its
own committed columns and, in the block, its own causal chain or tree ancestry), then moves each row's kept entries
(a chain's accepted prefix, a tree's accepted path) down to its end: a copy of the kept rows only, the rollback or
compaction of each row on its own. Finished rows leave the batch (the cache keeps only the active rows), so no
compute is spent on them, and padding never reaches a real token's attention.

Drafters propose for the whole batch through ``eval/batch_draft.py``: the EAGLE-3 draft (alone or in the hybrid) runs
one batched forward per draft step over its own ragged KV cache, as a serving engine does; other drafters keep one
instance per row and propose row by row.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache

from fledge.eval.batch_draft import BatchDrafter, batch_drafter
from fledge.eval.proposals import Drafter, TreeShape
from fledge.eval.ragged import committed_columns, move_kept
from fledge.eval.sampling import greedy_accept, leviathan_accept
from fledge.eval.tree import sliding_window_of, walk_greedy, walk_sampled
from fledge.eval.verifier_state import DecodeResult, clock, pick_token, stop_index
from fledge.models.capture import Captured, capture_hidden
from fledge.models.sampling import SamplingParams, target_probs
from fledge.models.verifier import cache_kwarg

PAD = 0
"""The token id padding positions carry (never seen by a real position, so any id does)."""


class BatchedVerifierState:
    """The verifier's KV cache over several rows of different lengths (see the module docstring)."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = next(model.parameters()).dtype
        self.window = sliding_window_of(model)
        self.cache = DynamicCache()
        self._cache_kwarg = cache_kwarg(model)
        self._hooks = ExitStack()
        self._captured: Captured | None = None
        if aux_layer_ids:
            self._captured = self._hooks.enter_context(capture_hidden(model, list(aux_layer_ids), final=False))
        self.starts = torch.zeros(0, dtype=torch.long, device=self.device)
        self.ends = torch.zeros(0, dtype=torch.long, device=self.device)
        self._block_start = 0

    def __enter__(self) -> BatchedVerifierState:
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.close()

    @property
    def width(self) -> int:
        """Columns in the cache (the longest row's end)."""
        return self.cache.get_seq_length()

    @property
    def lengths(self) -> torch.Tensor:
        """[B] committed positions per row."""
        return self.ends - self.starts

    def _mask(self, visible_block: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """[B, 1, q, width + q] additive mask: committed columns of the row, then the block's own visibility."""
        batch, q = block_positions.shape
        width = self.width
        cols = torch.arange(width, device=self.device)
        committed = committed_columns(self.starts, self.ends, width)
        visible = torch.cat([committed[:, None, :].expand(batch, q, width), visible_block], dim=2)
        if self.window is not None:
            key_pos = torch.cat([cols[None, :] - self.starts[:, None], block_positions], dim=1)  # [B, width + q]
            visible &= (block_positions[:, :, None] - key_pos[:, None, :]) < self.window
        mask = torch.zeros(batch, 1, q, width + q, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible[:, None], torch.finfo(self.dtype).min)

    def forward(
        self, inputs: list[torch.Tensor], parents: list[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append one block: row i's ``inputs[i]`` [q_i] (a chain: root then drafts; a tree: root then nodes, with
        ``parents[i]`` [q_i - 1] the node parents as in ``DraftTree``, -1 = the root). Returns logits [B, q, V] and
        aux [B, q, 3H] (or None); row i's entries past q_i are padding."""
        batch, q = len(inputs), max(int(x.numel()) for x in inputs)
        ids = torch.full((batch, q), PAD, dtype=torch.long, device=self.device)
        depth = torch.zeros(batch, q, dtype=torch.long, device=self.device)
        visible = torch.eye(q, dtype=torch.bool, device=self.device).repeat(batch, 1, 1)  # pads see themselves
        causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        for i, x in enumerate(inputs):
            n = int(x.numel())
            ids[i, :n] = x.to(self.device)
            if parents is None or parents[i] is None:
                depth[i, :n] = torch.arange(n, device=self.device)
                visible[i, :n, :n] = causal[:n, :n]
            else:
                sees, node_depth = _tree_visibility(parents[i].to(self.device))
                depth[i, :n] = node_depth
                visible[i, :n, :n] = sees
        positions = self.lengths[:, None] + depth
        self._block_start = self.width
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=self._mask(visible, positions), use_cache=True,
            **{self._cache_kwarg: self.cache},
        )
        aux = None
        if self._captured is not None:
            aux = torch.cat([a.to(self.device) for a in self._captured.aux], dim=-1)
        return out.logits.to(self.device), aux

    def prefill(self, prompts: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Cache every prompt token but the last (the first round's root), left-padded to the longest; returns each
        row's aux states of those positions (None for a one-token prompt)."""
        heads = [p[:-1] for p in prompts]
        longest = max(int(h.numel()) for h in heads)
        self.starts = torch.tensor([longest - int(h.numel()) for h in heads], dtype=torch.long, device=self.device)
        self.ends = torch.full((len(prompts),), longest, dtype=torch.long, device=self.device)
        if longest == 0:
            return [None] * len(prompts)
        ids = torch.full((len(prompts), longest), PAD, dtype=torch.long, device=self.device)
        for i, h in enumerate(heads):
            ids[i, longest - h.numel():] = h.to(self.device)
        cols = torch.arange(longest, device=self.device)
        keys = cols[None, :] >= self.starts[:, None]  # [B, longest]
        sees = keys[:, None, :] & (cols[None, :, None] >= cols[None, None, :])  # causal, real keys only
        if self.window is not None:  # the model's own rule: key visible iff query - key < window
            sees &= (cols[None, :, None] - cols[None, None, :]) < self.window
        sees |= torch.eye(longest, dtype=torch.bool, device=self.device)[None]  # padding rows see themselves
        mask = torch.zeros(len(prompts), 1, longest, longest, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~sees[:, None], torch.finfo(self.dtype).min)
        positions = (cols[None, :] - self.starts[:, None]).clamp_min(0)
        self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                   logits_to_keep=1, **{self._cache_kwarg: self.cache})
        if self._captured is None:
            return [None] * len(prompts)
        aux = torch.cat([a.to(self.device) for a in self._captured.aux], dim=-1)
        return [aux[i, int(self.starts[i]):] if heads[i].numel() else None for i in range(len(prompts))]

    def commit(self, kept: list[list[int]]) -> None:
        """Row i keeps the entries ``kept[i]`` (offsets into the last block, ascending; 0 is its root) after its
        committed ones; everything else of the block is dropped. One indexed copy per layer moves all rows."""
        self.ends = move_kept([(layer.keys, layer.values) for layer in self.cache.layers], self.ends,
                              self._block_start, kept)
        extra = self.width - int(self.ends.max())
        if extra > 0:
            self.cache.crop(-extra)

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows (indices into the current batch, in order) stay; the others' cache goes."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.starts, self.ends = self.starts[index], self.ends[index]
        # Columns every remaining row has left behind (before all starts) are dead weight: drop them.
        shift = int(self.starts.min()) if rows else 0
        if shift:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, shift:, :].contiguous()
                layer.values = layer.values[:, :, shift:, :].contiguous()
            self.starts, self.ends = self.starts - shift, self.ends - shift
        extra = self.width - int(self.ends.max()) if rows else 0
        if extra > 0:
            self.cache.crop(-extra)


def _tree_visibility(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For [root, nodes] with node parents (-1 = root): [M+1, M+1] ancestor-or-self visibility and [M+1] depths."""
    size = parents.numel() + 1
    parent_rows = torch.cat([torch.zeros(1, dtype=torch.long, device=parents.device), parents + 1])
    sees = torch.eye(size, dtype=torch.bool, device=parents.device)
    for _ in range(size):
        grown = sees | sees[parent_rows]
        if torch.equal(grown, sees):
            break
        sees = grown
    depth = sees.sum(dim=1) - 1  # ancestors, root included, minus itself
    return sees, depth


@torch.inference_mode()
def generate_batch(
    model: nn.Module,
    prompts: list[torch.Tensor],
    drafters: list[Drafter] | None,
    *,
    method: str = "plain",
    num_draft_tokens: int = 5,
    shape: TreeShape | None = None,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: frozenset[int] = frozenset(),
    aux_layer_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[DecodeResult], float]:
    """Decode every prompt of the batch at once: plain (``drafters`` None), ``chain`` or ``tree``. Returns each row's
    result (tokens, accepted per round, ...) and the batch's wall time. Lossless per row as the batch-1 loops are."""
    if method not in ("plain", "chain", "tree"):
        raise ValueError(f"method must be plain, chain or tree, got {method!r}")
    speculative = method != "plain"
    if speculative and (drafters is None or len(drafters) != len(prompts)):
        raise ValueError("speculative batches need one drafter per prompt")
    batch = batch_drafter(drafters) if speculative else None
    needs_aux = batch is not None and batch.needs_aux
    if needs_aux and not aux_layer_ids:
        raise ValueError("these drafters read the verifier's aux hidden states: pass aux_layer_ids")
    device = model.get_input_embeddings().weight.device
    results = [DecodeResult(tokens=[]) for _ in prompts]
    start = clock(device)
    with BatchedVerifierState(model, aux_layer_ids if needs_aux else None) as state:
        auxes = state.prefill(prompts)
        if batch is not None:
            batch.start([p.cpu() for p in prompts], auxes)
        roots = [int(p[-1]) for p in prompts]
        active = list(range(len(prompts)))
        step: Callable = _plain_round if not speculative else (_chain_round if method == "chain" else _tree_round)
        while active:
            updates = step(state, active, roots, results, batch, num_draft_tokens, shape, max_new_tokens,
                           sampling, stop_ids, generator)
            keep = [i for i, update in enumerate(updates) if update is not None]
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                if not active:
                    break
                state.keep_rows(keep)
                if batch is not None:
                    batch.keep_rows(keep)
            if batch is not None:
                batch.advance([updates[i] for i in keep])
    seconds = clock(device) - start
    for r in results:
        r.tokens = r.tokens[: stop_index(r.tokens, stop_ids, max_new_tokens)]
    return results, seconds


def _done(tokens: list[int], new: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(new)


def _plain_round(state, active, roots, results, batch, n, shape, max_new_tokens, sampling, stop_ids, generator):
    """Returns, per active row, None when it finished and otherwise what its drafter must commit (here: nothing)."""
    logits, _ = state.forward([torch.tensor([roots[r]]) for r in active])
    state.commit([[0] for _ in active])
    updates = []
    picked = torch.argmax(logits[:, 0], dim=-1).tolist() if sampling.greedy else None  # one transfer for all rows
    for i, r in enumerate(active):
        token = picked[i] if picked is not None else pick_token(logits[i, 0], sampling, generator)
        results[r].tokens.append(token)
        roots[r] = token
        updates.append(None if _done(results[r].tokens, [token], stop_ids, max_new_tokens) else ())
    return updates


def _chain_round(state, active, roots, results, batch: BatchDrafter, n, shape, max_new_tokens, sampling, stop_ids,
                 generator):
    drafts = batch.propose_chains([min(n, max_new_tokens - len(results[r].tokens) - 1) for r in active], sampling,
                                  generator)
    inputs = [torch.cat([torch.tensor([roots[r]]), d.tokens.cpu()]) for r, d in zip(active, drafts)]
    logits, aux = state.forward(inputs)
    outcomes = []
    for i, d in enumerate(drafts):
        k = d.tokens.numel()
        tokens = d.tokens.to(state.device)
        if sampling.greedy:
            accepted, next_token, _ = greedy_accept(logits[i, : k + 1], tokens)
        else:
            q = None if d.q is None else d.q.to(state.device)
            accepted, next_token = leviathan_accept(target_probs(logits[i, : k + 1], sampling), tokens, q, generator)
        outcomes.append((accepted, next_token))
    state.commit([list(range(a + 1)) for a, _ in outcomes])
    updates = []
    for i, (r, d, (accepted, next_token)) in enumerate(zip(active, drafts, outcomes)):
        new = d.tokens[:accepted].tolist() + [next_token]
        result = results[r]
        result.tokens.extend(new)
        result.accepted.append(accepted)
        result.proposed.append(int(d.tokens.numel()))
        result.tree_nodes.append(int(d.tokens.numel()))
        roots[r] = next_token
        done = _done(result.tokens, new, stop_ids, max_new_tokens)
        updates.append(None if done else (torch.tensor(new), None if aux is None else aux[i, : accepted + 1]))
    return updates


def _tree_round(state, active, roots, results, batch: BatchDrafter, n, shape, max_new_tokens, sampling, stop_ids,
                generator):
    budgets = [max_new_tokens - len(results[r].tokens) - 1 for r in active]
    trees = batch.propose_trees([shape.capped(b) if b > 0 else None for b in budgets], sampling, generator)
    inputs = [torch.cat([torch.tensor([roots[r]]), t.tokens.cpu()]) for r, t in zip(active, trees)]
    logits, aux = state.forward(inputs, [t.parents for t in trees])
    walks = []
    for i, t in enumerate(trees):
        rows = logits[i, : t.size + 1]
        walks.append(walk_greedy(rows, t) if sampling.greedy else walk_sampled(rows, t, sampling, generator))
    state.commit([[0] + [node + 1 for node in path] for path, _ in walks])
    updates = []
    for i, (r, t, (path, next_token)) in enumerate(zip(active, trees, walks)):
        new = t.tokens[path].tolist() + [next_token]
        result = results[r]
        result.tokens.extend(new)
        result.accepted.append(len(path))
        result.proposed.append(int(t.depths.max()) if t.size else 0)
        result.tree_nodes.append(t.size)
        roots[r] = next_token
        if _done(result.tokens, new, stop_ids, max_new_tokens):
            updates.append(None)
        else:
            rows = torch.tensor([0] + [node + 1 for node in path], device=state.device)
            updates.append((torch.tensor(new), None if aux is None else aux[i, rows]))
    return updates


__all__ = ["BatchedVerifierState", "generate_batch"]
