"""One budget of verified tokens for the hybrid's tree: every candidate (the draft's tree, prompt lookup's branches,
recycled successors) gets an estimate of its chance to be accepted, and the round keeps the nodes with the most
expected accepted tokens.

A tree round accepts, in expectation, the sum over its nodes of the probability that the whole path to the node is
accepted. With a per-node estimate of p(node accepted | its parent accepted), a path's probability is the product
along it, which never rises from parent to child; so the ``budget`` nodes of the highest path probability form a
tree (ties go to the earlier node, and a parent comes before its children) and maximise the estimate of accepted
tokens for that many verified tokens.

The estimates are learned while decoding, per sequence, from what the verifier accepted: each node is counted under
a key of its source (``draft`` by its conditional draft probability, bucketed; ``lookup`` and the other lookup
branches by depth in their branch, the root's lookup branch also by the length of its match; ``recycle`` by level
and rank), as offered when its parent was accepted and as accepted when it was too, starting from a prior of
``PRIOR_STRENGTH`` pseudo-rounds. A node more than one source proposed takes the highest estimate. Which nodes are
kept depends only on committed tokens, earlier rounds and the draft's own distribution, never on the verifier's
outputs of the round, so the loop stays exact (greedy: equal to plain decoding; sampling: deterministic candidates
verified as point masses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fledge.decode.proposals import DraftTree

Key = tuple
"""(source, feature...): what a node's acceptance is counted under."""

DRAFT_BINS = 8
"""Conditional draft probabilities are counted in this many equal bins."""
PRIOR_STRENGTH = 2.0
"""Pseudo-counts of each key's prior."""
PRIORS = {"lookup": 0.5, "extend": 0.3, "alternative": 0.2, "recycle": 0.2}
"""Prior acceptance of a key's first round, by source (a draft key's prior is its bin's centre; recycled
successors past the first rank get half)."""


def draft_key(conditional: float) -> Key:
    return ("draft", min(int(conditional * DRAFT_BINS), DRAFT_BINS - 1))


class AcceptanceModel:
    """Per key, how often a node offered after an accepted parent was accepted (see the module docstring)."""

    def __init__(self) -> None:
        self.offered: dict[Key, float] = {}
        self.accepted: dict[Key, float] = {}

    def prior(self, key: Key) -> float:
        if key[0] == "draft":
            return (key[1] + 0.5) / DRAFT_BINS
        if key[0] == "recycle" and key[2] > 0:
            return PRIORS["recycle"] / 2
        return PRIORS[key[0]]

    def estimate(self, key: Key) -> float:
        return ((self.accepted.get(key, 0.0) + PRIOR_STRENGTH * self.prior(key))
                / (self.offered.get(key, 0.0) + PRIOR_STRENGTH))

    def count(self, keys: Sequence[Key], accepted: bool) -> None:
        for key in keys:
            self.offered[key] = self.offered.get(key, 0.0) + 1
            if accepted:
                self.accepted[key] = self.accepted.get(key, 0.0) + 1


def node_index(tree: DraftTree) -> dict[tuple[int, int], int]:
    """(parent node, token) -> node, for finding a branch's nodes in a tree."""
    return {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}


def tag_branch(keys: list[list[Key]], index: dict[tuple[int, int], int], branch: Sequence[int],
               key_of) -> None:
    """Add ``key_of(depth)`` (depth 1 = the branch's first token; None: no key there) to the keys of each node of
    ``branch``, a path from the root that is in the tree."""
    node = -1
    for depth, token in enumerate(branch, start=1):
        node = index.get((node, int(token)))
        if node is None:
            return
        key = key_of(depth)
        if key is not None:
            keys[node].append(key)


def draft_keys(tree: DraftTree, draft_nodes: int, keys: list[list[Key]]) -> None:
    """Key the draft's own nodes (the tree's first ``draft_nodes``) by their conditional draft probability."""
    if tree.scores is None or not draft_nodes:
        return
    scores = tree.scores[:draft_nodes].float()
    parents = tree.parents[:draft_nodes]
    before = torch.where(parents >= 0, scores[parents.clamp_min(0)], torch.zeros_like(scores))
    conditional = torch.exp(scores - before).clamp(0.0, 1.0).tolist()
    for i, c in enumerate(conditional):
        keys[i].append(draft_key(c))


def worth_checking(values: Sequence[float], node_cost: float) -> int:
    """How many of the best nodes (``values``: their estimated path probabilities, highest first) a round should
    check when each checked node costs ``node_cost`` plain decoding steps and a round that checks none one step:
    the count n that maximises the estimated tokens per step, (1 + sum of the first n values) / (1 + node_cost * n).
    The values fall and the bar a node must clear rises with n, so the first node that does not pay ends the count.
    (A real round also pays for drafting, so this prices a node a little dearer than it is.)"""
    total, count = 1.0, 0
    for value in values:
        if value * (1.0 + node_cost * count) <= node_cost * total:  # (total + v) / (1 + c(n+1)) <= total / (1 + cn)
            break
        total += value
        count += 1
    return count


def keep_best(tree: DraftTree, keys: list[list[Key]], model: AcceptanceModel, budget: int, node_cost: float = 0.0
              ) -> tuple[DraftTree, list[list[Key]]]:
    """The ``budget`` nodes of the highest estimated path probability (all when the tree is no larger), as a tree in
    the same node order, with their keys. A node with no key (none of the sources above proposed it) is kept last.
    With ``node_cost`` (a checked node's price in plain decoding steps), fewer when the next ones would not pay for
    themselves (``worth_checking``)."""
    if tree.size <= budget and not node_cost:
        return tree, keys
    estimates = [max((model.estimate(k) for k in node_keys), default=0.0) for node_keys in keys]
    value = [0.0] * tree.size
    for i, parent in enumerate(tree.parents.tolist()):  # a parent always comes before its children
        value[i] = estimates[i] * (1.0 if parent < 0 else value[parent])
    order = sorted(range(tree.size), key=lambda i: (-value[i], i))[:budget]
    if node_cost:
        order = order[: worth_checking([value[i] for i in order], node_cost)]
    if len(order) == tree.size:
        return tree, keys
    kept = sorted(order)
    new_index = {old: new for new, old in enumerate(kept)}
    parents = [new_index[p] if p >= 0 else -1 for p in tree.parents[kept].tolist()]
    device = tree.tokens.device
    pruned = DraftTree(
        tokens=tree.tokens[kept],
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=tree.depths[kept],
        q=None,
        q_rows=[-1] * (len(kept) + 1),
        draft_to_target=tree.draft_to_target,
        scores=None if tree.scores is None else tree.scores[kept],
    )
    return pruned, [keys[i] for i in kept]


def settle(model: AcceptanceModel, tree: DraftTree, keys: list[list[Key]], committed: Sequence[int]) -> None:
    """Count the round that verified ``tree``: walking down it along the ``committed`` tokens, every child of the
    root or of an accepted node is offered, and the one the committed tokens take is accepted."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents.tolist()):
        children.setdefault(parent, []).append(i)
    tokens = tree.tokens.tolist()
    node = -1
    for token in committed:
        taken = None
        for child in children.get(node, []):
            hit = tokens[child] == token
            model.count(keys[child], hit)
            if hit:
                taken = child
        if taken is None:
            return
        node = taken
