"""The drafters a job builds from one draft, by one set of settings: ``fledge eval`` and ``fledge tune`` both take
``DrafterSettings`` (their configs inherit its keys, so a key means the same in both) and build the draft, prompt
lookup and the hybrid through it, so that tune predicts and checks the drafter eval runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fledge.core.errors import ConfigError
from fledge.decode.datastore import NgramDatastore
from fledge.decode.drafters import EagleDrafter, HybridDrafter, PromptLookupDrafter
from fledge.decode.recycle import RecycleTable, check_widths
from fledge.models.draft import Eagle3Draft


@dataclass
class DrafterSettings:
    prompt_lookup_max_ngram: int = 3
    hybrid: bool = True
    """The draft and prompt lookup combined (``decode.drafters.HybridDrafter``), row ``eagle3+lookup``: the lookup
    continuation where the last n-gram occurred before, the draft elsewhere. ``fledge eval`` runs it as its own row;
    ``fledge tune`` predicts its chains and trees beside the draft's and checks it when it wins."""
    hybrid_min_ngram: int = 2
    """The shortest n-gram whose earlier occurrence makes the hybrid take the lookup continuation."""
    hybrid_draft_tokens: int = 0
    """The hybrid's draft chains stop at this many tokens (its lookup continuations still run to
    ``eval.num_draft_tokens``); 0: the same length. A draft that is seldom right past depth 1 costs a draft step and
    a verified position for each token it adds, while a lookup match is free and often long."""
    hybrid_extend: int = 0
    """Trees: the hybrid also hangs a lookup continuation under each of the draft's first ``hybrid_extend`` first
    tokens, found as if that token were committed (when the draft is right, the text it starts is often one the
    context repeats); 0: only the root's lookup branch."""
    hybrid_lookup_nodes: int = 0
    """Trees: the hybrid also adds up to this many tokens from the continuations of the other earlier occurrences
    of the last n-gram, the ones most of them share first (the latest occurrence's continuation is always there);
    0: the latest one's only. Deterministic candidates: exact, as the root branch."""
    hybrid_datastore: str | None = None
    """Where the context holds no earlier occurrence of its last n-gram, the hybrid's lookup takes the continuation
    that most often followed its last 4, 3 or 2 tokens in a datastore of the verifier's own answers
    (``eval/datastore.py``): ``shipped`` (the default verifier's answers that ship with fledge), any data source or
    .jsonl file with assistant turns, or None (the context alone). Trees gain a branch; chains take it instead of
    the draft's chain."""
    hybrid_recycle: list[int] = field(default_factory=list)
    """Trees: token recycling (``decode/recycle.py``) adds the verifier's recorded successors of the root as more
    branches, ``hybrid_recycle[d]`` per node at level d: [4, 1] adds the root's 4 recorded successors and the first
    successor of each (up to 8 tokens, fewer where the draft or the lookup has them already). The verifier's top
    tokens at every checked row are recorded each round; a sequence starts from ``hybrid_recycle_seed``. [] : off."""
    hybrid_recycle_seed: str | None = "shipped"
    """Where a sequence's recycle table starts: each token's most frequent successors in these answers (``shipped``:
    the default verifier's own, or any data source or .jsonl with assistant turns); None: an empty table."""
    hybrid_budget: int = 0
    """Trees: at most this many draft tokens a round, out of everything the draft, the lookup and the recycle
    table propose: the ones of the most expected accepted tokens, by each kind's acceptance so far in the sequence
    (``decode/merge.py``); 0: every candidate."""
    hybrid_node_cost: float | str = 0.0
    """Trees with ``hybrid_budget``: what checking one more node costs, in plain decoding steps; each round keeps
    only the best nodes whose estimated acceptance pays for their price, up to the budget (``decode/merge.py:
    worth_checking``). ``auto``: this machine's price, measured before decoding on the first prompt's KV cache: the
    slope of v(k), the cost of a verifier forward over k tokens, from 1 to 1 + budget (``node_cost``); 0: always
    the whole budget. Exact: which nodes are kept depends on earlier rounds and the draft's distribution only."""
    hybrid_draft_cost: float = 0.0
    """Trees: the draft's share of a round's cost, counted in rounds of prompt lookup alone (0.4-0.45 on a 2-core
    AMX Xeon with the default verifier: ``docs/experiments/2026-12-07-hybrid-rounds.md``). A round whose lookup
    match has been accepted often enough that the draft would add less than it costs proposes the lookup's branches
    alone (no draft, no recycled successors), and the draft reads the committed tokens when it is next asked
    (``HybridDrafter.lookup_alone``); 0: the draft every round. Exact, as the decision rests on past rounds only."""
    draft_min_prob: float = 0.0
    """The draft's chains (alone and in the hybrid) stop before a position where its most likely token has less
    probability than this; 0 always drafts ``eval.num_draft_tokens``. Exact for greedy and sampled decoding."""

    def eagle(self, draft: Eagle3Draft) -> EagleDrafter:
        return EagleDrafter(draft, self.draft_min_prob)

    def lookup(self, store: NgramDatastore | None) -> PromptLookupDrafter:
        """The hybrid's prompt lookup (and ``lookup+datastore``'s): from ``hybrid_min_ngram`` matching tokens."""
        return PromptLookupDrafter.matching(self.hybrid_min_ngram, self.prompt_lookup_max_ngram, store)

    @property
    def measures_node_cost(self) -> bool:
        """``hybrid_node_cost=auto``: the price of a checked node is measured on the machine (``node_cost``)."""
        return self.hybrid_node_cost == "auto"

    def check_node_cost(self) -> None:
        """Refuse a ``hybrid_node_cost`` that is neither a number >= 0 nor ``auto``, or one with no budget to price
        (it would do nothing)."""
        cost = self.hybrid_node_cost
        if (isinstance(cost, str) and cost != "auto") or (not isinstance(cost, str) and cost < 0):
            raise ConfigError(f"hybrid_node_cost must be a number >= 0 or auto, got {cost!r}")
        if cost and not self.hybrid_budget:
            raise ConfigError(f"hybrid_node_cost={cost} prices the nodes of hybrid_budget, which is 0 (off)",
                              fix="set hybrid_budget=N (the quickstart's is 16)")

    def node_cost(self, verify: Mapping[int, float] | None = None) -> float:
        """The hybrid's price of a checked node in plain decoding steps: ``hybrid_node_cost``, or with ``auto`` the
        slope of v(k) over k fitted by least squares to ``verify`` ({k: v(k)}, measured; a single forward's time
        is noisy on a shared CPU, a line through several lengths less so)."""
        self.check_node_cost()
        cost = self.hybrid_node_cost
        if isinstance(cost, str):
            if verify is None or len(verify) < 2:
                raise ValueError("hybrid_node_cost=auto needs the verifier's v(k) measured at two lengths or more")
            mean_k, mean_v = sum(verify) / len(verify), sum(verify.values()) / len(verify)
            spread = sum((k - mean_k) ** 2 for k in verify)
            return max(0.0, sum((k - mean_k) * (v - mean_v) for k, v in verify.items()) / spread)
        return float(cost)

    def hybrid_of(self, draft: Eagle3Draft, store: NgramDatastore | None,
                  recycle: RecycleTable | None = None, node_cost: float | None = None) -> HybridDrafter:
        """The hybrid over ``draft``; ``node_cost``: the measured price where ``hybrid_node_cost=auto``
        (``node_cost``)."""
        return HybridDrafter(self.eagle(draft), self.lookup(store), draft_tokens=self.hybrid_draft_tokens,
                             extend=self.hybrid_extend, lookup_nodes=self.hybrid_lookup_nodes, recycle=recycle,
                             budget=self.hybrid_budget, draft_cost=self.hybrid_draft_cost,
                             node_cost=self.node_cost() if node_cost is None else node_cost)

    def recycle_table(self, tokenizer, vocab_size: int, fingerprint: str | None = None) -> RecycleTable | None:
        """The hybrid's recycle table, seeded as ``hybrid_recycle_seed`` says; None when ``hybrid_recycle`` is off."""
        if not self.hybrid_recycle:
            return None
        from fledge.eval.datastore import recycle_seed

        widths = check_widths(self.hybrid_recycle)
        return RecycleTable(recycle_seed(self.hybrid_recycle_seed, tokenizer, vocab_size, max(widths), fingerprint),
                            widths)
