"""Acceptance metrics: pure functions of an acceptance trace (accepted drafts per verifier call).

Definitions (docs/design.md, "Acceptance"):
* τ, the acceptance length, is the mean over verifier calls of (accepted draft tokens + 1): tokens per call.
* n-α is P(the depth-n draft is accepted | all drafts before it were accepted), for chain drafting.
* The per-token acceptance rate α pools every depth: accepted drafts / drafts that were decided on (a round with
  k accepted decided k+1 drafts when it rejected one, k when all were accepted). It is the maximum-likelihood α of
  Leviathan et al.'s i.i.d. model, whose expected tokens per call is E = (1 - α^(N+1)) / (1 - α), and whose
  predicted speed-up is E / (N·c + 1) for a draft step costing c verifier steps.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class AcceptanceTrace:
    accepted: list[int]
    """Per verifier call: accepted draft tokens."""
    num_draft: int
    """N, the most drafts a round can propose (chain length, or tree depth)."""
    proposed: list[int] | None = None
    """Per verifier call: drafts actually offered (prompt lookup may offer fewer); None means N every round."""

    def __post_init__(self) -> None:
        if self.proposed is not None and len(self.proposed) != len(self.accepted):
            raise ValueError(f"trace has {len(self.accepted)} rounds but {len(self.proposed)} proposal lengths")
        bad = [a for a, p in zip(self.accepted, self.offered()) if not 0 <= a <= p]
        if bad:
            raise ValueError(f"accepted counts {bad} outside 0..proposed")

    def offered(self) -> list[int]:
        return self.proposed if self.proposed is not None else [self.num_draft] * len(self.accepted)


def n_alpha(trace: AcceptanceTrace) -> list[float | None]:
    """[1-α, 2-α, ..., N-α]; None where no round reached that depth with a draft there."""
    out: list[float | None] = []
    for depth in range(1, trace.num_draft + 1):
        trials = sum(1 for a, p in zip(trace.accepted, trace.offered()) if p >= depth and a >= depth - 1)
        passed = sum(1 for a in trace.accepted if a >= depth)
        out.append(passed / trials if trials else None)
    return out


def acceptance_histogram(trace: AcceptanceTrace) -> list[int]:
    """counts[k] = number of verifier calls that accepted exactly k drafts, k = 0..N."""
    return [trace.accepted.count(k) for k in range(trace.num_draft + 1)]


def cumulative_acceptance(trace: AcceptanceTrace) -> list[float]:
    """[P(accepted >= 1), ..., P(accepted >= N)] over verifier calls."""
    rounds = max(len(trace.accepted), 1)
    return [sum(1 for a in trace.accepted if a >= depth) / rounds for depth in range(1, trace.num_draft + 1)]


def tau_by_length(trace: AcceptanceTrace) -> list[float]:
    """τ a chain of n drafts would have had, for n = 0..N, read off this trace.

    With chain drafting the first n drafts are accepted or not regardless of the drafts after them, so cutting the
    trace at n is exact (for the same draft proposals), not a model.
    """
    rounds = max(len(trace.accepted), 1)
    return [sum(min(a, n) + 1 for a in trace.accepted) / rounds for n in range(trace.num_draft + 1)]


def topk_acceptance(ranks: Sequence[tuple[int, int]], num_draft: int, k: int) -> list[list[float] | None]:
    """[depth - 1][w - 1] = P(the verifier's token is among the draft's top w at that depth | the round reached it),
    from (depth, rank) pairs of greedy chain rounds (rank k: not in the top k). Column 1 is the chain's n-α; a
    column w is what a tree that tried the w best children at every node of the accepted path would accept. None
    for a depth no round reached."""
    table: list[list[float] | None] = []
    for depth in range(1, num_draft + 1):
        at = [r for d, r in ranks if d == depth]
        table.append([sum(r < w for r in at) / len(at) for w in range(1, k + 1)] if at else None)
    return table


def acceptance_rate(trace: AcceptanceTrace) -> float:
    """Pooled per-token α: accepted drafts / drafts decided on."""
    accepted = sum(trace.accepted)
    rejected = sum(1 for a, p in zip(trace.accepted, trace.offered()) if a < p)
    return accepted / (accepted + rejected) if accepted + rejected else 0.0


def expected_tokens_per_call(alpha: float, num_draft: int) -> float:
    """E = (1 - α^(N+1)) / (1 - α), the expected tokens per verifier call (N + 1 at α = 1)."""
    if alpha >= 1.0:
        return float(num_draft + 1)
    return (1.0 - alpha ** (num_draft + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, num_draft: int, cost_ratio: float) -> float:
    """E / (N·c + 1): wall-time speed-up over plain decoding if a draft step costs ``cost_ratio`` verifier steps
    and a verification costs one."""
    return expected_tokens_per_call(alpha, num_draft) / (num_draft * cost_ratio + 1.0)


def summarize(trace: AcceptanceTrace) -> dict:
    """Every trace metric in one JSON-ready dict."""
    alpha = acceptance_rate(trace)
    return {
        "rounds": len(trace.accepted),
        "num_draft": trace.num_draft,
        "tau": pooled_tau([(sum(a + 1 for a in trace.accepted), len(trace.accepted))]),
        "n_alpha": n_alpha(trace),
        "cumulative_acceptance": cumulative_acceptance(trace),
        "histogram": acceptance_histogram(trace),
        "tau_by_length": tau_by_length(trace),
        "alpha": alpha,
        "expected_tokens_per_call": expected_tokens_per_call(alpha, trace.num_draft),
    }


def acceptance_entry(results: Sequence[Any], method: str, chain_length: int, tree_depth: int
                     ) -> tuple[dict, AcceptanceTrace, list[tuple[int, int]]]:
    """What a drafter's rounds accepted over a prompt set's results (each with ``accepted`` and ``proposed`` per
    round), as every evaluation reports it, at batch 1 or B: the method and ``summarize``'s figures, with τ's
    bootstrap interval over prompts; also the pooled trace and each prompt's (committed tokens, rounds)."""
    proposed = [p for r in results for p in r.proposed]
    # N: the chain length, or for trees the deepest path any round offered (the draft's own ``tree_depth``, or a
    # hybrid's longer prompt-lookup branch).
    num_draft = max([tree_depth, *proposed]) if method == "tree" else chain_length
    trace = AcceptanceTrace(accepted=[a for r in results for a in r.accepted], num_draft=num_draft, proposed=proposed)
    per_prompt = [(sum(a + 1 for a in r.accepted), len(r.accepted)) for r in results]
    entry = {"method": method, **summarize(trace), "tau_interval": list(bootstrap_interval(per_prompt, pooled_tau))}
    return entry, trace, per_prompt


def bootstrap_interval(samples: Sequence[Any], statistic: Callable[[Sequence[Any]], float]) -> tuple[float, float]:
    """95 % percentile bootstrap interval of ``statistic`` over ``samples`` (prompts) drawn with replacement, from
    2000 resamples of a seeded generator (the same interval every time).

    The unit resampled is the prompt, not the round: rounds of one prompt are not independent (a prompt that
    repeats itself is easy throughout), so an interval over rounds would claim more certainty than the data has.
    """
    n = len(samples)
    if n == 0:
        return math.nan, math.nan
    if n == 1:
        value = statistic(samples)
        return value, value
    rng, resamples, tail = random.Random(0), 2000, (1.0 - 0.95) / 2.0
    values = sorted(statistic([samples[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return values[int(tail * resamples)], values[min(resamples - 1, int((1.0 - tail) * resamples))]


def paired_throughput_ratio(
    a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]]
) -> tuple[float, tuple[float, float]]:
    """How much faster ``a`` decodes than ``b`` on the same prompts: pooled tokens/s of a over pooled tokens/s of b,
    from (tokens, seconds) per prompt, with a bootstrap interval that resamples prompts *in pairs*.

    Two unpaired intervals over prompts mostly measure how the prompts differ (a repetitive prompt is fast for every
    drafter), so they overlap even when one drafter wins on every prompt; resampling pairs cancels that.
    """
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs the same prompts, got {len(a)} and {len(b)}")

    def ratio(pairs: Sequence[tuple[tuple[int, float], tuple[int, float]]]) -> float:
        a_rate = sum(x[0] for x, _ in pairs) / max(sum(x[1] for x, _ in pairs), 1e-12)
        b_rate = sum(y[0] for _, y in pairs) / max(sum(y[1] for _, y in pairs), 1e-12)
        return a_rate / b_rate if b_rate else math.nan

    pairs = list(zip(a, b))
    return ratio(pairs), bootstrap_interval(pairs, ratio)


REFERENCE_DRAFTER = "prompt_lookup"
"""The training-free drafter every other drafter is compared with, prompt by prompt (``vs_prompt_lookup``)."""


def compare_with_reference(entries: dict[str, dict], units: dict[str, Sequence[tuple[int, float]]]) -> None:
    """Add ``vs_prompt_lookup`` to each drafter's entry: its throughput over prompt lookup's on the same units
    ((tokens, seconds) per prompt at batch 1, per group of prompts in a batch sweep), paired
    (``paired_throughput_ratio``). Whether a trained draft beats the drafter that needs no training is the question
    its speed-up intervals against plain decoding, taken apart, cannot settle."""
    reference = units.get(REFERENCE_DRAFTER)
    if not reference:
        return
    for name, own in units.items():
        if name != REFERENCE_DRAFTER:
            ratio, (lo, hi) = paired_throughput_ratio(own, reference)
            entries[name][f"vs_{REFERENCE_DRAFTER}"] = {"throughput_ratio": ratio, "interval": [lo, hi]}


def throughput(units: Sequence[tuple[int, float]]) -> dict[str, Any]:
    """``{tokens, seconds, tokens_per_s}`` pooled over (tokens, seconds) units: prompts, or groups of them."""
    tokens, seconds = sum(t for t, _ in units), sum(s for _, s in units)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}


def pooled_tau(per_prompt: Sequence[tuple[int, int]]) -> float:
    """τ of several prompts together from (committed tokens, verifier calls) per prompt: all tokens / all calls."""
    calls = sum(c for _, c in per_prompt)
    return sum(t for t, _ in per_prompt) / calls if calls else 0.0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan
