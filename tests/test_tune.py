"""The tuner: its model against hand-computed values, and ``fledge tune`` end to end on a tiny verifier."""

from __future__ import annotations

import json

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.decode.proposals import TreeShape
from fledge.eval.report import TuneReport
from fledge.eval.tune import (
    PLAIN,
    CostModel,
    Position,
    candidates,
    chain_candidate,
    draft_path_accepted,
    expected_tokens,
    hybrid_chain_candidate,
    hybrid_tree_candidate,
    measure_verify_cost,
    measured_positions,
    overhead_from_run,
    recommend,
    relative_costs,
    tree_candidate,
    tree_expected_tokens,
    tree_width,
)

from conftest import write_random_draft_run

# α_1 = 0.5, α_2 = 0.4, depth 3 never reached.
N_ALPHA = [0.5, 0.4, None]
CPU_LIKE = CostModel(verify_steps={1: 1.0, 2: 1.2, 3: 1.5, 4: 1.9}, draft_step=0.1, round_overhead=0.2)
GPU_LIKE = CostModel(verify_steps={1: 1.0, 8: 1.0}, draft_step=0.0)


def test_expected_tokens_by_hand():
    assert expected_tokens(N_ALPHA, 0) == 1.0
    assert expected_tokens(N_ALPHA, 1) == pytest.approx(1.5)
    assert expected_tokens(N_ALPHA, 2) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    # An unmeasured depth (None, or past the measured chain) adds nothing.
    assert expected_tokens(N_ALPHA, 3) == pytest.approx(1.7)
    assert expected_tokens(N_ALPHA, 6) == pytest.approx(1.7)
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0


def test_verify_cost_interpolates_and_extrapolates():
    cost = CostModel(verify_steps={1: 1.0, 3: 1.4, 5: 2.0}, draft_step=0.0)
    assert cost.verify(3) == 1.4
    assert cost.verify(2) == pytest.approx(1.2)
    assert cost.verify(4) == pytest.approx(1.7)
    assert cost.verify(7) == pytest.approx(2.6)  # the last segment's slope, 0.3 per token
    assert GPU_LIKE.verify(5) == 1.0


def test_chain_and_tree_speedup_by_hand():
    one = chain_candidate(N_ALPHA, 1, CPU_LIKE)
    assert one.round_cost == pytest.approx(1.2 + 0.2 + 0.1)  # v(2) + o + 1·c
    assert one.predicted_speedup == pytest.approx(1.0)
    two = chain_candidate(N_ALPHA, 2, CPU_LIKE)
    assert two.round_cost == pytest.approx(1.5 + 0.2 + 0.2)
    assert two.predicted_speedup == pytest.approx(1.7 / 1.9)
    tree = tree_candidate(N_ALPHA, TreeShape(depth=2, top_k=2, total_tokens=4), CPU_LIKE, tree_draft_step=0.3)
    # v(5) extrapolated from v(3)=1.5, v(4)=1.9 is 2.3; the tree's acceptance is the chain's E(2).
    assert tree.round_cost == pytest.approx(2.3 + 0.2 + 2 * 0.3)
    assert tree.expected_tokens == pytest.approx(1.7)
    assert tree.name == "tree d=2 k=2 T=4"


def test_recommend_no_speculation_when_nothing_beats_plain():
    options = candidates(N_ALPHA, CPU_LIKE, max_draft=3)
    assert [o.name for o in options] == ["plain", "chain N=1", "chain N=2", "chain N=3"]
    # chain N=1 ties plain at exactly 1.0x: the simpler one wins the draw.
    assert recommend(options) is PLAIN


def test_recommend_argmax_when_verification_is_flat():
    trees = [(TreeShape(depth=2, top_k=2, total_tokens=4), 0.0), (TreeShape(depth=3, top_k=2, total_tokens=6), 0.0)]
    options = candidates(N_ALPHA, GPU_LIKE, max_draft=3, trees=trees)
    speedups = {o.name: o.predicted_speedup for o in options}
    assert speedups["chain N=1"] == pytest.approx(1.5)
    assert speedups["chain N=2"] == pytest.approx(1.7)
    # N=3, and both trees, predict 1.7 too; the first (shortest chain) of the tied best is kept.
    assert recommend(options).name == "chain N=2"
    with pytest.raises(ValueError):
        recommend([])


def test_overhead_is_what_the_loop_pays_beyond_the_forward():
    assert overhead_from_run(2.0, 2, CPU_LIKE) == pytest.approx(0.5)  # 2.0 - v(3)
    assert overhead_from_run(1.0, 2, CPU_LIKE) == 0.0


def test_measure_verify_cost_on_a_tiny_verifier(tiny_verifier_dir):
    from fledge.models.verifier import VerifierConfig, load_verifier

    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    v = measure_verify_cost(verifier.model, torch.arange(3, 20), [2, 5, 12], verifier.aux_layer_ids, repeats=1)
    assert sorted(v) == [1, 2, 5, 12] and v[1] == 1.0


def test_relative_costs_divide_by_one_token_and_never_fall():
    # A k=2 forward measured faster than k=1 (noise the minimum kept) counts as 1.0, and so on up.
    seconds = {1: 2.0, 2: 1.9, 5: 3.0, 12: 2.5, 20: 8.0}
    assert relative_costs(seconds) == {1: 1.0, 2: 1.0, 5: 1.5, 12: 1.5, 20: 4.0}
    assert relative_costs({1: 0.5, 3: 1.0}) == {1: 1.0, 3: 2.0}


def test_tune_command_end_to_end(tiny_verifier_dir, tmp_path, capsys):
    from fledge.launch.cli import compose_config, run_stage

    write_random_draft_run(tmp_path / "run", tiny_verifier_dir, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"the a of {i} to and"]}) + "\n" for i in range(2)))
    overrides = [
        f"draft={tmp_path / 'run'}", f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32",
        f"prompts=[{prompts}]", "max_prompts=1", "max_new_tokens=5", "n_max=3", "verify_repeats=1",
        "warmup_tokens=0", "tree_shapes=[{depth: 2, top_k: 2, total_tokens: 3}]", f"out_dir={tmp_path / 'tune'}",
    ]
    with pytest.raises(Exception, match="n_maxx"):
        compose_config("tune", ["n_maxx=3"])
    result = run_stage("tune", overrides)

    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert saved["format"] == 1 and saved["recommended"] == result["recommended"]
    assert TuneReport.load(tmp_path / "tune").to_json() == saved  # read back through its type, unchanged
    (tmp_path / "later.json").write_text(json.dumps({**saved, "format": 2}))
    with pytest.raises(ConfigError, match="up to 1"):
        TuneReport.load(tmp_path / "later.json")
    names = [c["name"] for c in saved["candidates"]]
    assert names == ["plain", "chain N=1", "chain N=2", "chain N=3", "tree d=2 k=2 T=3", "hybrid chain N=1",
                     "hybrid chain N=2", "hybrid chain N=3", "hybrid tree d=2 k=2 T=3"]
    best = max(c["predicted_speedup"] for c in saved["candidates"])
    assert saved["recommended"]["predicted_speedup"] == best
    assert len(saved["measurement"]["n_alpha"]) == 3
    assert set(saved["cost_model"]["verify_steps"]) == {"1", "2", "3", "4"}
    # Round cost = v(N+1) + N·c from the measurements; o is only recorded unless fit_round_overhead is set.
    m, cm = saved["measurement"], saved["cost_model"]
    chain3 = next(c for c in saved["candidates"] if c["name"] == "chain N=3")
    assert cm["round_overhead"] == 0.0 and cm["draft_step"] == m["cost_ratio"]
    assert chain3["round_cost"] == pytest.approx(cm["verify_steps"]["4"] + 3 * cm["draft_step"])
    assert cm["measured_round_residual"] == pytest.approx(max(0.0, m["verify_cost_in_steps"] - cm["verify_steps"]["4"]))
    # Something speculative was measured (the recommendation, or the best shape when plain won), losslessly.
    check = saved["verification"]
    assert check is not None and check["measured_speedup"] > 0 and check["greedy_match_rate"] == 1.0
    assert check["shape"] != "plain"
    out = capsys.readouterr().out
    assert "[tune] recommended:" in out and "predicted" in out and "measured" in out
    # The trees' acceptance comes from the same run's per-depth top-k ranks; top-1 is the chain's n-α.
    topk = m["topk_acceptance"]
    assert len(topk) == 3 and "top-1 acceptance per depth" in out
    for row, alpha in zip(topk, m["n_alpha"]):
        assert (row is None) == (alpha is None)
        if row is not None:
            assert row[0] == pytest.approx(alpha) and row == sorted(row)
    tree = next(c for c in saved["candidates"] if c["name"] == "tree d=2 k=2 T=3")
    assert tree["expected_tokens"] == pytest.approx(tree_expected_tokens(topk, TreeShape(2, 2, 3)))


def test_tree_acceptance_from_per_depth_top_k():
    # β_d(w): depth 1 accepts 0.5 at width 1 and 0.8 at width 2; depth 2 0.4 / 0.6; depth 3 never reached.
    topk = [[0.5, 0.8], [0.4, 0.6], None]
    assert tree_width(TreeShape(depth=2, top_k=2, total_tokens=4)) == 2
    assert tree_width(TreeShape(depth=4, top_k=8, total_tokens=8)) == 2  # T/d nodes per level bound the width
    assert tree_width(TreeShape(depth=6, top_k=1, total_tokens=6)) == 1
    wide = TreeShape(depth=2, top_k=2, total_tokens=4)
    assert tree_expected_tokens(topk, wide) == pytest.approx(1 + 0.8 + 0.8 * 0.6)
    # Width 1 is the greedy chain: the same E as n-α gives.
    assert tree_expected_tokens(topk, TreeShape(depth=3, top_k=1, total_tokens=3)) == pytest.approx(
        expected_tokens([0.5, 0.4, None], 3))
    # Wider than measured: the widest measured column.
    assert tree_expected_tokens(topk, TreeShape(depth=1, top_k=8, total_tokens=8)) == pytest.approx(1.8)
    with_topk = tree_candidate(N_ALPHA, wide, CPU_LIKE, tree_draft_step=0.3, topk=topk)
    assert with_topk.expected_tokens == pytest.approx(2.28) and with_topk.round_cost == pytest.approx(2.3 + 0.2 + 0.6)


def test_the_hybrids_model_decodes_the_output_again_by_hand():
    # The chain run: round 0 at position 0 reached depths 1-2 (accepted 1), round 1 at 2 reached depth 1 (rank 2:
    # rejected), round 2 at 3 proposed nothing. The lookup's proposal at each of the 5 output positions.
    positions = measured_positions([0, 1, 2], accepted=[1, 0, 0], proposed=[3, 3, 0],
                                   lookups=[[5, 6, 9], [], [9], [1], []], continuation=[5, 6, 7, 1, 8])
    assert positions == [Position((0, 1), (5, 6, 9), 2), Position((0, 1), (), 0), Position((2,), (9,), 0),
                         Position((), (1,), 1), Position((), (), 0)]  # position 1 and 4: the last round's ranks
    # The draft's path: depth by depth while the verifier's token is among the width best, deeper only after rank 0.
    assert [draft_path_accepted(r, 2, 1) for r in [(0, 1), (2,), ()]] == [1, 0, 0]
    assert [draft_path_accepted(r, 2, 2) for r in [(0, 1), (2,), ()]] == [2, 0, 0]
    assert draft_path_accepted((0, 1), 1, 4) == 1 and draft_path_accepted((1, 0), 2, 4) == 1
    cost = CostModel(verify_steps={1: 1.0, 4: 1.3, 6: 1.5}, draft_step=0.1)
    # Tree d=1, top 2, T=2, branch 3: at 0 the lookup's 2 beat the draft's 1 (3 tokens, v(2+3+1)); at 3 the lookup's
    # 1 (2 tokens, v(2+1+1)); 5 tokens in 2 rounds.
    tree = hybrid_tree_candidate([positions], TreeShape(1, 2, 2), 3, cost, tree_draft_step=0.05)
    assert tree.expected_tokens == pytest.approx(5 / 2) and tree.hybrid and tree.branch == 3
    assert tree.round_cost == pytest.approx((1.5 + 1.3) / 2 + 0.05)
    # Chain N=2: the lookup where it proposes (cut to 2), at cost v(k + 1): rounds at 0 (2 + 1) and 3 (1 + 1).
    chain = hybrid_chain_candidate([positions], 2, cost)
    assert chain.expected_tokens == pytest.approx(5 / 2)
    assert chain.round_cost == pytest.approx((cost.verify(3) + cost.verify(2)) / 2)
    # Where the lookup has nothing, the draft's chain: accepted while its ranks are 0, at v(N + 1) + N·c.
    drafted = hybrid_chain_candidate([[Position((0, 0), (), 0), Position((0,), (), 0), Position((1,), (), 0)]], 2,
                                     cost)
    assert drafted.expected_tokens == 3.0 and drafted.round_cost == pytest.approx(cost.verify(3) + 0.2)


def test_hybrid_positions_replay_the_lookup_over_the_output():
    from fledge.decode.drafters import PromptLookupDrafter
    from fledge.eval.tune_job import hybrid_positions

    # Prompt "1 2 3 1"; the chain run wrote 2 3 | 4 | 1 2 in three rounds.
    record = {"tokens": [2, 3, 4, 1, 2], "accepted": [1, 0, 1], "proposed": [2, 2, 2], "ranks": [0, 1, 3, 0, 0]}
    [positions] = hybrid_positions([record], [torch.tensor([1, 2, 3, 1])],
                                   PromptLookupDrafter(max_ngram=2, min_ngram=1), 3)
    # At each position, the lookup's continuation of prompt + output so far (the latest earlier occurrence).
    assert [p.lookup for p in positions] == [(2, 3, 1), (3, 1, 2), (1, 2, 3), (), (2, 3, 4)]
    assert [p.lookup_accepted for p in positions] == [2, 1, 0, 0, 1]
    assert [p.ranks for p in positions] == [(0, 1), (0, 1), (3,), (0, 0), (0, 0)]


def test_tune_measures_a_hybrid_recommendation(tiny_verifier_dir, tmp_path, monkeypatch):
    """When a hybrid shape is recommended, the check runs the hybrid (``eagle3+lookup``) with that tree and its
    lookup branch, losslessly, built with fledge eval's drafter keys (the same names, the same roster)."""
    from fledge.eval import tune_job
    from fledge.launch.cli import run_stage

    write_random_draft_run(tmp_path / "run", tiny_verifier_dir, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 0, "turns": ["a b c a b c a b c a b"]}) + "\n")
    monkeypatch.setattr(tune_job, "recommend", lambda options: next(o for o in options if o.hybrid and o.tree))
    evaluated, evaluate = [], tune_job.evaluate
    monkeypatch.setattr(tune_job, "evaluate", lambda *a: evaluated.append(a[2]) or evaluate(*a))
    result = run_stage("tune", [
        f"draft={tmp_path / 'run'}", f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32",
        f"prompts=[{prompts}]", "max_prompts=1", "max_new_tokens=8", "n_max=2", "verify_repeats=1",
        "warmup_tokens=0", "tree_shapes=[{depth: 1, top_k: 2, total_tokens: 2}]", "num_draft_tokens=4",
        f"out_dir={tmp_path / 'tune'}", "hybrid_extend=1", "hybrid_lookup_nodes=2", "hybrid_draft_tokens=1",
        "draft_min_prob=0.05",
    ])
    measured, checked = evaluated
    assert measured["eagle3"].min_prob == 0.0  # the measurement drafts full chains
    hybrid = checked["eagle3+lookup"]
    assert (hybrid.extend, hybrid.lookup_nodes, hybrid.draft_tokens, hybrid.eagle.min_prob) == (1, 2, 1, 0.05)
    assert result["recommended"]["name"] == "hybrid tree d=1 k=2 T=2" and result["recommended"]["branch"] == 4
    check = result["verification"]
    assert check["shape"] == "hybrid tree d=1 k=2 T=2" and check["greedy_match_rate"] == 1.0
    report = json.loads((tmp_path / "tune" / "check" / "report.json").read_text())
    assert set(report["sets"]["tune"]["drafters"]) == {"eagle3+lookup"}
    assert report["config"]["num_draft_tokens"] == 4 and report["config"]["tree_top_k"] == 2
    assert "topk_rounds" not in result["measurement"]


def test_tune_refuses_a_node_price_before_any_work(tmp_path):
    """A ``hybrid_node_cost`` that is not a number >= 0 or auto, or one with no budget to price, is refused before
    the verifier or the draft is read (the draft here does not exist)."""
    from fledge.launch.cli import run_stage

    refusals = (("hybrid_node_cost=cheap", "a number >= 0 or auto"), ("hybrid_node_cost=0.05", "hybrid_budget"))
    for bad, message in refusals:
        with pytest.raises(ConfigError, match=message):
            run_stage("tune", [f"draft={tmp_path / 'nothing'}", bad, f"out_dir={tmp_path / 'out'}"])
