"""Drafters of a batch: one object that proposes for every row of ``decode/loop.py``'s batch at once.

``BatchedEagle`` runs the EAGLE-3 draft over all rows in one forward per draft step, as a serving engine does: its
KV cache holds the rows left-aligned at their own start column, like the verifier's (``VerifierSession``),
with each row's committed entries contiguous from its start and the columns after its end hidden by the mask.
A proposal appends speculative blocks after the committed columns (one block per draft step, one column per node
of each row); ``advance`` drops them, appends the rows' newly committed tokens as one block and moves each row's
entries down to its end (the same indexed copy as the verifier's commit).

The chain and tree logic is written once, as generators (``chain_steps``/``tree_steps`` in ``decode/proposals.py``):
``BatchedEagle`` drives one generator per row and answers all their expand requests with one batched forward, so
each row's proposal is what one row alone would get, computed B rows at a time.

``RowwiseBatch`` keeps any other drafter (one instance per row, proposing row by row); ``BatchedHybrid`` is prompt
lookup per row beside a ``BatchedEagle``. ``batch_drafter`` picks the batched form where one exists.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from fledge.decode.drafters import EagleDrafter, HybridDrafter
from fledge.decode.proposals import (
    ChainDraft, Drafter, DraftTree, Steps, TreeShape, chain_steps, empty_tree, tree_steps,
)
from fledge.decode.ragged import committed_columns, move_kept
from fledge.models.draft import DraftKVCache
from fledge.models.sampling import SamplingParams

PAD = 0
"""Token id of padding positions (masked from every real query)."""


class BatchDrafter(Protocol):
    """Proposals for every row of a batch; rows are indices into the current batch (``keep_rows`` renumbers)."""

    needs_aux: bool
    aux_layer_ids: list[int] | None

    def start(self, contexts: list[torch.Tensor], auxes: list[torch.Tensor | None]) -> None:
        """Row i's prompt ``contexts[i]`` [L_i] and the verifier's features of its positions 0..L_i-2 (or None)."""

    def propose_chains(self, lengths: list[int], sampling: SamplingParams,
                       generator: torch.Generator | None) -> list[ChainDraft]:
        """Up to ``lengths[i]`` drafts for row i (0: none)."""

    def propose_trees(self, shapes: list[TreeShape | None], sampling: SamplingParams,
                      generator: torch.Generator | None) -> list[DraftTree]:
        """A tree of ``shapes[i]`` for row i (None: an empty tree)."""

    def advance(self, updates: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Every row committed ``updates[i] = (tokens [n_i], aux [n_i, 3H] or None)``; speculation is forgotten."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows (in order) stay."""

    observe_top_k: int
    """How many of the verifier's most likely next tokens per verified row ``observe`` wants (0: no call)."""

    def observe(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Row i's last verified block: ``(tokens [q_i], the verifier's top ids there [q_i, observe_top_k])``,
        before ``advance``."""


def batch_drafter(drafters: list[Drafter]) -> BatchDrafter:
    """The batched form of one drafter per row: ``BatchedEagle`` (or ``BatchedHybrid``) when every row is an
    ``EagleDrafter`` (a ``HybridDrafter`` over one) with the same draft weights and settings, else ``RowwiseBatch``.
    An ``EagleDrafter`` has no stepping of its own, so it cannot share a batch with other drafters."""
    first = drafters[0]

    def eagle_of(d: Drafter) -> EagleDrafter | None:
        inner = d.eagle if type(d) is HybridDrafter else d
        return inner if type(inner) is EagleDrafter else None

    eagles = [eagle_of(d) for d in drafters]
    if all(e is None for e in eagles):
        return RowwiseBatch(drafters)
    kinds = {type(d) for d in drafters}
    same = all(e is not None and e.draft is eagles[0].draft and e.min_prob == eagles[0].min_prob
               and e.rank_top_k == eagles[0].rank_top_k for e in eagles)
    if len(kinds) > 1 or not same:
        raise ValueError("a batch of EAGLE-3 drafters needs one kind of drafter over one draft with one set of "
                         f"settings in every row, got {sorted(k.__name__ for k in kinds)}")
    return BatchedEagle(first) if type(first) is EagleDrafter else BatchedHybrid(drafters)


class RowwiseBatch:
    """Any drafters, one per row, each proposing on its own."""

    def __init__(self, drafters: list[Drafter]):
        self.rows = list(drafters)
        self.needs_aux = drafters[0].needs_aux
        self.aux_layer_ids = getattr(drafters[0], "aux_layer_ids", None)

    def start(self, contexts, auxes) -> None:
        for drafter, context, aux in zip(self.rows, contexts, auxes):
            drafter.start(context, aux)

    def propose_chains(self, lengths, sampling, generator) -> list[ChainDraft]:
        return [d.propose_chain(n, sampling, generator) for d, n in zip(self.rows, lengths)]

    def propose_trees(self, shapes, sampling, generator) -> list[DraftTree]:
        return [d.propose_tree(s, sampling, generator) if s is not None else empty_tree()
                for d, s in zip(self.rows, shapes)]

    def advance(self, updates) -> None:
        for drafter, (tokens, aux) in zip(self.rows, updates):
            drafter.advance(tokens, aux)

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]

    @property
    def observe_top_k(self) -> int:
        return max((getattr(d, "observe_top_k", 0) for d in self.rows), default=0)

    def observe(self, blocks) -> None:
        """Hand each row's verified block to its drafter, where it wants one."""
        for drafter, (tokens, top_ids) in zip(self.rows, blocks):
            if getattr(drafter, "observe_top_k", 0):
                drafter.observe(tokens, top_ids)


@dataclasses.dataclass
class _RowView:
    """What ``chain_steps``/``tree_steps`` read of their stepper: the vocabulary map and the row's root logits."""

    draft_to_target: torch.Tensor | None
    target_vocab_size: int
    logits: torch.Tensor

    def root_logits(self) -> torch.Tensor:
        return self.logits


@dataclasses.dataclass
class _Slots:
    """One row's nodes fed through the draft since its last commit (slot numbers index these lists)."""

    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    depth: list[int] = dataclasses.field(default_factory=list)
    columns: list[list[int]] = dataclasses.field(default_factory=list)
    """Cache columns of the node's speculative ancestors and itself."""


class BatchedEagle:
    """The EAGLE-3 draft over every row of a batch, one row included (see the module docstring); each row's
    proposal equals the one-row reference's (``ReferenceEagle`` in ``tests/reference_decode.py``), up to
    floating-point summation order."""

    needs_aux = True
    observe_top_k = 0

    def __init__(self, prototype: EagleDrafter):
        self.draft = prototype.draft
        self.aux_layer_ids = prototype.aux_layer_ids
        self.min_prob = prototype.min_prob
        self.rank_top_k = prototype.rank_top_k
        self.draft_to_target = prototype.draft_to_target
        self.target_vocab_size = prototype.target_vocab_size
        self.device = prototype.device
        self.draft_vocab_size = int(self.draft.config.draft_vocab_size)
        self.cache = DraftKVCache()
        self.starts = torch.zeros(0, dtype=torch.long, device=self.device)
        self.ends = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last_hidden: torch.Tensor | None = None
        """[B, H] the draft's output at each row's newest committed position."""
        self.has_context: list[bool] = []
        """Rows with at least one committed position (a one-token prompt has none until its first commit)."""
        self.slots: list[_Slots] = []

    @property
    def committed_width(self) -> int:
        return int(self.ends.max()) if self.ends.numel() else 0

    def _forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        return self.draft(hidden, tokens, positions, kv_cache=self.cache, attn_mask=mask[:, None])

    @torch.inference_mode()
    def start(self, contexts: list[torch.Tensor], auxes: list[torch.Tensor | None]) -> None:
        lengths = [0 if a is None else int(a.shape[0]) for a in auxes]
        longest = max(lengths)
        batch = len(contexts)
        self.cache = DraftKVCache()
        self.starts = torch.tensor([longest - n for n in lengths], dtype=torch.long, device=self.device)
        self.ends = torch.full((batch,), longest, dtype=torch.long, device=self.device)
        self.has_context = [n > 0 for n in lengths]
        hidden_size = self.draft.config.hidden_size
        self.last_hidden = torch.zeros(batch, hidden_size, dtype=self.draft.fc.weight.dtype, device=self.device)
        self.slots = [_Slots() for _ in contexts]
        if longest == 0:
            return
        width = next(a for a in auxes if a is not None).shape[-1]
        tokens = torch.full((batch, longest), PAD, dtype=torch.long, device=self.device)
        aux = torch.zeros(batch, longest, width, dtype=auxes[lengths.index(longest)].dtype, device=self.device)
        for i, (context, a, n) in enumerate(zip(contexts, auxes, lengths)):
            if n:  # right-aligned: row i's positions 0..n-1 at columns longest-n..longest-1
                tokens[i, longest - n:] = context[1 : n + 1].to(self.device)
                aux[i, longest - n:] = a.to(self.device)
        cols = torch.arange(longest, device=self.device)
        sees = (cols[None, None, :] >= self.starts[:, None, None]) & (cols[None, :, None] >= cols[None, None, :])
        sees |= torch.eye(longest, dtype=torch.bool, device=self.device)  # padding rows see themselves
        positions = (cols[None, :] - self.starts[:, None]).clamp_min(0)
        out = self._forward(self.draft.fuse(aux), tokens, positions, sees)
        self.last_hidden = out[:, -1].clone()

    @torch.inference_mode()
    def advance(self, updates: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        if any(aux is None for _, aux in updates):
            raise ValueError("BatchedEagle needs the verifier's aux states of the committed tokens")
        width = self.committed_width
        self.cache.crop(width)  # forget the last proposal's speculative blocks
        if len(updates) == 1 and int(self.starts[0]) == 0:
            self._advance_one(*updates[0])
            return
        counts = [int(tokens.numel()) for tokens, _ in updates]
        block = max(counts)
        batch = len(updates)
        tokens = torch.full((batch, block), PAD, dtype=torch.long, device=self.device)
        aux = torch.zeros(batch, block, updates[0][1].shape[-1], dtype=updates[0][1].dtype, device=self.device)
        for i, (t, a) in enumerate(updates):
            tokens[i, : t.numel()] = t.to(self.device)
            aux[i, : t.numel()] = a.to(self.device)
        offsets = torch.arange(block, device=self.device)
        positions = (self.ends - self.starts)[:, None] + offsets[None, :]
        valid = offsets[None, :] < torch.tensor(counts, device=self.device)[:, None]  # [B, block]
        own = torch.ones(block, block, dtype=torch.bool, device=self.device).tril() & valid[:, None, :]
        own |= torch.eye(block, dtype=torch.bool, device=self.device)  # padding sees itself only
        committed = committed_columns(self.starts, self.ends, width)[:, None, :].expand(batch, block, width)
        mask = torch.cat([committed & valid[:, :, None], own], dim=2)
        out = self._forward(self.draft.fuse(aux), tokens, positions, mask)
        self.last_hidden = out[torch.arange(batch, device=self.device), torch.tensor(counts, device=self.device) - 1]
        self.ends = move_kept([(self.cache.k, self.cache.v)], self.ends, width, [list(range(n)) for n in counts])
        self.cache.length = self.committed_width
        self.has_context = [True] * batch
        self.slots = [_Slots() for _ in updates]

    def _advance_one(self, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """``advance`` of one row whose committed entries fill the cache from column 0: the block follows them
        causally (the cache's own mask), and its entries are already where they stay."""
        n = int(tokens.numel())
        positions = self.ends[:, None] + torch.arange(n, device=self.device)[None, :]
        out = self.draft(self.draft.fuse(aux.to(self.device)[None]), tokens.to(self.device)[None], positions,
                         kv_cache=self.cache)
        self.last_hidden = out[:, -1]
        self.ends = self.ends + n
        self.cache.length = int(self.ends[0])
        self.has_context = [True]
        self.slots = [_Slots()]

    def observe(self, blocks) -> None:
        """The draft alone records nothing of the verifier's outputs (``observe_top_k`` is 0)."""

    def keep_rows(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.starts, self.ends = self.starts[index], self.ends[index]
        self.last_hidden = self.last_hidden[index]
        self.has_context = [self.has_context[i] for i in rows]
        self.slots = [self.slots[i] for i in rows]
        if self.cache.k is None:
            return
        shift = int(self.starts.min()) if rows else 0  # columns every remaining row has left behind
        end = self.committed_width
        self.cache.k = self.cache.k[index, :, shift:].contiguous()
        self.cache.v = self.cache.v[index, :, shift:].contiguous()
        self.starts, self.ends = self.starts - shift, self.ends - shift
        self.cache.length = end - shift

    # --- proposals -----------------------------------------------------------------------------------------------

    def _expand(self, requests: list[tuple[list[int], torch.Tensor] | None]) -> list[tuple[torch.Tensor, list[int]]
                                                                                    | None]:
        """One draft forward for every row's request (``expand(parent_slots, tokens)`` of ``DraftStepper``)."""
        batch = len(requests)
        nodes = max(len(r[0]) for r in requests if r is not None)
        base = len(self.cache)
        width = self.committed_width
        hidden = torch.zeros(batch, nodes, self.last_hidden.shape[-1], dtype=self.last_hidden.dtype,
                             device=self.device)
        tokens = torch.full((batch, nodes), PAD, dtype=torch.long, device=self.device)
        depths = torch.zeros(batch, nodes, dtype=torch.long, device=self.device)
        mask = torch.zeros(batch, nodes, base + nodes, dtype=torch.bool, device=self.device)
        mask[:, :, :width] = committed_columns(self.starts, self.ends, width)[:, None, :]
        ancestors: list[list[list[int]]] = []
        rows, queries, columns = [], [], []
        for i, request in enumerate(requests):
            row_ancestors = []
            if request is not None:
                parent_slots, row_tokens = request
                slots = self.slots[i]
                tokens[i, : len(parent_slots)] = row_tokens.to(self.device)
                for j, s in enumerate(parent_slots):
                    hidden[i, j] = self.last_hidden[i] if s < 0 else slots.hidden[s]
                    depths[i, j] = 1 if s < 0 else slots.depth[s] + 1
                    row_ancestors.append([] if s < 0 else slots.columns[s])
                    for col in row_ancestors[-1]:
                        rows.append(i)
                        queries.append(j)
                        columns.append(col)
            ancestors.append(row_ancestors)
        if rows:
            mask[rows, queries, columns] = True
        mask[:, torch.arange(nodes), base + torch.arange(nodes)] = True  # each node (and padding) sees itself
        positions = (self.ends - self.starts - 1)[:, None] + depths
        out = self._forward(hidden, tokens, positions, mask)
        logits = self.draft.logits(out).float()
        answers: list[tuple[torch.Tensor, list[int]] | None] = []
        for i, request in enumerate(requests):
            if request is None:
                answers.append(None)
                continue
            k = len(request[0])
            if not self.has_context[i]:
                answers.append((torch.zeros(k, self.draft_vocab_size, device=self.device), [-1] * k))
                continue
            slots = self.slots[i]
            first = len(slots.hidden)
            for j in range(k):
                slots.hidden.append(out[i, j])
                slots.depth.append(int(depths[i, j]))
                slots.columns.append(ancestors[i][j] + [base + j])
            answers.append((logits[i, :k], list(range(first, first + k))))
        return answers

    def _drive(self, steps: list[Steps | None]) -> list:
        """Run every row's proposal generator, answering all pending expand requests with one forward per step."""
        results: list = [None] * len(steps)
        requests: list = [None] * len(steps)

        def advance(i: int, answer) -> None:
            try:
                requests[i] = next(steps[i]) if answer is None else steps[i].send(answer)
            except StopIteration as done:
                requests[i] = None
                results[i] = done.value

        for i, s in enumerate(steps):
            if s is not None:
                advance(i, None)
        while any(r is not None for r in requests):
            answers = self._expand(requests)
            for i, answer in enumerate(answers):
                if answer is not None:
                    advance(i, answer)
        return results

    def _views(self) -> list[_RowView]:
        self.cache.crop(self.committed_width)
        self.slots = [_Slots() for _ in self.slots]
        root = self.draft.logits(self.last_hidden[:, None])[:, 0].float()
        for i, known in enumerate(self.has_context):
            if not known:  # no verifier features yet: no opinion
                root[i] = 0
        return [_RowView(self.draft_to_target, self.target_vocab_size, root[i]) for i in range(root.shape[0])]

    @torch.inference_mode()
    def propose_chains(self, lengths: list[int], sampling: SamplingParams,
                       generator: torch.Generator | None) -> list[ChainDraft]:
        views = self._views()
        found = self._drive([chain_steps(v, n, sampling, generator, self.min_prob, self.rank_top_k) if n > 0 else None
                             for v, n in zip(views, lengths)])
        return [c if c is not None else ChainDraft(tokens=torch.empty(0, dtype=torch.long), q=None) for c in found]

    @torch.inference_mode()
    def propose_trees(self, shapes: list[TreeShape | None], sampling: SamplingParams,
                      generator: torch.Generator | None) -> list[DraftTree]:
        views = self._views()
        found = self._drive([tree_steps(v, s, sampling, generator) if s is not None else None
                             for v, s in zip(views, shapes)])
        return [t if t is not None else empty_tree() for t in found]


class BatchedHybrid(RowwiseBatch):
    """``HybridDrafter`` over a batch: prompt lookup per row, the EAGLE-3 draft batched (``BatchedEagle``); the rows
    observe as ``RowwiseBatch``'s do. The draft reads the committed tokens only when a round asks it for a proposal
    (rounds of lookup alone leave it idle), all rounds' tokens since its last proposal in one block."""

    needs_aux = True

    def __init__(self, drafters: list[HybridDrafter]):
        self.rows = list(drafters)  # their lookups, and their counters
        self.eagle = BatchedEagle(drafters[0].eagle)
        self.aux_layer_ids = self.eagle.aux_layer_ids
        self.pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in drafters]
        """Per row, the committed (tokens, aux) blocks the draft has not read yet: none in any row, or some in
        every row (each round commits a token in every row)."""

    def start(self, contexts, auxes) -> None:
        for row, context in zip(self.rows, contexts):
            row.restart()
            row.lookup.start(context, None)
        self.eagle.start(contexts, auxes)
        self.pending = [[] for _ in contexts]

    def _catch_up(self) -> None:
        """The draft reads every row's pending blocks, as one."""
        if self.pending and self.pending[0]:
            self.eagle.advance([(torch.cat([t for t, _ in blocks]), torch.cat([a for _, a in blocks]))
                                for blocks in self.pending])
            self.pending = [[] for _ in self.pending]

    def propose_chains(self, lengths, sampling, generator) -> list[ChainDraft]:
        found = [row.lookup.propose_chain(n, sampling, generator) for row, n in zip(self.rows, lengths)]
        hits = [f.tokens.numel() > 0 for f in found]
        wanted = [0 if hit else row.draft_length(n) for row, hit, n in zip(self.rows, hits, lengths)]
        drafted = found
        if any(wanted):
            self._catch_up()
            drafted = self.eagle.propose_chains(wanted, sampling, generator)
        for row, hit, f in zip(self.rows, hits, found):
            row.used_lookup += hit
            if hit:
                row.offer(f.tokens.tolist())
        return [f if hit else d for f, d, hit in zip(found, drafted, hits)]

    def propose_trees(self, shapes, sampling, generator) -> list[DraftTree]:
        wanted = [None if shape is None or row.lookup_alone(shape) else shape for row, shape in zip(self.rows, shapes)]
        trees = [empty_tree() for _ in shapes]
        if any(s is not None for s in wanted):
            self._catch_up()
            trees = self.eagle.propose_trees(wanted, sampling, generator)
        return [tree if shape is None else row.with_lookup(tree, shape, drafted=want is not None)
                for row, tree, shape, want in zip(self.rows, trees, shapes, wanted)]

    def advance(self, updates) -> None:
        if any(aux is None for _, aux in updates):
            raise ValueError("BatchedHybrid needs the verifier's aux states of the committed tokens")
        for row, blocks, (tokens, aux) in zip(self.rows, self.pending, updates):
            row.settle(tokens.tolist())
            row.lookup.advance(tokens, None)
            blocks.append((tokens, aux))

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]
        self.pending = [self.pending[i] for i in rows]
        self.eagle.keep_rows(rows)

    @property
    def observe_top_k(self) -> int:
        return self.rows[0].observe_top_k if self.rows else 0
