"""The hybrid drafter's chains and trees: the draft's chains cut short, a long lookup branch on a shallow tree,
continuations under the draft's first tokens (``hybrid_extend``) and other occurrences' continuations
(``hybrid_lookup_nodes``); each exact, and equal at batch 1 and batched."""

from __future__ import annotations

import pytest
import torch

from fledge.decode.batch_draft import BatchedHybrid, batch_drafter
from fledge.decode.drafters import EagleDrafter, HybridDrafter, PromptLookupDrafter
from fledge.decode.loop import decode_one
from fledge.decode.proposals import DraftTree, TreeShape
from fledge.models.sampling import SamplingParams

from test_spec_loop import (  # noqa: F401 (the fixtures are used by name)
    AUX_IDS, MAX_NEW, PROMPT, VOCAB, random_eagle, reference, verifier, verifier_aux,
)

from reference_decode import ReferenceEagle, generate_plain


def check_real_hybrid(verifier, make, context: torch.Tensor, shape: TreeShape) -> HybridDrafter:
    """``make()`` (a real draft's hybrid with a tree option on) against ``make(0)`` (off): its trees are larger,
    the one-row reference and the batched hybrid build the same ones, and its greedy output is plain greedy's.
    Returns the hybrid that decoded, for its counters."""
    aux = verifier_aux(verifier, context.tolist())[:-1]
    alone, off = make(eagle=ReferenceEagle), make(0, eagle=ReferenceEagle)
    alone.start(context, aux)
    off.start(context, aux)
    expected = alone.propose_tree(shape, SamplingParams(), None)
    assert expected.size > off.propose_tree(shape, SamplingParams(), None).size
    batched = batch_drafter([make(), make()])
    batched.start([context, context], [aux, aux])
    for got in batched.propose_trees([shape, shape], SamplingParams(), None):
        assert got.tokens.tolist() == expected.tokens.tolist() and got.parents.tolist() == expected.parents.tolist()
    plain = generate_plain(verifier, context, max_new_tokens=MAX_NEW).tokens
    made = make()
    result = decode_one(verifier, context, made, method="tree", shape=shape, max_new_tokens=MAX_NEW,
                        aux_layer_ids=AUX_IDS)
    assert result.tokens == plain
    return made


def test_hybrid_draft_tokens_shortens_the_drafts_chains_only(verifier, reference):
    """``hybrid_draft_tokens=1``: where prompt lookup has no match the draft proposes one token, where it has one the
    lookup continuation keeps its full length; batch 1 and the batched hybrid alike, greedy output exact."""

    draft = random_eagle(verifier)
    context = torch.tensor([3, 17, 42, 99, 5, 3, 17, 42, 99, 5, 3, 17])  # "3 17" occurred before: a lookup match
    fresh = torch.tensor([3, 17, 42, 99, 5, 250, 8])  # "250 8" did not: the draft's chain
    aux = {len(c): verifier_aux(verifier, c.tolist())[:-1] for c in (context, fresh)}

    def hybrid(eagle=EagleDrafter):
        return HybridDrafter(eagle(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2), draft_tokens=1)

    one = hybrid(ReferenceEagle)
    one.start(context, aux[len(context)])
    assert one.propose_chain(4, SamplingParams(), None).tokens.tolist() == [42, 99, 5, 3]
    one.start(fresh, aux[len(fresh)])
    assert one.propose_chain(4, SamplingParams(), None).tokens.numel() == 1
    batched = batch_drafter([hybrid(), hybrid()])
    assert isinstance(batched, BatchedHybrid)
    batched.start([context, fresh], [aux[len(context)], aux[len(fresh)]])
    assert [c.tokens.numel() for c in batched.propose_chains([4, 4], SamplingParams(), None)] == [4, 1]
    result = decode_one(verifier, PROMPT, hybrid(), method="chain", num_draft_tokens=4, max_new_tokens=MAX_NEW,
                        aux_layer_ids=AUX_IDS)
    assert result.tokens == reference and max(result.proposed) <= 4
    with pytest.raises(ValueError, match="draft_tokens must be >= 0"):
        HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(), draft_tokens=-1)


def test_a_shallow_hybrid_tree_carries_a_long_lookup_branch(verifier, reference):
    """``TreeShape.lookup_depth``: a depth-1 tree (the draft's top-k first tokens, no draft forward beyond the root)
    still carries the lookup continuation as deep as ``lookup_depth``; capped by a round's budget; batch 1 and the
    batched hybrid alike; greedy output exact and the trace as deep as the branch."""
    from fledge.core.errors import ConfigError
    from fledge.eval.metrics import acceptance_entry

    draft = random_eagle(verifier)
    context = torch.tensor([3, 17, 42, 99, 5, 3, 17, 42, 99, 5, 3, 17])  # "3 17" occurred before: a lookup match
    fresh = torch.tensor([3, 17, 42, 99, 5, 250, 8])  # "250 8" did not
    aux = {len(c): verifier_aux(verifier, c.tolist())[:-1] for c in (context, fresh)}
    shape = TreeShape(depth=1, top_k=3, total_tokens=3, lookup_depth=4)
    assert (shape.branch_depth, TreeShape(depth=2, top_k=2, total_tokens=2).branch_depth) == (4, 2)
    assert (shape.capped(2).depth, shape.capped(2).branch_depth, shape.capped(9).branch_depth) == (1, 2, 4)

    def hybrid(eagle=EagleDrafter):
        return HybridDrafter(eagle(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2))

    one = hybrid(ReferenceEagle)
    one.start(context, aux[len(context)])
    tree = one.propose_tree(shape, SamplingParams(), None)
    assert int(tree.depths.max()) == 4
    branch = [t for t, d in zip(tree.tokens.tolist(), tree.depths.tolist()) if d > 1]
    assert branch == [99, 5, 3]  # below the root's "42" (a draft child or the branch's own), the continuation
    one.start(fresh, aux[len(fresh)])
    assert one.propose_tree(shape, SamplingParams(), None).depths.tolist() == [1, 1, 1]
    batched = batch_drafter([hybrid(), hybrid()])
    batched.start([context, fresh], [aux[len(context)], aux[len(fresh)]])
    assert [int(t.depths.max()) for t in batched.propose_trees([shape, shape], SamplingParams(), None)] == [4, 1]
    repeating = torch.tensor([3, 17, 42, 3, 17, 42, 3, 17])
    plain = generate_plain(verifier, repeating, max_new_tokens=MAX_NEW).tokens
    result = decode_one(verifier, repeating, hybrid(), method="tree", shape=shape, max_new_tokens=MAX_NEW,
                        aux_layer_ids=AUX_IDS)
    assert result.tokens == plain and max(result.proposed) > 1  # a lookup branch went past the draft's depth 1
    assert acceptance_entry([result], "tree", 5, 1)[0]["num_draft"] == max(result.proposed)  # the trace's N
    assert acceptance_entry([result], "chain", 5, 1)[0]["num_draft"] == 5
    with pytest.raises(ConfigError, match="lookup_depth"):
        TreeShape(depth=1, top_k=1, total_tokens=1, lookup_depth=-1)


class FixedTree:
    """A stand-in draft whose tree is always the same first tokens (depth 1), to see where lookup branches go."""

    aux_layer_ids = draft_to_target = None
    target_vocab_size = VOCAB

    def __init__(self, firsts: list[int]):
        self.firsts = firsts

    def start(self, context, aux):
        pass

    def propose_tree(self, shape, sampling, generator):
        n = len(self.firsts)
        return DraftTree(tokens=torch.tensor(self.firsts), parents=torch.full((n,), -1),
                         depths=torch.ones(n, dtype=torch.long), q=None, q_rows=[-1] * (n + 1), draft_to_target=None)


def test_hybrid_extend_hangs_lookup_continuations_under_the_drafts_first_tokens(verifier, reference):
    """``hybrid_extend``: the draft's first tokens each get the continuation the context would have after them,
    the first ``extend`` of them in the draft's order; batch 1 and the batched hybrid build the same trees, and the
    greedy output stays plain greedy's."""
    from fledge.core.errors import ConfigError
    # "9 2" never occurred: no root branch. "2 7" did (then 40 41 42), "2 5" did (then 30 31 32), "2 9" did not.
    context = torch.tensor([1, 2, 5, 30, 31, 32, 8, 2, 7, 40, 41, 42, 9, 2])
    shape = TreeShape(depth=1, top_k=3, total_tokens=3, lookup_depth=4)

    def tree(extend: int) -> DraftTree:
        hybrid = HybridDrafter(FixedTree([7, 9, 5]), PromptLookupDrafter(max_ngram=3, min_ngram=2), extend=extend)
        hybrid.start(context, None)
        return hybrid.propose_tree(shape, SamplingParams(), None)

    assert tree(0).tokens.tolist() == [7, 9, 5]
    one = tree(1)
    assert one.tokens.tolist() == [7, 9, 5, 40, 41, 42] and one.parents.tolist() == [-1, -1, -1, 0, 3, 4]
    assert one.depths.tolist() == [1, 1, 1, 2, 3, 4]
    three = tree(3)  # 9 has no continuation; 5 gets 30 31 32, cut at the branch's depth
    assert three.tokens.tolist() == [7, 9, 5, 40, 41, 42, 30, 31, 32]
    assert three.parents.tolist() == [-1, -1, -1, 0, 3, 4, 2, 6, 7]
    with pytest.raises(ConfigError, match="extend"):
        HybridDrafter(FixedTree([1]), PromptLookupDrafter(), extend=-1)

    draft = random_eagle(verifier)
    # Every id of the draft's vocabulary occurs in the context: whatever its first tokens, each has a continuation.
    repeating = torch.arange(10, 10 + 2 * 96, 2).repeat(2)[:150]
    made = check_real_hybrid(verifier, lambda extend=3, eagle=EagleDrafter: HybridDrafter(
        eagle(draft), PromptLookupDrafter(max_ngram=2, min_ngram=1), extend=extend), repeating, shape)
    assert made.extended > 0


def test_hybrid_lookup_nodes_adds_the_continuations_most_other_occurrences_share(verifier):
    """``hybrid_lookup_nodes``: beside the latest occurrence's continuation, the prefixes most of the other
    occurrences of the last n-gram continued with, within the node budget; batch 1 and the batched hybrid build the
    same trees, and the greedy output stays plain greedy's."""
    from fledge.core.errors import ConfigError
    # "5 6" occurred four times before the end: followed by 7 8 (twice), 7 9 and, latest, 3 4.
    context = torch.tensor([5, 6, 7, 8, 1, 5, 6, 7, 9, 1, 5, 6, 7, 8, 2, 5, 6, 3, 4, 1, 5, 6])
    lookup = PromptLookupDrafter(max_ngram=2, min_ngram=2)
    lookup.start(context, None)
    assert lookup.continuation([], 2).tolist() == [3, 4]
    paths = lambda nodes: [p.tolist() for p in lookup.alternatives(2, nodes)]  # noqa: E731
    assert paths(0) == []
    assert paths(1) == [[7]]  # shared by all three others
    assert paths(2) == [[7, 8]]  # 7 8 twice, 7 9 once
    assert paths(3) == [[7, 8], [7, 9]]
    assert paths(9) == [[7, 8], [7, 9]]  # nothing more to add
    assert [p.tolist() for p in lookup.alternatives(2, 9, occurrences=1)] == [[7, 8]]  # the latest other only
    lookup.start(torch.tensor([5, 6, 1, 2]), None)
    assert lookup.alternatives(2, 9) == []  # no match

    shape = TreeShape(depth=1, top_k=2, total_tokens=2, lookup_depth=2)

    def tree(nodes: int) -> DraftTree:
        hybrid = HybridDrafter(FixedTree([7, 3]), PromptLookupDrafter(max_ngram=2, min_ngram=2), lookup_nodes=nodes)
        hybrid.start(context, None)
        return hybrid.propose_tree(shape, SamplingParams(), None), hybrid

    base, _ = tree(0)
    assert base.tokens.tolist() == [7, 3, 4] and base.parents.tolist() == [-1, -1, 1]
    more, hybrid = tree(3)  # 7 is the draft's own first token: only 8 and 9 are new nodes
    assert more.tokens.tolist() == [7, 3, 4, 8, 9] and more.parents.tolist() == [-1, -1, 1, 0, 0]
    assert more.depths.tolist() == [1, 1, 2, 2, 2] and hybrid.alternative_nodes == 2
    with pytest.raises(ConfigError, match="lookup_nodes"):
        HybridDrafter(FixedTree([1]), PromptLookupDrafter(), lookup_nodes=-1)

    draft = random_eagle(verifier)
    repeating = torch.tensor([3, 17, 42, 3, 17, 40, 3, 17, 42, 5, 3, 17, 41, 6, 3, 17])
    made = check_real_hybrid(verifier, lambda nodes=4, eagle=EagleDrafter: HybridDrafter(
        eagle(draft), PromptLookupDrafter(max_ngram=2, min_ngram=1), lookup_nodes=nodes), repeating,
        TreeShape(depth=2, top_k=2, total_tokens=3, lookup_depth=3))
    assert made.alternative_nodes > 0


def test_lookup_alone_leaves_the_draft_out_where_the_lookup_is_trusted(verifier):
    """``draft_cost``: a tree round proposes the lookup alone when (1 + L) draft_cost >= G, L the lookup's tokens
    accepted a round and G the draft's tokens beyond them, per match length (``lookup_alone``); the figures learn
    from the rounds; decoding stays exact, and the batched hybrid (whose draft reads the skipped rounds' tokens in
    one block when next asked) decides and proposes as the one-row reference does, a batch whose rows decide
    differently included."""
    from fledge.decode.drafters import EXPLORE_ROUNDS, MatchRecord
    from fledge.decode.loop import generate

    draft = random_eagle(verifier)
    context = torch.tensor([3, 17, 42, 99, 5, 3, 17, 42, 99, 5, 3, 17])  # "3 17" occurred before: a lookup match
    fresh = torch.tensor([3, 17, 42, 99, 5, 250, 8])  # "250 8" did not
    shape = TreeShape(depth=2, top_k=2, total_tokens=4, lookup_depth=4)

    def hybrid(cost, eagle=EagleDrafter):
        return HybridDrafter(eagle(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2), draft_cost=cost)

    # Before any round L = G = 1 (the priors): the draft is left out from draft_cost 0.5 on, never without a match.
    aux = verifier_aux(verifier, context.tolist())[:-1]
    for cost, alone in ((0.49, False), (0.5, True)):
        made = hybrid(cost, ReferenceEagle)
        made.start(context, aux)
        assert made.lookup_alone(shape) is alone
        tree = made.propose_tree(shape, SamplingParams(), None)
        assert (tree.tokens.tolist() == [42, 99, 5, 3]) is alone  # alone: the lookup's branch and nothing else
    made = hybrid(100.0, ReferenceEagle)
    made.start(fresh, verifier_aux(verifier, fresh.tolist())[:-1])
    assert not made.lookup_alone(shape)
    made = hybrid(0.3, ReferenceEagle)
    made.start(context, aux)
    assert not made.lookup_alone(shape)
    made.by_match[2] = MatchRecord(2, 8, 2, 0)  # two rounds at this match length: the lookup took 4 tokens each,
    assert made.lookup_alone(shape)  # the draft none more: (1 + 2.5) 0.3 >= 0.5
    made.by_match[2] = MatchRecord(2, 8, 2, 6)  # unless the draft added 3 tokens a round: G = 2 > 1.05
    assert not made.lookup_alone(shape)
    made.by_match[2] = MatchRecord(9, 36, 2, 0, EXPLORE_ROUNDS)  # and a round drafts after EXPLORE_ROUNDS without
    assert not made.lookup_alone(shape)

    plain = generate_plain(verifier, context, max_new_tokens=MAX_NEW).tokens
    one, batched = hybrid(0.3, ReferenceEagle), hybrid(0.3)
    expected = decode_one(verifier, context, one, method="tree", shape=shape, max_new_tokens=MAX_NEW,
                          aux_layer_ids=AUX_IDS)
    got = decode_one(verifier, context, batched, method="tree", shape=shape, max_new_tokens=MAX_NEW,
                     aux_layer_ids=AUX_IDS)
    assert expected.tokens == got.tokens == plain
    assert got.accepted == expected.accepted and got.tree_nodes == expected.tree_nodes
    assert 0 < batched.lookup_alone_rounds == one.lookup_alone_rounds < len(got.accepted)
    assert batched.by_match == one.by_match and sum(r.drafted for r in batched.by_match.values()) > 0
    # Two rows that decide differently round by round: the draft runs for one row and not the other.
    rows = [hybrid(0.3), hybrid(0.3)]
    decisions: list[list[bool]] = [[], []]
    for row, seen in zip(rows, decisions):
        decide = row.lookup_alone
        row.lookup_alone = lambda shape, decide=decide, seen=seen: seen.append(decide(shape)) or seen[-1]
    results, _ = generate(verifier, [context, fresh], rows, method="tree", shape=shape, max_new_tokens=MAX_NEW,
                          aux_layer_ids=AUX_IDS)
    assert results[0].tokens == plain
    assert results[1].tokens == generate_plain(verifier, fresh, max_new_tokens=MAX_NEW).tokens
    assert any(a != b for a, b in zip(*decisions))
