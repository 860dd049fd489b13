"""What a drafter hands the verifier: a chain or an EAGLE-2 dynamic tree, and the protocols drafters implement.

A ``Drafter`` owns its state (KV cache, context, RNG); the loop in ``decode/loop.py`` tells it
which tokens were committed and ask it for the next proposal. Drafters that are step-wise models (EAGLE, the
random test draft) implement the smaller ``DraftStepper`` and get chains and trees from ``propose_chain_with`` and
``grow_tree``, so the EAGLE-2 tree logic exists once.

Tree layout: nodes 0..M-1 in creation order (a parent always before its children, siblings in the order they are
to be tried); row 0 of the verifier input is the root (the newest committed token) and row i+1 is node i.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Generator, Protocol

import torch

from fledge.core.errors import ConfigError
from fledge.models.sampling import SamplingParams, draft_probs, sample


@dataclass
class ChainDraft:
    tokens: torch.Tensor
    """[n] draft tokens in the verifier's vocabulary (n may be smaller than asked, even 0)."""
    q: torch.Tensor | None
    """[n, V] the distributions the tokens were sampled from; None when they were chosen deterministically."""
    top_ids: torch.Tensor | None = None
    """[n, K] the draft's K most likely tokens (verifier ids, best first) at each position, when asked for: where the
    verifier's token ranks there says what a tree of width K would have accepted (``fledge tune``)."""


@dataclass(frozen=True)
class TreeShape:
    depth: int = 6
    """Longest draft path (tree levels below the root); the draft runs depth-1 forwards per round."""
    top_k: int = 8
    """Children per expanded node, and nodes expanded per level (EAGLE-2's top-k)."""
    total_tokens: int = 48
    """Draft tokens kept in the tree after reranking (the root not counted): the verifier's batch is this + 1."""
    sampled_children: bool = False
    """Sampling only. False: EAGLE-2's deterministic top-k children, verified with point-mass proposals (EAGLE's
    ``evaluate_posterior``). True: children drawn without replacement from q (Gumbel top-k), verified with
    min(1, p/q) and q renormalised after each rejection; the budget then keeps whole sibling groups in the order
    they were grown, because pruning children by their drawn values would bias the output."""
    lookup_depth: int = 0
    """How deep a hybrid drafter's prompt-lookup branch may reach (0: ``depth``). A lookup continuation costs no
    draft forward and is often long, while each level of the draft's own tree costs one: a depth-1 tree (the draft's
    top-k first tokens, one verifier pass) can still carry a five-token lookup branch."""

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1:
            raise ConfigError(f"tree depth and top_k must be >= 1, got depth={self.depth}, top_k={self.top_k}")
        if self.total_tokens < self.top_k:
            raise ConfigError(
                f"tree total_tokens ({self.total_tokens}) must be >= top_k ({self.top_k}): the root's children "
                "alone are top_k tokens"
            )
        if self.lookup_depth < 0:
            raise ConfigError(f"tree lookup_depth must be >= 0 (0: the tree's depth), got {self.lookup_depth}")

    @property
    def branch_depth(self) -> int:
        """The longest prompt-lookup branch a hybrid adds to this tree."""
        return self.lookup_depth or self.depth

    def capped(self, budget: int) -> TreeShape:
        """This shape for a round that may add at most ``budget`` tokens (a longer path would be cut anyway)."""
        return dataclasses.replace(self, depth=min(self.depth, budget), lookup_depth=min(self.branch_depth, budget))


@dataclass
class DraftTree:
    tokens: torch.Tensor
    """[M] draft tokens in the verifier's vocabulary."""
    parents: torch.Tensor
    """[M] index of each node's parent node, -1 for children of the root."""
    depths: torch.Tensor
    """[M] 1 for children of the root; the verifier position of node i is (root position + depths[i])."""
    q: torch.Tensor | None
    """[P, Vd] draft distributions the children of a node were sampled from; None for deterministic children."""
    q_rows: list[int]
    """Per row (0 = root, i+1 = node i): its row in ``q``, or -1."""
    draft_to_target: torch.Tensor | None
    """[Vd] verifier id of each draft-vocabulary id; None when the vocabularies coincide."""
    scores: torch.Tensor | None = None
    """[M] each node's path confidence (the draft's cumulative log q, EAGLE-2's rerank key), NaN for a node the
    draft did not propose; None when not known."""

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def q_target(self, row: int, vocab_size: int) -> torch.Tensor | None:
        """The proposal distribution at tree row ``row`` over the verifier's vocabulary, or None."""
        if self.q is None or self.q_rows[row] < 0:
            return None
        return _q_to_target(self.q[self.q_rows[row]], self.draft_to_target, vocab_size)


def _q_to_target(q: torch.Tensor, draft_to_target: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft distributions [..., Vd] over the verifier's vocabulary [..., V] (zero outside the draft vocabulary)."""
    if draft_to_target is None:
        return q
    return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(q.dim() - 1, draft_to_target, q)


class DraftStepper(Protocol):
    """A draft that predicts step by step; positions fed through it are addressed by slot numbers.

    Slots are numbered from 0 after each ``start``/``advance``; slot -1 is the committed context itself.
    """

    draft_to_target: torch.Tensor | None
    target_vocab_size: int

    def root_logits(self) -> torch.Tensor:
        """[Vd] logits for the token after the newest committed token."""

    def expand(self, parent_slots: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Feed ``tokens`` [k] (verifier ids), each as the child of ``parent_slots[i]``; returns the logits [k, Vd]
        for each one's next token and the new slots. A node sees the committed context and its own ancestors only."""


class Drafter(Protocol):
    needs_aux: bool
    """Whether ``start``/``advance`` need the verifier's aux hidden states (EAGLE) or only tokens."""
    aux_layer_ids: list[int] | None
    """Which verifier states (``output_hidden_states`` indices) it reads: its own, from the draft's config; None
    when it reads none."""
    supports_tree: bool

    def fresh(self) -> Drafter:
        """Another drafter with the same settings (and weights) but its own state: one per row of a batch."""

    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        """A new sequence: ``context`` [L] committed tokens; ``aux`` [L-1, 3H] the verifier's features of
        positions 0..L-2 (row t pairs with token t+1)."""

    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        """``new_tokens`` [n] were committed; ``aux`` [n, 3H] are the verifier's features of the positions right
        before each of them. Forgets everything speculative from the last proposal."""

    def propose_chain(
        self, n: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> ChainDraft: ...

    def propose_tree(
        self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree: ...


def _to_target(stepper: DraftStepper, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids if stepper.draft_to_target is None else stepper.draft_to_target[draft_ids]


ExpandRequest = tuple[list[int], torch.Tensor]
"""What a proposal asks of its stepper next: ``expand(parent_slots, tokens)``."""
Steps = Generator[ExpandRequest, tuple[torch.Tensor, list[int]], "ChainDraft | DraftTree"]
"""A proposal written as a generator: it yields each expand request and is sent the stepper's answer, so that one
driver can serve it from a single stepper (``drive``) and another can serve many rows in one batched forward
(``decode/batch_draft.py``)."""


def drive(steps: Steps, expand: Callable[[list[int], torch.Tensor], tuple[torch.Tensor, list[int]]]):
    """Run a proposal generator against one stepper's ``expand``; returns the proposal."""
    try:
        request = next(steps)
        while True:
            request = steps.send(expand(*request))
    except StopIteration as done:
        return done.value


def propose_chain_with(
    stepper: DraftStepper, n: int, sampling: SamplingParams, generator: torch.Generator | None,
    min_prob: float = 0.0, rank_top_k: int = 0,
) -> ChainDraft:
    return drive(chain_steps(stepper, n, sampling, generator, min_prob, rank_top_k), stepper.expand)


def chain_steps(
    stepper: DraftStepper, n: int, sampling: SamplingParams, generator: torch.Generator | None,
    min_prob: float = 0.0, rank_top_k: int = 0,
) -> Steps:
    """Up to n drafts, each fed back as the input of the next: argmax when greedy, else sampled from q (temperature).

    With ``min_prob`` the chain ends before a position where the draft's most likely token has less probability
    than that (softmax at the sampling temperature; 1 when greedy), even before the first: a token the draft
    doubts costs a draft step and a verified position and is seldom accepted. The decision depends only on the
    draft's distribution at that position, never on what is sampled there or on the verifier, so the loops stay
    exact: a drafted token is still distributed as its q, and an undrafted position is sampled from the verifier.
    """
    logits = stepper.root_logits()
    draft_ids, qs, tops = [], [], []  # per position: its draft id, q, and top ids
    slot = -1
    temperature = 1.0 if sampling.greedy else sampling.temperature
    for i in range(n):
        if i:
            step_logits, (slot,) = yield [slot], _to_target(stepper, draft_ids[-1])
            logits = step_logits[0]
        q = draft_probs(logits, temperature) if (min_prob > 0 or not sampling.greedy) else None
        if min_prob > 0 and float(q.max()) < min_prob:
            break
        if rank_top_k:
            tops.append(torch.topk(logits, min(rank_top_k, logits.shape[-1])).indices)
        if sampling.greedy:
            draft_ids.append(torch.argmax(logits).view(1))
        else:
            draft_ids.append(sample(q, generator))
            qs.append(q)
    if not draft_ids:
        return ChainDraft(tokens=torch.empty(0, dtype=torch.long), q=None)
    q = _q_to_target(torch.stack(qs), stepper.draft_to_target, stepper.target_vocab_size) if qs else None
    top_ids = _to_target(stepper, torch.stack(tops)) if tops else None
    return ChainDraft(tokens=_to_target(stepper, torch.cat(draft_ids)), q=q, top_ids=top_ids)


def grow_tree(
    stepper: DraftStepper, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None
) -> DraftTree:
    return drive(tree_steps(stepper, shape, sampling, generator), stepper.expand)


def tree_steps(
    stepper: DraftStepper, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None
) -> Steps:
    """EAGLE-2's dynamic tree: expand the top-k nodes of each level by path confidence (cumulative draft log
    probability), then rerank every node grown to ``shape.total_tokens``.

    Path confidence only ever decreases along a path, and ties go to the earlier node, so the kept set contains the
    parent of every kept node. With sampled children the budget is applied to whole sibling groups instead (see
    ``_keep_whole_groups``).
    """
    temperature = 1.0 if sampling.greedy else sampling.temperature
    sampled = shape.sampled_children and not sampling.greedy
    logq = torch.log_softmax(stepper.root_logits().float().view(1, -1) / temperature, dim=-1)
    q_tables = [logq.exp()] if sampled else []
    q_row_of: dict[int, int] = {-1: 0}  # node index -> row in the q table (-1: the root)
    slot_of: dict[int, int] = {-1: -1}  # node index -> stepper slot of that node

    tokens, parents, scores, depths = [], [], [], []
    # The nodes whose children the next level holds, with their path confidence: first the root alone.
    expanded, expanded_scores, level_start = [-1], torch.zeros(1, device=logq.device), 0
    for depth in range(1, shape.depth + 1):
        if depth > 1:
            if level_tokens.numel() == 0:
                break
            order = torch.sort(level_scores, descending=True, stable=True).indices[: shape.top_k]
            expanded, expanded_scores = (order + level_start).tolist(), level_scores[order]
            parent_slots = [slot_of[p] for p in level_parents[order].tolist()]
            logits, slots = yield parent_slots, _to_target(stepper, level_tokens[order])
            slot_of.update(zip(expanded, slots))
            logq = torch.log_softmax(logits.float() / temperature, dim=-1)
            if sampled:
                first_row = sum(len(t) for t in q_tables)
                q_row_of.update({node: first_row + i for i, node in enumerate(expanded)})
                q_tables.append(logq.exp())
            level_start += level_tokens.numel()
        # Each expanded node's children [R, k] and their log q, in the order they are to be tried: its top k, or k
        # draws without replacement in draw order (Gumbel top-k: the k largest of log q + Gumbel noise).
        k = min(shape.top_k, logq.shape[-1])
        if sampled:
            u = torch.rand(logq.shape, generator=generator, device=logq.device).clamp_min_(1e-20)
            ids = torch.topk(logq - torch.log(-torch.log(u)), k, dim=-1).indices
            child_logq = logq.gather(-1, ids)
        else:
            child_logq, ids = torch.topk(logq, k, dim=-1)
        valid = torch.isfinite(child_logq).flatten()
        level_tokens = ids.flatten()[valid]
        level_parents = torch.tensor(expanded, device=logq.device).repeat_interleave(ids.shape[1])[valid]
        level_scores = (expanded_scores.unsqueeze(1) + child_logq).flatten()[valid]
        tokens.append(level_tokens)
        parents.append(level_parents)
        scores.append(level_scores)
        depths.append(torch.full_like(level_tokens, depth))

    all_tokens, all_parents = torch.cat(tokens), torch.cat(parents)
    all_scores, all_depths = torch.cat(scores), torch.cat(depths)
    if sampled:
        keep = _keep_whole_groups(all_parents, shape.total_tokens)
    else:
        keep = torch.sort(all_scores, descending=True, stable=True).indices[: shape.total_tokens].sort().values
    new_index = torch.full((all_tokens.numel(),), -1, dtype=torch.long, device=keep.device)
    new_index[keep] = torch.arange(keep.numel(), device=keep.device)
    kept_parents = all_parents[keep]
    kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], kept_parents)
    q_rows = [0 if sampled else -1] + [q_row_of.get(node, -1) for node in keep.tolist()]
    return DraftTree(
        tokens=_to_target(stepper, all_tokens[keep]),
        parents=kept_parents,
        depths=all_depths[keep],
        q=torch.cat(q_tables) if sampled else None,
        q_rows=q_rows,
        draft_to_target=stepper.draft_to_target,
        scores=all_scores[keep],
    )


def _keep_whole_groups(parents: torch.Tensor, budget: int) -> torch.Tensor:
    """Nodes of the sibling groups, in the order they were grown (level by level, best parent first), while they
    fit in ``budget``; ascending node indices.

    Recursive rejection sampling stays exact only if whether a node keeps its sampled children never depends on the
    values those children drew. Ranking groups by confidence across levels would break that: which cousins get
    expanded depends on the children's values, and an expanded cousin's group could then take a group's place.
    Growth order depends only on what was grown before the group.
    """
    _, sizes = torch.unique_consecutive(parents, return_counts=True)
    kept_groups = int((torch.cumsum(sizes, 0) <= budget).sum())
    return torch.arange(int(sizes[:kept_groups].sum()), device=parents.device)


def empty_tree() -> DraftTree:
    none = torch.empty(0, dtype=torch.long)
    return DraftTree(tokens=none, parents=none, depths=none, q=None, q_rows=[-1], draft_to_target=None)
