"""Acceptance metrics against a hand-made trace whose answers were worked out by hand."""

import math

import pytest

from fledge.eval.metrics import (
    AcceptanceTrace,
    acceptance_histogram,
    acceptance_rate,
    bootstrap_interval,
    cumulative_acceptance,
    expected_tokens_per_call,
    median,
    n_alpha,
    paired_throughput_ratio,
    predicted_speedup,
    summarize,
    tau_by_length,
)

# N = 3; six verifier calls accepting 0, 1, 3, 2, 3, 0 drafts.
TRACE = AcceptanceTrace(accepted=[0, 1, 3, 2, 3, 0], num_draft=3)


def test_tau_is_mean_accepted_plus_one():
    # (1 + 2 + 4 + 3 + 4 + 1) / 6
    assert summarize(TRACE)["tau"] == pytest.approx(15 / 6)


def test_n_alpha_is_conditional_acceptance_per_depth():
    # depth 1: 4 of 6 calls accepted it; depth 2: 3 of the 4 that got there; depth 3: 2 of the 3.
    assert n_alpha(TRACE) == pytest.approx([4 / 6, 3 / 4, 2 / 3])


def test_histogram_and_cumulative():
    assert acceptance_histogram(TRACE) == [2, 1, 1, 2]
    assert cumulative_acceptance(TRACE) == pytest.approx([4 / 6, 3 / 6, 2 / 6])


def test_tau_by_length_cuts_the_trace():
    # n=0: every call yields 1; n=1: min(a,1)+1 = 1,2,2,2,2,1; n=2: 1,2,3,3,3,1; n=3: tau.
    assert tau_by_length(TRACE) == pytest.approx([1.0, 10 / 6, 13 / 6, 15 / 6])


def test_pooled_alpha_counts_decided_drafts():
    # 9 accepted drafts; 4 calls rejected one (those with a < 3): 9 / 13.
    assert acceptance_rate(TRACE) == pytest.approx(9 / 13)


def test_variable_proposal_lengths():
    # Prompt lookup: the second call offered only 1 draft and accepted it; it is no trial at depth 2.
    trace = AcceptanceTrace(accepted=[2, 1, 0], num_draft=3, proposed=[3, 1, 3])
    assert n_alpha(trace) == pytest.approx([2 / 3, 1 / 1, 0 / 1])
    # 3 accepted; rejections in calls 1 (2<3) and 3 (0<3); call 2 accepted all it was offered.
    assert acceptance_rate(trace) == pytest.approx(3 / 5)


def test_expected_tokens_and_predicted_speedup():
    # alpha 0.5, N 3: (1 - 0.5^4) / 0.5 = 1.875; with c = 0.1: 1.875 / 1.3.
    assert expected_tokens_per_call(0.5, 3) == pytest.approx(1.875)
    assert predicted_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert expected_tokens_per_call(1.0, 4) == 5.0
    assert expected_tokens_per_call(0.0, 4) == 1.0


def test_summary_and_validation():
    summary = summarize(TRACE)
    assert summary["tau"] == pytest.approx(2.5)
    assert summary["expected_tokens_per_call"] == pytest.approx(expected_tokens_per_call(9 / 13, 3))
    assert not math.isnan(summary["alpha"])
    with pytest.raises(ValueError):
        AcceptanceTrace(accepted=[4], num_draft=3)
    with pytest.raises(ValueError):
        AcceptanceTrace(accepted=[1, 1], num_draft=3, proposed=[1])


def test_bootstrap_interval_over_prompts():
    from fledge.eval.metrics import bootstrap_interval, median, pooled_tau

    values = [0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 0.95]
    lo, hi = bootstrap_interval(values, median)
    assert min(values) <= lo <= median(values) <= hi <= max(values)
    assert bootstrap_interval(values, median) == (lo, hi)  # seeded: the same interval every time
    assert bootstrap_interval([2.0], median) == (2.0, 2.0)
    assert all(x != x for x in bootstrap_interval([], median))  # nan for no prompts
    # Identical prompts leave no uncertainty.
    assert bootstrap_interval([1.5] * 10, median) == (1.5, 1.5)
    # τ pools rounds: (committed tokens, verifier calls) per prompt.
    assert pooled_tau([(30, 20), (10, 10)]) == 40 / 30
    lo, hi = bootstrap_interval([(30, 20), (10, 10), (50, 25)], pooled_tau)
    assert 1.0 <= lo <= pooled_tau([(30, 20), (10, 10), (50, 25)]) <= hi <= 2.0


def test_topk_acceptance_per_depth():
    from fledge.eval.metrics import topk_acceptance

    # depth 1 reached 4 times: ranks 0, 0, 1, 3 (3 = not in the top 3); depth 2 twice: 0 and 2; depth 3 never.
    ranks = [(1, 0), (1, 0), (1, 1), (1, 3), (2, 0), (2, 2)]
    assert topk_acceptance(ranks, num_draft=3, k=3) == [[0.5, 0.75, 0.75], [0.5, 0.5, 1.0], None]


def test_paired_throughput_ratio_separates_what_unpaired_intervals_cannot():
    """Prompts of very different speeds, a drafter 1.2x faster than the other on every one: the paired interval is
    tight around 1.2, while each drafter's own interval over prompts spans the prompts' spread."""
    seconds = [1.0, 4.0, 0.5, 3.0, 2.0, 6.0, 0.8, 5.0]  # 128 tokens each: prompts from 21 to 256 tokens/s
    reference = [(128, s) for s in seconds]
    faster = [(128, s / 1.2) for s in seconds]
    ratio, (lo, hi) = paired_throughput_ratio(faster, reference)
    assert ratio == pytest.approx(1.2) and lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    alone = bootstrap_interval([128 / s for s in seconds], median)
    assert alone[1] / alone[0] > 3  # unpaired: the prompts' spread, not the drafters' difference
    # Faster on some prompts, slower on others: the interval straddles 1.
    mixed = [(128, s * (0.7 if i % 2 else 1.4)) for i, s in enumerate(seconds)]
    ratio, (lo, hi) = paired_throughput_ratio(mixed, reference)
    assert lo < 1.0 < hi
    with pytest.raises(ValueError, match="same prompts"):
        paired_throughput_ratio(faster[:3], reference)
