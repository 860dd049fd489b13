"""Token recycling (``decode/recycle.py``): the seed counted from answers, the table the verifier's top tokens
overwrite, the candidate tree read off it, and the loop handing every verified row's top tokens to the drafter."""

from __future__ import annotations

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.decode.drafters import HybridDrafter, PromptLookupDrafter, RandomDrafter
from fledge.decode.loop import decode_one
from fledge.decode.proposals import TreeShape
from fledge.decode.recycle import UNKNOWN, RecycleTable, bigram_successors
from fledge.models.sampling import SamplingParams

from test_spec_loop import AUX_IDS, VOCAB, random_eagle, verifier  # noqa: F401 (the fixture is used by name)


def test_the_seed_ranks_successors_by_count_then_by_id():
    # After 1: 2 three times, 3 twice, 5 twice (5 after 3 by id), 4 once; after 2: 1 once; 9 is never first.
    answers = [[1, 2, 1, 3, 1, 5], [1, 2, 1, 3], [1, 5, 1, 2, 1, 4], [7]]
    seed = bigram_successors(answers, vocab_size=10, k=3)
    assert seed.shape == (10, 3)
    assert seed[1].tolist() == [2, 3, 5]
    assert seed[2].tolist() == [1, UNKNOWN, UNKNOWN]
    assert seed[9].tolist() == [UNKNOWN] * 3
    assert bigram_successors([], 10, 2).eq(UNKNOWN).all()
    with pytest.raises(ConfigError, match="outside the verifier's vocabulary"):
        bigram_successors([[1, 10]], vocab_size=10, k=2)


def test_the_table_keeps_the_last_verified_successors_and_reads_a_tree_off_them():
    seed = bigram_successors([[1, 2, 3, 4], [2, 5]], vocab_size=8, k=2)  # 1 -> 2; 2 -> 3, 5; 3 -> 4
    table = RecycleTable(seed, widths=[2, 1])
    paths = lambda root: [path for _, path in table.paths(root)]  # noqa: E731
    assert table.paths(2) == [((0, 0), [3, 4]), ((1,), [5])]  # with each token's rank among its siblings
    assert paths(1) == [[2, 3]]  # one recorded successor of 1, then the first of 2's
    assert paths(2) == [[3, 4], [5]]  # 5 has none recorded: its path ends there
    assert paths(6) == []
    # A verified block: root 1, nodes 6 and 1 again; the second row of token 1 wins.
    table.observe(torch.tensor([1, 6, 1]), torch.tensor([[7, 6], [2, 2], [6, 7]]))
    assert table.table[1].tolist() == [6, 7] and table.table[6].tolist() == [2, 2]
    assert table.recorded == 2
    assert paths(1) == [[6, 2], [7]]
    assert paths(6) == [[2, 3]]  # a repeated successor is one sibling
    again = table.fresh()
    assert again.table[1].tolist() == seed[1].tolist() and again.recorded == 0  # a new sequence: the seed
    with pytest.raises(ConfigError, match="widths"):
        RecycleTable(seed, widths=[2, 0])
    with pytest.raises(ConfigError, match="k >= 3"):
        RecycleTable(seed, widths=[3])


def test_the_loop_records_the_verifiers_top_tokens_at_every_checked_row(verifier):
    """After a round whose tree is empty (a one-token budget) the root's row was still checked: the table then
    holds the verifier's own top tokens after the prompt."""
    prompt = torch.tensor([5, 17, 42, 99, 3])
    table = RecycleTable(bigram_successors([], VOCAB, 4), widths=[4])
    hybrid = HybridDrafter(RandomDrafter(VOCAB), PromptLookupDrafter(), recycle=table)
    with torch.inference_mode():
        expected = torch.topk(verifier(prompt.view(1, -1)).logits[0, -1], 4).indices
    decode_one(verifier, prompt, hybrid, method="tree", shape=TreeShape(depth=2, top_k=2, total_tokens=2),
               max_new_tokens=1, aux_layer_ids=AUX_IDS)
    assert table.table[3].tolist() == expected.tolist()
    assert table.recorded == 1


def test_recycled_branches_join_the_hybrids_tree_and_stay_exact(verifier):
    """With ``recycle`` the hybrid's trees carry the table's paths (sharing the nodes the draft has already), the
    batched hybrid builds the one-row tree, and greedy output is plain greedy's."""
    from test_hybrid_tree import check_real_hybrid

    draft = random_eagle(verifier)
    context = torch.tensor([3, 17, 42, 99, 5, 250, 8])
    # A seed where every token is followed by the next three ids: always three more branches from the root.
    seed = torch.stack([torch.arange(1, 4) + t for t in range(VOCAB)]) % VOCAB
    shape = TreeShape(depth=2, top_k=2, total_tokens=3, lookup_depth=3)

    def make(widths=(3, 1), eagle=None):
        from fledge.decode.drafters import EagleDrafter
        recycle = RecycleTable(seed, widths) if widths else None
        return HybridDrafter((eagle or EagleDrafter)(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2),
                             recycle=recycle)

    made = check_real_hybrid(verifier, make, context, shape)
    assert made.recycled_nodes > 0 and made.recycle.recorded > 0


def test_the_budget_keeps_the_nodes_of_the_highest_estimated_path_probability():
    from fledge.decode.merge import AcceptanceModel, keep_best, settle
    from fledge.decode.proposals import DraftTree

    # root -> a(0) -> b(1); root -> c(2) -> d(3); root -> e(4)
    tree = DraftTree(tokens=torch.tensor([10, 11, 12, 13, 14]), parents=torch.tensor([-1, 0, -1, 2, -1]),
                     depths=torch.tensor([1, 2, 1, 2, 1]), q=None, q_rows=[-1] * 6, draft_to_target=None)
    keys = [[("draft", 7)], [("draft", 1)], [("lookup", 1, 3)], [("lookup", 2, 3)], [("recycle", 1, 1)]]
    model = AcceptanceModel()
    assert model.estimate(("draft", 7)) == pytest.approx(0.9375)  # its bin's centre, before any round
    assert model.estimate(("recycle", 1, 1)) == pytest.approx(0.1)  # a recycled successor past the first: half
    # path values: a .94, b .94 * .19, c .5, d .25, e .1 -> the best three: a, c, d
    pruned, kept_keys = keep_best(tree, keys, model, budget=3)
    assert pruned.tokens.tolist() == [10, 12, 13] and pruned.parents.tolist() == [-1, -1, 1]
    assert pruned.depths.tolist() == [1, 1, 2] and kept_keys == [keys[0], keys[2], keys[3]]
    same, _ = keep_best(tree, keys, model, budget=5)
    assert same is tree  # nothing to leave out

    # The verifier took c then d, then its own token: a and c offered at depth 1, d (c's child) at depth 2.
    settle(model, pruned, kept_keys, [12, 13, 99])
    assert model.offered == {("draft", 7): 1, ("lookup", 1, 3): 1, ("lookup", 2, 3): 1}
    assert model.accepted == {("lookup", 1, 3): 1, ("lookup", 2, 3): 1}
    assert model.estimate(("lookup", 1, 3)) == pytest.approx((1 + 2 * 0.5) / 3)
    assert model.estimate(("draft", 7)) == pytest.approx(2 * 0.9375 / 3)
    # A node several sources proposed takes the best estimate: e as a lookup node too now outranks d.
    keys[4].append(("lookup", 1, 3))
    pruned, _ = keep_best(tree, keys, model, budget=3)
    assert pruned.tokens.tolist() == [10, 12, 14]


def test_a_round_checks_the_nodes_that_pay_for_themselves():
    """``worth_checking``: the count of best nodes that maximises (1 + their summed path values) / (1 + cost * count),
    by hand and against every count; ``keep_best`` keeps that many, within the budget."""
    from fledge.decode.merge import AcceptanceModel, keep_best, worth_checking
    from fledge.decode.proposals import DraftTree

    # 1 -> 1.9/1.1 = 1.73 -> 2.4/1.2 = 2.0 -> 2.45/1.3 = 1.88: two nodes
    assert worth_checking([0.9, 0.5, 0.05, 0.01], 0.1) == 2
    assert worth_checking([0.9, 0.5, 0.05, 0.01], 0.01) == 3  # the last: 2.46 / 1.04 < 2.45 / 1.03
    assert worth_checking([0.9, 0.5, 0.05, 0.01], 0.001) == 4
    assert worth_checking([0.05], 0.1) == 0 and worth_checking([], 0.1) == 0
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        values = torch.rand(int(torch.randint(1, 12, (1,), generator=g)), generator=g).sort(descending=True)
        values = values.values.tolist()
        cost = float(torch.rand(1, generator=g)) * 0.3
        rates = [(1 + sum(values[:n])) / (1 + cost * n) for n in range(len(values) + 1)]
        assert worth_checking(values, cost) == max(range(len(rates)), key=lambda n: (rates[n], -n))

    # root -> a(0) -> b(1); root -> c(2) -> d(3); root -> e(4); path values a .94, b .18, c .5, d .25, e .1
    tree = DraftTree(tokens=torch.tensor([10, 11, 12, 13, 14]), parents=torch.tensor([-1, 0, -1, 2, -1]),
                     depths=torch.tensor([1, 2, 1, 2, 1]), q=None, q_rows=[-1] * 6, draft_to_target=None)
    keys = [[("draft", 7)], [("draft", 1)], [("lookup", 1, 3)], [("lookup", 2, 3)], [("recycle", 1, 1)]]
    model = AcceptanceModel()
    # a and c pay at a cost of 0.2 a node; d's .25 would add less than the 0.2 x 2.44 tokens a node costs
    pruned, kept = keep_best(tree, keys, model, budget=5, node_cost=0.2)
    assert pruned.tokens.tolist() == [10, 12] and pruned.parents.tolist() == [-1, -1] and kept == [keys[0], keys[2]]
    assert keep_best(tree, keys, model, budget=1, node_cost=0.01)[0].tokens.tolist() == [10]  # the budget still caps
    same, _ = keep_best(tree, keys, model, budget=5, node_cost=0.001)
    assert same is tree  # every node pays


def test_the_node_price_is_the_slope_of_the_measured_verify_cost():
    """``hybrid_node_cost=auto``: a least-squares line through v(k); a number is taken as it is; refused without a
    budget to price or when it is neither a number nor auto."""
    from fledge.eval.roster import DrafterSettings

    auto = DrafterSettings(hybrid_node_cost="auto", hybrid_budget=16)
    assert auto.measures_node_cost
    assert auto.node_cost({1: 1.0, 9: 1.24, 17: 1.48}) == pytest.approx(0.03)
    assert auto.node_cost({1: 1.0, 5: 1.2, 9: 1.2, 13: 1.2, 17: 1.4}) == pytest.approx(0.02)  # not the end points'
    assert auto.node_cost({1: 1.0, 17: 1.0}) == 0.0
    assert DrafterSettings(hybrid_node_cost=0.05, hybrid_budget=4).node_cost() == 0.05
    assert DrafterSettings().node_cost() == 0.0
    with pytest.raises(ConfigError, match="hybrid_budget"):
        DrafterSettings(hybrid_node_cost=0.05).node_cost()  # nothing to price: it would do nothing
    with pytest.raises(ValueError, match="two lengths"):
        auto.node_cost({1: 1.0})
    with pytest.raises(ConfigError, match="hybrid_budget"):
        DrafterSettings(hybrid_node_cost="auto").node_cost({1: 1.0, 2: 1.1})
    for bad in ("cheap", -0.01):
        with pytest.raises(ConfigError, match="a number >= 0 or auto"):
            DrafterSettings(hybrid_node_cost=bad, hybrid_budget=4).check_node_cost()


def test_a_budgeted_hybrid_stays_within_its_budget_equal_batched_and_exact(verifier):
    """``hybrid_budget``: the draft's tree, the lookup branch and recycled successors cut to the budget; the batched
    hybrid builds the one-row tree, greedy output is plain greedy's, and the estimates learn from the rounds."""
    from fledge.decode.batch_draft import batch_drafter
    from fledge.decode.drafters import EagleDrafter
    from fledge.decode.loop import decode_one
    from fledge.decode.proposals import TreeShape

    from test_spec_loop import verifier_aux
    from reference_decode import ReferenceEagle, generate_plain

    draft = random_eagle(verifier)
    context = torch.tensor([3, 17, 42, 99, 5, 3, 17, 42, 99, 5, 3, 17])
    seed = torch.stack([torch.arange(1, 4) + t for t in range(VOCAB)]) % VOCAB
    shape = TreeShape(depth=2, top_k=3, total_tokens=6, lookup_depth=4)

    def make(budget, eagle=EagleDrafter):
        return HybridDrafter(eagle(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2),
                             recycle=RecycleTable(seed, (3, 1)), budget=budget)

    aux = verifier_aux(verifier, context.tolist())[:-1]
    full, cut = make(0, ReferenceEagle), make(5, ReferenceEagle)
    full.start(context, aux)
    cut.start(context, aux)
    everything = full.propose_tree(shape, SamplingParams(), None)
    expected = cut.propose_tree(shape, SamplingParams(), None)
    assert everything.size > 5 and expected.size == 5 and cut.pruned_nodes == everything.size - 5
    assert set(zip(expected.tokens.tolist(), expected.depths.tolist())) <= set(
        zip(everything.tokens.tolist(), everything.depths.tolist()))
    assert all(p < i for i, p in enumerate(expected.parents.tolist()))  # still a tree, parents first
    batched = batch_drafter([make(5), make(5)])
    batched.start([context, context], [aux, aux])
    for got in batched.propose_trees([shape, shape], SamplingParams(), None):
        assert got.tokens.tolist() == expected.tokens.tolist() and got.parents.tolist() == expected.parents.tolist()
    made = make(5)
    result = decode_one(verifier, context, made, method="tree", shape=shape, max_new_tokens=24,
                        aux_layer_ids=AUX_IDS)
    assert result.tokens == generate_plain(verifier, context, max_new_tokens=24).tokens
    assert max(result.tree_nodes) <= 5 and made.pruned_nodes > 0
    assert sum(made.acceptance.offered.values()) > 0  # the rounds were counted
    with pytest.raises(ConfigError, match="budget"):
        make(-1)

    # With a price on each checked node the rounds check fewer, and the output is still plain greedy's.
    priced = HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2),
                           recycle=RecycleTable(seed, (3, 1)), budget=5, node_cost=0.3)
    cheap = decode_one(verifier, context, priced, method="tree", shape=shape, max_new_tokens=24,
                       aux_layer_ids=AUX_IDS)
    assert cheap.tokens == result.tokens
    assert sum(cheap.tree_nodes) / len(cheap.tree_nodes) < sum(result.tree_nodes) / len(result.tree_nodes)
    # Priced out of every node, each round checks the root alone: plain decoding, one token a round.
    dear = HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(max_ngram=2, min_ngram=2), budget=5, node_cost=50.0)
    alone = decode_one(verifier, context, dear, method="tree", shape=shape, max_new_tokens=24, aux_layer_ids=AUX_IDS)
    assert alone.tokens == result.tokens and set(alone.tree_nodes) == {0} and set(alone.accepted) == {0}
    assert priced.fresh().node_cost == 0.3
    with pytest.raises(ConfigError, match="node_cost"):
        HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(), budget=5, node_cost=-0.1)
    with pytest.raises(ConfigError, match="prices the nodes of the budget"):
        HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(), node_cost=0.1)


def test_eval_with_recycled_successors_seeded_from_the_verifiers_answers(tiny_verifier_dir, tmp_path):
    """``fledge eval hybrid_recycle=... hybrid_recycle_seed=<file>``: seeded from the verifier's own answers to these
    prompts, the hybrid's trees carry its next tokens and accept more than without them; with a budget the trees stay
    within it; every row stays exact."""
    from fledge.launch.cli import run_stage

    from conftest import own_answers_eval

    seed_file, common = own_answers_eval(tmp_path, tiny_verifier_dir)
    common += ["draft_alone=false", "prompt_lookup=false"]

    def hybrid(*extra: str, name: str) -> dict:
        report = run_stage("eval", [*common, *extra, f"eval.out_dir={tmp_path / name}"])
        return report["sets"]["prompts"]["drafters"]["eagle3+lookup"]

    base = hybrid(name="base")
    recycled = hybrid("hybrid_recycle=[2,1]", f"hybrid_recycle_seed={seed_file}", name="recycled")
    budgeted = hybrid("hybrid_recycle=[2,1]", f"hybrid_recycle_seed={seed_file}", "hybrid_budget=3", name="budget")
    assert all(d["greedy_match_rate"] == 1.0 for d in (base, recycled, budgeted))
    assert recycled["tau"] > base["tau"] and recycled["mean_tree_nodes"] > base["mean_tree_nodes"]
    assert budgeted["mean_tree_nodes"] <= 3
    with pytest.raises(ConfigError, match="widths"):
        run_stage("eval", [*common, "hybrid_recycle=[2,0]", f"eval.out_dir={tmp_path / 'bad'}"])
    # hybrid_node_cost=auto: the price measured on this machine, recorded in the report; still exact
    report = run_stage("eval", [*common, "hybrid_recycle=[2,1]", f"hybrid_recycle_seed={seed_file}",
                                "hybrid_budget=3", "hybrid_node_cost=auto", f"eval.out_dir={tmp_path / 'auto'}"])
    priced = report["sets"]["prompts"]["drafters"]["eagle3+lookup"]
    assert priced["greedy_match_rate"] == 1.0 and priced["mean_tree_nodes"] <= 3
    assert report["draft"]["hybrid_node_cost"] >= 0.0
    for bad, message in (("hybrid_node_cost=auto", "hybrid_budget"), ("hybrid_node_cost=cheap", "a number")):
        with pytest.raises(ConfigError, match=message):
            run_stage("eval", [*common, bad, f"eval.out_dir={tmp_path / 'bad'}"])
