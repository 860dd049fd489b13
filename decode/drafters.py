"""Drafters behind the ``Drafter`` protocol of ``decode/proposals.py``: n-gram prompt lookup, a random draft for
tests, and the EAGLE-3 draft head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fledge.core.errors import ConfigError
from fledge.decode import merge
from fledge.decode.datastore import NgramDatastore
from fledge.decode.proposals import (
    ChainDraft, Drafter, DraftTree, TreeShape, empty_tree, grow_tree, propose_chain_with,
)
from fledge.decode.recycle import RecycleTable
from fledge.models.draft import Eagle3Draft
from fledge.models.sampling import SamplingParams


MAX_OCCURRENCES = 32
"""The most earlier occurrences of an n-gram whose continuations ``PromptLookupDrafter.alternatives`` counts."""
DRAFT_GAIN_PRIOR = 1.0
"""``HybridDrafter.lookup_alone``: tokens a round's draft is assumed to add to the lookup's, and tokens the lookup
is assumed to accept, before the sequence has shown its own (each weighted as ``merge.PRIOR_STRENGTH`` rounds)."""
EXPLORE_ROUNDS = 4
"""``HybridDrafter.lookup_alone``: after this many rounds in a row without the draft at one match length, a round
drafts anyway, so that the draft's gain there is measured again."""


@dataclass
class MatchRecord:
    """What one sequence's tree rounds did after lookup matches of one length (``HybridDrafter.lookup_alone``)."""

    rounds: int = 0
    lookup_tokens: int = 0
    """Of the lookup's branch, the tokens accepted (all rounds)."""
    drafted: int = 0
    """Rounds that drafted."""
    gain: int = 0
    """Tokens the rounds that drafted accepted beyond the lookup's."""
    alone_in_a_row: int = 0


class PromptLookupDrafter:
    """n-gram prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed.

    No model, no training; proposals are deterministic (q one-hot), chain only. Longer n-grams are tried first.
    """

    needs_aux = False
    aux_layer_ids = None
    supports_tree = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, datastore: NgramDatastore | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.datastore = datastore
        """Where the context holds no earlier occurrence, the continuation the datastore's answers most often
        had after the context's last tokens (``decode/datastore.py``); None: the context alone."""
        self._buffer = torch.empty(0, dtype=torch.long)
        self._length = 0
        self.match_length = 0
        """How many tokens the last ``continuation``'s match had (0: none in the context; the datastore's, if any)."""

    @classmethod
    def matching(cls, min_ngram: int, max_ngram: int = 3, datastore: NgramDatastore | None = None
                 ) -> PromptLookupDrafter:
        """A lookup that proposes only after ``min_ngram`` matching tokens (the hybrid's ``hybrid_min_ngram``),
        trying n-grams up to ``max_ngram`` or ``min_ngram``, whichever is longer."""
        return cls(max(max_ngram, min_ngram), min_ngram, datastore)

    def fresh(self) -> PromptLookupDrafter:
        return PromptLookupDrafter(self.max_ngram, self.min_ngram, self.datastore)

    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._buffer = torch.empty(max(1024, 2 * context.numel()), dtype=torch.long)
        self._length = 0
        self._append(context)

    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._append(new_tokens)

    def _append(self, tokens: torch.Tensor) -> None:
        # A growing buffer, so that a round costs a slice write rather than a copy of the whole context.
        end = self._length + tokens.numel()
        if end > self._buffer.numel():
            grown = torch.empty(2 * end, dtype=torch.long)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : end] = tokens.cpu()
        self._length = end

    def propose_chain(self, n: int, sampling: SamplingParams, generator: torch.Generator | None) -> ChainDraft:
        return ChainDraft(tokens=self.continuation([], n), q=None)

    @property
    def last_token(self) -> int:
        """The newest committed token (the next round's root)."""
        return int(self._buffer[self._length - 1])

    def _matches(self, tail: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Where the continuations of the longest n-gram ending ``tail`` that occurred earlier in the committed
        context start (ascending), and that n-gram's length; empty and 0 when none of ``min_ngram`` tokens or more
        did."""
        context = self._buffer[: self._length]
        for size in range(min(self.max_ngram, tail.numel() - 1, self._length - 1), self.min_ngram - 1, -1):
            # Windows of the committed context that end before its last token, so a match always has a continuation.
            windows = context[:-1].unfold(0, size, 1)
            hits = torch.nonzero((windows == tail[-size:]).all(dim=1))
            if hits.numel():
                return hits[:, 0] + size, size
        return torch.empty(0, dtype=torch.long), 0

    def continuation(self, extra: list[int], n: int) -> torch.Tensor:
        """Up to ``n`` tokens that followed the latest earlier occurrence of the context's last n-gram, the context
        read as if ``extra`` (tokens not committed yet, a draft's guess) followed it; where the context has none,
        the datastore's continuation of its last tokens (if there is a datastore); empty when nothing matches."""
        context = self._buffer[: self._length]
        tail = torch.cat([context, torch.tensor(extra, dtype=torch.long)]) if extra else context
        starts, self.match_length = self._matches(tail)
        if starts.numel():
            start = int(starts[-1])
            return context[start : start + n].clone()
        if self.datastore is not None:
            found = self.datastore.continuation(tail[-self.datastore.max_ngram:].tolist(), n)
            if found:
                return torch.tensor(found, dtype=torch.long)
        return torch.empty(0, dtype=torch.long)

    def alternatives(self, n: int, nodes: int, occurrences: int = MAX_OCCURRENCES) -> list[torch.Tensor]:
        """Paths of up to ``n`` tokens that the other earlier occurrences of the context's last n-gram continued
        with (the latest one's continuation is ``continuation``), ``nodes`` tokens in all at most: the prefixes most
        of the ``occurrences`` latest ones share first (then the shorter, then the more recent), leaving out the
        latest continuation's own prefixes. A prefix's count is never below its extensions', so the chosen prefixes
        hang together; each returned path ends at a chosen prefix that no other chosen one extends, most shared
        first. Empty without a match in the context (the datastore proposes one continuation only)."""
        if nodes <= 0:
            return []
        context = self._buffer[: self._length]
        starts, _ = self._matches(context)
        if starts.numel() < 2:
            return []
        latest = context[int(starts[-1]) : int(starts[-1]) + n].tolist()
        taken = {tuple(latest[:j]) for j in range(1, len(latest) + 1)}
        counts: dict[tuple[int, ...], int] = {}
        for start in reversed(starts[-occurrences - 1 : -1].tolist()):  # latest first: ties go to the recent
            path = context[start : start + n].tolist()
            for j in range(1, len(path) + 1):
                key = tuple(path[:j])
                if key not in taken:
                    counts[key] = counts.get(key, 0) + 1
        order = {key: i for i, key in enumerate(counts)}
        chosen = sorted(counts, key=lambda key: (-counts[key], len(key), order[key]))[:nodes]
        extended = {key[:-1] for key in chosen}
        return [torch.tensor(key, dtype=torch.long) for key in chosen if key not in extended]

    def propose_tree(self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        raise NotImplementedError("prompt lookup proposes chains only; use method=chain")


class RandomDrafter:
    """A deliberately bad draft: random logits at every step (its own seeded generator), so its proposals are
    random tokens with a random, peaked q. Used to show that the loops stay lossless when almost nothing is
    accepted."""

    needs_aux = False
    aux_layer_ids = None
    supports_tree = True

    def __init__(self, vocab_size: int, seed: int = 0, sharpness: float = 3.0, device: str | torch.device = "cpu"):
        self.target_vocab_size = vocab_size
        self.draft_to_target: torch.Tensor | None = None
        self.sharpness = sharpness
        self.device = torch.device(device)
        # Its own generator, on the device its logits live on (a CUDA generator cannot fill a CPU tensor).
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seed = seed
        self._slots = 0

    def fresh(self) -> RandomDrafter:
        """Another instance with its own seed (the next one), for another row of a batch."""
        self._seed += 1
        return RandomDrafter(self.target_vocab_size, self._seed, self.sharpness, self.device)

    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._slots = 0

    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        self._slots = 0

    def root_logits(self) -> torch.Tensor:
        return torch.randn(self.target_vocab_size, generator=self._generator, device=self.device) * self.sharpness

    def expand(self, parent_slots: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        k = len(parent_slots)
        slots = list(range(self._slots, self._slots + k))
        self._slots += k
        logits = torch.randn(k, self.target_vocab_size, generator=self._generator, device=self.device)
        return logits * self.sharpness, slots

    def propose_chain(self, n: int, sampling: SamplingParams, generator: torch.Generator | None) -> ChainDraft:
        return propose_chain_with(self, n, sampling, generator)

    def propose_tree(self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        return grow_tree(self, shape, sampling, generator)


class EagleDrafter:
    """The EAGLE-3 draft head as a drafter: its weights and settings. The stepping is written once, for any number
    of rows, in ``BatchedEagle`` (``decode/batch_draft.py``), which ``batch_drafter`` builds from these; a batch of
    one row is its smallest case.

    Position t of the draft reads fc(aux_t) (the verifier's features at t) with the token x_{t+1} and predicts
    x_{t+2}; deeper draft steps feed back the draft's own hidden output.
    """

    needs_aux = True
    supports_tree = True

    def __init__(self, draft: Eagle3Draft, min_prob: float = 0.0):
        self.draft = draft.eval()
        self.aux_layer_ids = [int(i) for i in draft.config.aux_layer_ids]
        """The verifier states this draft was trained on: the draft, not the verifier's defaults, decides them."""
        self.min_prob = min_prob
        """Chains stop before a position the draft is less sure of than this (``propose_chain_with``)."""
        self.rank_top_k = 0
        """Greedy chains also record the draft's top-k tokens per position (``ChainDraft.top_ids``) when > 0."""
        self.device = draft.fc.weight.device
        self.target_vocab_size = int(draft.config.vocab_size)
        draft_vocab = int(draft.config.draft_vocab_size)
        identity = draft_vocab == self.target_vocab_size and not bool(draft.d2t.any())
        self.draft_to_target: torch.Tensor | None = (
            None if identity else torch.arange(draft_vocab, device=self.device) + draft.d2t.to(self.device)
        )

    def fresh(self) -> EagleDrafter:
        other = type(self)(self.draft, self.min_prob)
        other.rank_top_k = self.rank_top_k
        return other


class HybridDrafter:
    """Prompt lookup and the EAGLE-3 draft in one proposal: where the last n-gram (``min_ngram`` tokens or more)
    occurred before in the prompt or the output, its continuation; everywhere else, the draft.

    Small verifiers repeat themselves and echo their prompts, which prompt lookup proposes for free and accepts often
    once it matches (n-α rising with depth), while the draft is right about the first token of new text. A chain
    takes the lookup continuation when there is one and the draft's chain otherwise; a tree is the draft's
    EAGLE-2 tree with the lookup continuation added as one more branch from the root (sharing the nodes it agrees
    with), as deep as the shape's ``branch_depth`` (the chain's N in ``fledge eval``, so that a shallow tree of the
    draft's top-k first tokens still carries a long lookup continuation). Both stay exact: which proposal is made
    depends only on the committed tokens, lookup tokens are deterministic candidates (point-mass q), and the added
    branch is verified like any deterministic sibling; a tree of *sampled* children gets no branch, since its rule
    needs every sibling drawn from q.

    Trees may also carry the verifier's own recorded successors of the root (``recycle``: token recycling,
    ``decode/recycle.py``), and ``budget`` keeps the candidates of the most expected accepted tokens out of all of
    them (``decode/merge.py``), with ``node_cost`` only those that pay for their place in the check; all stay exact
    for the same reasons. With ``draft_cost``, a round whose lookup match is trusted enough proposes without the
    draft at all (``lookup_alone``), as prompt lookup alone would, and the draft catches up on the committed tokens
    when it is next asked.

    Over an ``EagleDrafter`` the hybrid runs as ``BatchedHybrid`` (``decode/batch_draft.py``: lookup per row, the
    draft batched); its own ``start``/``advance``/``propose_*`` serve any other draft that proposes row by row.
    """

    needs_aux = True
    supports_tree = True

    def __init__(self, eagle: Drafter, lookup: PromptLookupDrafter, draft_tokens: int = 0, extend: int = 0,
                 lookup_nodes: int = 0, recycle: RecycleTable | None = None, budget: int = 0,
                 draft_cost: float = 0.0, node_cost: float = 0.0):
        settings = (("lookup_nodes", lookup_nodes, "off"), ("draft_tokens", draft_tokens, "the chain's length"),
                    ("extend", extend, "off"), ("budget", budget, "every candidate"),
                    ("draft_cost", draft_cost, "the draft every round"),
                    ("node_cost", node_cost, "the whole budget"))
        for key, value, zero in settings:
            if value < 0:
                raise ConfigError(f"hybrid {key} must be >= 0 (0: {zero}), got {value}")
        if node_cost and not budget:
            raise ConfigError(f"hybrid node_cost={node_cost} prices the nodes of the budget, which is 0 (off)",
                              fix="give the hybrid a budget")
        self.eagle = eagle
        self.lookup = lookup
        self.draft_tokens = draft_tokens
        """The draft's chains stop at this many tokens (0: as many as asked); lookup continuations do not."""
        self.extend = extend
        """Trees: the draft's first ``extend`` first tokens each get a lookup continuation too, found as if that
        token were committed (0: only the root's lookup branch)."""
        self.lookup_nodes = lookup_nodes
        """Trees: up to this many more tokens from the other earlier occurrences of the last n-gram, the
        continuations most of them share first (``PromptLookupDrafter.alternatives``; 0: the latest one's only)."""
        self.aux_layer_ids = eagle.aux_layer_ids
        self.draft_to_target = eagle.draft_to_target
        self.target_vocab_size = eagle.target_vocab_size
        self.used_lookup = 0
        """Rounds whose proposal came from prompt lookup (chains) or carried a lookup branch (trees)."""
        self.extended = 0
        """Lookup branches hung under the draft's first tokens (``extend``)."""
        self.lookup_rejected = 0
        """Rounds where the verifier rejected a token of the lookup's proposal (the chain, or the tree's root branch):
        the committed tokens left it before its end."""
        self.alternative_nodes = 0
        """Tokens of other occurrences' continuations added to trees (``lookup_nodes``)."""
        self.recycle = recycle
        """Trees: the verifier's recorded successors of the root, and theirs, as more branches
        (``decode/recycle.py``); None: off."""
        self.recycled_nodes = 0
        """Tokens the recycle table added to trees (beyond the nodes the draft and the lookup had already)."""
        self.budget = budget
        """Trees: at most this many draft tokens, the candidates of the most expected accepted tokens
        (``decode/merge.py``); 0: every candidate."""
        self.acceptance = merge.AcceptanceModel()
        """This sequence's acceptance per candidate kind, learned from its rounds (``budget``)."""
        self.pruned_nodes = 0
        """Candidates the budget left out."""
        self.draft_cost = draft_cost
        """Trees: the draft's share of a round's cost, in rounds of prompt lookup alone (0: the draft every round);
        ``lookup_alone`` weighs what the draft would add against it."""
        self.node_cost = node_cost
        """Trees with a ``budget``: a checked node's price in plain decoding steps; a round keeps fewer than
        ``budget`` nodes where the next ones would add fewer tokens than they cost (``merge.worth_checking``; 0: the
        whole budget)."""
        self.lookup_alone_rounds = 0
        """Tree rounds proposed without the draft (``draft_cost``)."""
        self.by_match: dict[int, MatchRecord] = {}
        """This sequence's rounds per length of the lookup's match (0: the datastore's), for ``lookup_alone``."""
        self._proposed: tuple[DraftTree, list] | None = None
        self._offered: list[int] = []
        self._round: tuple[int, bool] | None = None

    def fresh(self) -> HybridDrafter:
        return HybridDrafter(self.eagle.fresh(), self.lookup.fresh(), self.draft_tokens, self.extend,
                             self.lookup_nodes, None if self.recycle is None else self.recycle.fresh(), self.budget,
                             self.draft_cost, self.node_cost)

    @property
    def observe_top_k(self) -> int:
        return 0 if self.recycle is None else self.recycle.k

    def observe(self, tokens: torch.Tensor, top_ids: torch.Tensor) -> None:
        """The last verified block: its tokens [q] (root, then nodes) and the verifier's top ids there [q, k]."""
        if self.recycle is not None:
            self.recycle.observe(tokens, top_ids)

    def draft_length(self, n: int) -> int:
        return min(n, self.draft_tokens) if self.draft_tokens else n

    def start(self, context: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.restart()
        self.lookup.start(context, aux)
        self.eagle.start(context, aux)

    def restart(self) -> None:
        """A new sequence: the recycle table back to its seed, the acceptance estimates back to their priors."""
        if self.recycle is not None:
            self.recycle.restart()
        self.acceptance = merge.AcceptanceModel()
        self.by_match = {}
        self._proposed = None
        self._offered = []
        self._round = None

    def advance(self, new_tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.settle(new_tokens.tolist())
        self.lookup.advance(new_tokens, aux)
        self.eagle.advance(new_tokens, aux)

    def offer(self, tokens: list[int]) -> None:
        """Remember this round's lookup proposal, to count it rejected (``settle``) if the committed tokens leave it."""
        self._offered = tokens

    def settle(self, committed: list[int]) -> None:
        if self._offered and committed[: len(self._offered)] != self._offered:
            self.lookup_rejected += 1
        if self._round is not None and self._offered:
            record, drafted = self.by_match.setdefault(self._round[0], MatchRecord()), self._round[1]
            accepted = len(committed) - 1
            shared = next((i for i, (a, b) in enumerate(zip(committed, self._offered)) if a != b),
                          min(len(committed), len(self._offered)))
            lookup = min(shared, accepted)
            record.rounds += 1
            record.lookup_tokens += lookup
            record.drafted += drafted
            record.gain += (accepted - lookup) if drafted else 0
            record.alone_in_a_row = 0 if drafted else record.alone_in_a_row + 1
        self._offered = []
        self._round = None
        if self._proposed is not None:
            merge.settle(self.acceptance, *self._proposed, committed)
            self._proposed = None

    def propose_chain(self, n: int, sampling: SamplingParams, generator: torch.Generator | None) -> ChainDraft:
        found = self.lookup.propose_chain(n, sampling, generator)
        if found.tokens.numel():
            self.used_lookup += 1
            self.offer(found.tokens.tolist())
            return found
        return self.eagle.propose_chain(self.draft_length(n), sampling, generator)

    def propose_tree(self, shape: TreeShape, sampling: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        if self.lookup_alone(shape):
            return self.with_lookup(empty_tree(), shape, drafted=False)
        return self.with_lookup(self.eagle.propose_tree(shape, sampling, generator), shape)

    def lookup_alone(self, shape: TreeShape) -> bool:
        """Whether this tree round goes without the draft (``draft_cost``): the lookup's branch alone, as prompt
        lookup would propose it. Per length of the lookup's match, the sequence's rounds so far say how many of its
        tokens the lookup accepts (L, all rounds) and how many more the rounds that drafted accepted (G: what the
        draft's tree and the recycled successors add). A round with them yields about 1 + L + G tokens at
        1 + draft_cost the cost of one without, which yields 1 + L: the draft is left out when
        (1 + L) draft_cost >= G, and drafts anyway after ``EXPLORE_ROUNDS`` rounds in a row without, to measure G
        again. Both rest on committed tokens and past rounds only: exact."""
        if not self.draft_cost:
            return False
        if not self.lookup.continuation([], shape.branch_depth).numel():
            return False
        key = self.lookup.match_length
        record, prior = self.by_match.get(key, MatchRecord()), merge.PRIOR_STRENGTH
        lookup = (record.lookup_tokens + prior * DRAFT_GAIN_PRIOR) / (record.rounds + prior)
        gain = (record.gain + prior * DRAFT_GAIN_PRIOR) / (record.drafted + prior)
        alone = (1 + lookup) * self.draft_cost >= gain and record.alone_in_a_row < EXPLORE_ROUNDS
        self._round = (key, not alone)
        self.lookup_alone_rounds += alone
        return alone

    def with_lookup(self, tree: DraftTree, shape: TreeShape, drafted: bool = True) -> DraftTree:
        """The draft's ``tree`` (``drafted``; else an empty tree) with its lookup branches: the context's continuation
        from the root, and with ``extend``, the continuation after each of the draft's first ``extend`` first tokens
        (the one that is right then leads into text the context repeats); with ``lookup_nodes`` other occurrences'
        continuations, with ``recycle`` (when ``drafted``) the recorded successors. With ``budget``, the best
        ``budget`` nodes of it all (``decode/merge.py``). Trees of sampled children are left as they are."""
        if tree.q is not None:
            return tree
        draft_nodes = tree.size
        tagged = []  # (branch, its nodes' key by depth), for the budget
        branches = [self.lookup.continuation([], shape.branch_depth)]
        self.offer(branches[0].tolist())
        # Its nodes' acceptance is learned by depth and by how long the match was (0: the datastore's).
        tagged.append((branches[0], lambda d, m=self.lookup.match_length: ("lookup", min(d, 6), m)))
        if self.extend and shape.branch_depth > 1:
            firsts = [t for t, d in zip(tree.tokens.tolist(), tree.depths.tolist()) if d == 1][: self.extend]
            for token in firsts:
                more = self.lookup.continuation([token], shape.branch_depth - 1)
                if more.numel():
                    branches.append(torch.cat([torch.tensor([token]), more]))
                    tagged.append((branches[-1], lambda d: None if d == 1 else ("extend", min(d, 6))))
                    self.extended += 1
        branches = [b for b in branches if b.numel()]
        if branches:
            self.used_lookup += 1
        for branch in branches:
            tree = with_branch(tree, branch.to(tree.tokens.device))
        if self.lookup_nodes:
            size = tree.size
            for branch in self.lookup.alternatives(shape.branch_depth, self.lookup_nodes):
                tree = with_branch(tree, branch.to(tree.tokens.device))
                tagged.append((branch, lambda d: ("alternative", min(d, 6))))
            self.alternative_nodes += tree.size - size
        if self.recycle is not None and drafted:
            size = tree.size
            for ranks, path in self.recycle.paths(self.lookup.last_token):
                path = path[: shape.branch_depth]
                tree = with_branch(tree, torch.tensor(path, device=tree.tokens.device))
                tagged.append((path, lambda d, ranks=ranks: ("recycle", d, ranks[d - 1])))
            self.recycled_nodes += tree.size - size
        if self.budget:
            keys: list[list] = [[] for _ in range(tree.size)]
            merge.draft_keys(tree, draft_nodes, keys)
            index = merge.node_index(tree)
            for branch, key_of in tagged:
                merge.tag_branch(keys, index, [int(t) for t in branch], key_of)
            size = tree.size
            tree, keys = merge.keep_best(tree, keys, self.acceptance, self.budget, self.node_cost)
            self.pruned_nodes += size - tree.size
            self._proposed = (tree, keys)
        return tree


def with_branch(tree: DraftTree, branch: torch.Tensor) -> DraftTree:
    """``tree`` with the chain ``branch`` hanging from the root: it follows existing nodes while their tokens agree
    and continues as new nodes (appended, so that every parent still precedes its children, and tried after the
    tree's own siblings). Only for trees of deterministic children (``q`` None)."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    node = -1
    for depth, token in enumerate(branch.tolist(), start=1):
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if child is None:
            tokens.append(token)
            parents.append(node)
            depths.append(depth)
            child = len(tokens) - 1
        node = child
    device = tree.tokens.device
    scores = None
    if tree.scores is not None:
        scores = torch.cat([tree.scores, tree.scores.new_full((len(tokens) - tree.size,), float("nan"))])
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        q=None,
        q_rows=[-1] * (len(tokens) + 1),
        draft_to_target=tree.draft_to_target,
        scores=scores,
    )
