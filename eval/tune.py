"""The tuner's model: which speculation shape (chain of N, EAGLE-2 tree, or none) pays on this machine.

Inputs are measurements, never assumptions: n-α per depth from one chain run at N_max, the draft's cost per token
c (``cost_ratio`` of that run), and v(k), the verifier's cost of checking k tokens in one forward relative to one
decoding step. On a GPU v(k) is flat for small k; on a CPU it grows with k, which is what makes long chains and big
trees lose there. v(k) times the forward with the loop's capture hooks and cache rollback. A round may also pay a
fixed overhead o beyond that (acceptance bookkeeping): it can be read off the N_max run as its measured
verification cost minus v(N_max + 1), but that run's mean also carries whatever load the machine had, so the job
only adds it on request (``fit_round_overhead``).

    chain N:  E(N) = 1 + Σ_{k=1..N} Π_{i≤k} α_i tokens per round,  cost v(N+1) + o + N·c,  speed-up E / cost
    tree (depth d, top_k, T tokens): E = 1 + Σ_{k=1..d} Π_{i≤k} β_i(w),  cost v(T+1) + o + d·c_tree

β_i(w) is the per-depth top-w acceptance measured in the same chain run: the probability that the verifier's token
at depth i is among the draft's w most likely there, given the round reached depth i (``topk_acceptance``; β_i(1) is
α_i). A tree accepts a depth when one of the children it tried there is the verifier's token; w is the width the
tree affords along a path, min(top_k, T / d): EAGLE-2 expands top_k nodes per level but keeps only T nodes over d
levels. The model measures the children along the draft's greedy path, where the draft is surest; deeper nodes off
that path accept less, so it errs high for wide trees, and the follow-up measurement shows by how much. Without
top-k measurements it falls back to E_chain(d), the acceptance of the greedy path the tree contains. c_tree is the
measured time of a whole tree proposal divided by its d expansion steps. Plain decoding is always a candidate at
exactly 1.0x.

The hybrid (the draft with prompt lookup, ``HybridDrafter``) is predicted by decoding the chain run's output again
with the hybrid's rounds rather than from rates, because its two proposers are not independent (text the context
repeats is also text the draft finds easy) and because a long lookup match is one round, not one per position.
At each position of the output the model knows the lookup's proposal and the prefix of it the output confirms, and
the draft's accepted path from the ranks of the chain round that started there (``measured_positions``,
``draft_path_accepted``); from position 0 each round takes

    hybrid tree:  max(draft path, lookup prefix) tokens + 1, at cost v(T + 1 + branch) + o + d·c_tree
    hybrid chain: the lookup prefix where lookup proposes (cost v(k + 1)), else the draft chain's path
                  (cost v(N + 1) + N·c)

and moves past them; E is tokens over rounds, the cost the mean round's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fledge.decode.batch_draft import batch_drafter
from fledge.decode.proposals import Drafter, TreeShape
from fledge.decode.result import clock
from fledge.decode.session import VerifierSession
from fledge.models.sampling import SamplingParams


@dataclass(frozen=True)
class CostModel:
    """Every cost in plain decoding steps (one verifier forward of one token = 1)."""

    verify_steps: dict[int, float]
    """k -> v(k), the measured cost of one verifier forward over k tokens; k = 1 is 1.0 by definition."""
    draft_step: float
    """c: drafting one chain token (draft forward, sampling, and its share of the per-round draft update)."""
    round_overhead: float = 0.0
    """o: per verification round, what the loop pays beyond the bare forward (acceptance, rollback, capture)."""

    def verify(self, k: int) -> float:
        """v(k), linearly interpolated between measured k (and extrapolated from the two largest beyond them)."""
        if k in self.verify_steps:
            return self.verify_steps[k]
        ks = sorted(self.verify_steps)
        if len(ks) == 1:
            return self.verify_steps[ks[0]]
        lo = max((x for x in ks if x < k), default=ks[0])
        hi = min((x for x in ks if x > k), default=ks[-1])
        if lo == hi:  # beyond the measured range: continue the last segment's slope
            lo, hi = (ks[-2], ks[-1]) if k > ks[-1] else (ks[0], ks[1])
        slope = (self.verify_steps[hi] - self.verify_steps[lo]) / (hi - lo)
        return self.verify_steps[lo] + slope * (k - lo)


@dataclass(frozen=True)
class Candidate:
    """One speculation shape with its predicted tokens per round, round cost and speed-up."""

    name: str
    """``plain``, ``chain N=4`` or ``tree d=4 k=4 T=16``."""
    method: str
    """``plain``, ``chain`` or ``tree``."""
    expected_tokens: float
    """E, tokens committed per verifier round."""
    round_cost: float
    """Cost of one round in plain decoding steps."""
    num_draft_tokens: int = 0
    """N for chains; the depth for trees."""
    tree: TreeShape | None = None
    hybrid: bool = False
    """The draft with prompt lookup (``HybridDrafter``): the lookup's proposal as a tree branch or as the chain."""
    branch: int = 0
    """The hybrid's longest lookup proposal (``eval.num_draft_tokens`` when it runs)."""

    @property
    def predicted_speedup(self) -> float:
        return self.expected_tokens / self.round_cost


PLAIN = Candidate(name="plain", method="plain", expected_tokens=1.0, round_cost=1.0)
"""No speculation: one token per verifier step, by definition 1.0x."""


def _tokens_per_round(rates: Iterable[float]) -> float:
    """1 + Σ_k Π_{i≤k} rate_i: the verifier's own token plus each draft depth reached and accepted, from the
    acceptance rate of each depth given the depth before was accepted. Depths after the rates end add nothing."""
    total, reach = 1.0, 1.0
    for rate in rates:
        reach *= rate
        total += reach
    return total


def expected_tokens(n_alpha: Sequence[float | None], num_draft: int) -> float:
    """E(N) = 1 + Σ_{k=1..N} Π_{i≤k} α_i. A depth no round reached (None, or beyond the measured chain) counts as
    never accepted: the estimate stays on the side of what was seen."""
    return _tokens_per_round(0.0 if alpha is None else float(alpha) for alpha in n_alpha[:num_draft])


def chain_candidate(n_alpha: Sequence[float | None], num_draft: int, cost: CostModel) -> Candidate:
    round_cost = cost.verify(num_draft + 1) + cost.round_overhead + num_draft * cost.draft_step
    return Candidate(name=f"chain N={num_draft}", method="chain", expected_tokens=expected_tokens(n_alpha, num_draft),
                     round_cost=round_cost, num_draft_tokens=num_draft)


def tree_width(shape: TreeShape) -> int:
    """Children a tree of this shape tries per depth along a path: min(top_k, total_tokens / depth), at least 1."""
    return max(1, min(shape.top_k, shape.total_tokens // shape.depth))


def tree_expected_tokens(topk: Sequence[Sequence[float] | None], shape: TreeShape) -> float:
    """E = 1 + Σ_{k=1..d} Π_{i≤k} β_i(w) from the per-depth top-w acceptance (``metrics.topk_acceptance``); a
    depth not measured counts as never accepted, a width beyond the measured one as the widest measured."""
    w = tree_width(shape)
    return _tokens_per_round(float(row[min(w, len(row)) - 1]) if row else 0.0 for row in topk[: shape.depth])


def tree_candidate(
    n_alpha: Sequence[float | None], shape: TreeShape, cost: CostModel, tree_draft_step: float,
    topk: Sequence[Sequence[float] | None] | None = None,
) -> Candidate:
    """``tree_draft_step``: c_tree, one batched expansion step of this shape in plain decoding steps; ``topk``: the
    per-depth top-k acceptance of the same draft (None: the chain's n-α, the tree's greedy path alone)."""
    round_cost = cost.verify(shape.total_tokens + 1) + cost.round_overhead + shape.depth * tree_draft_step
    expected = tree_expected_tokens(topk, shape) if topk else expected_tokens(n_alpha, shape.depth)
    return Candidate(
        name=f"tree d={shape.depth} k={shape.top_k} T={shape.total_tokens}", method="tree",
        expected_tokens=expected, round_cost=round_cost, num_draft_tokens=shape.depth, tree=shape,
    )


def candidates(
    n_alpha: Sequence[float | None],
    cost: CostModel,
    max_draft: int,
    trees: Iterable[tuple[TreeShape, float]] = (),
    topk: Sequence[Sequence[float] | None] | None = None,
) -> list[Candidate]:
    """Plain decoding, chains N = 1..max_draft, then each (tree shape, its c_tree) predicted from ``topk``."""
    return [PLAIN, *(chain_candidate(n_alpha, n, cost) for n in range(1, max_draft + 1)),
            *(tree_candidate(n_alpha, shape, cost, c_tree, topk) for shape, c_tree in trees)]


@dataclass(frozen=True)
class Position:
    """What a hybrid round starting at one position of the measured decode's output would see."""

    ranks: tuple[int, ...]
    """Per depth, the rank of the verifier's token among the draft's top-k (k: absent), from the chain round that
    started here, or where none did, from the last one before (a proxy with the same rates); the chain went on past
    a depth only where that rank is 0."""
    lookup: tuple[int, ...]
    """What the hybrid's lookup proposes here (the context's continuation, or the datastore's), up to the longest
    branch a candidate uses."""
    lookup_accepted: int
    """How many of ``lookup`` the output (the verifier's own greedy continuation) confirms."""


def measured_positions(ranks: Sequence[int], accepted: Sequence[int], proposed: Sequence[int],
                       lookups: Sequence[Sequence[int]], continuation: Sequence[int]) -> list[Position]:
    """One greedy chain decode, position by position: ``ranks`` the flat list it recorded (``DecodeResult.topk_ranks``'
    ranks, min(accepted + 1, proposed) per round), ``lookups[t]`` the lookup's proposal at position t of
    ``continuation`` (the decode's output)."""
    by_start: dict[int, tuple[int, ...]] = {}
    at = start = 0
    for a, n in zip(accepted, proposed):
        reached = min(a + 1, n)
        by_start[start] = tuple(ranks[at: at + reached])
        at += reached
        start += a + 1
    out, last = [], ()
    for t, found in enumerate(lookups):
        last = by_start.get(t, last)
        out.append(Position(last, tuple(found), matched(found, continuation, t)))
    return out


def matched(guess: Sequence[int], output: Sequence[int], at: int) -> int:
    """How many tokens of ``guess`` match ``output`` from position ``at`` on: what a greedy round accepts of it."""
    k = 0
    while k < len(guess) and at + k < len(output) and guess[k] == output[at + k]:
        k += 1
    return k


def draft_path_accepted(ranks: Sequence[int], depth: int, width: int) -> int:
    """Draft tokens a tree of this depth and width accepts in a round, read off the chain's ranks: each depth whose
    verifier token is among the ``width`` best counts, and the path goes deeper only where the chain itself went
    on (rank 0), the one path the measurement saw; deeper nodes off it are not credited (errs low)."""
    taken = 0
    for rank in ranks[:depth]:
        if rank >= width:
            break
        taken += 1
        if rank > 0:
            break
    return taken


def _walk(prompts: Sequence[Sequence[Position]], round_at) -> tuple[float, float]:
    """Decode each measured output again with the hybrid's rounds: from position 0, a round accepts what
    ``round_at(position)`` returns as (accepted, cost) and moves past its accepted tokens and the verifier's own. The
    rounds fall where the hybrid's would (a long lookup match is one round, not one per position of the chain run).
    Returns (tokens per round, cost per round)."""
    tokens = rounds = cost = 0.0
    for positions in prompts:
        t = 0
        while t < len(positions):
            accepted, paid = round_at(positions[t])
            step = min(accepted + 1, len(positions) - t)
            tokens, rounds, cost, t = tokens + step, rounds + 1, cost + paid, t + step
    return (tokens / rounds, cost / rounds) if rounds else (1.0, 1.0)


def hybrid_tree_candidate(prompts: Sequence[Sequence[Position]], shape: TreeShape, branch: int, cost: CostModel,
                          tree_draft_step: float) -> Candidate:
    """The hybrid as a tree: the draft's tree of ``shape`` with the lookup's proposal (up to ``branch`` tokens) as
    one more branch from the root. A round accepts the longer of the draft's path and the lookup's confirmed prefix
    and verifies the tree's T tokens plus the branch's (counted in full: a branch that shares its first token with a
    draft child costs one less)."""
    w = tree_width(shape)

    def round_at(p: Position) -> tuple[int, float]:
        accepted = max(draft_path_accepted(p.ranks, shape.depth, w), min(p.lookup_accepted, branch))
        return accepted, cost.verify(shape.total_tokens + min(len(p.lookup), branch) + 1)

    tokens, verify = _walk(prompts, round_at)
    round_cost = verify + cost.round_overhead + shape.depth * tree_draft_step
    return Candidate(name=f"hybrid tree d={shape.depth} k={shape.top_k} T={shape.total_tokens}", method="tree",
                     expected_tokens=tokens, round_cost=round_cost, num_draft_tokens=shape.depth,
                     tree=shape, hybrid=True, branch=branch)


def hybrid_chain_candidate(prompts: Sequence[Sequence[Position]], num_draft: int, cost: CostModel) -> Candidate:
    """The hybrid as a chain of N: the lookup's proposal (up to N) where it has one, else the draft's chain of N,
    which is accepted as far as the chain's ranks stay 0."""

    def round_at(p: Position) -> tuple[int, float]:
        if p.lookup:
            k = min(len(p.lookup), num_draft)
            return min(p.lookup_accepted, k), cost.verify(k + 1)
        return draft_path_accepted(p.ranks, num_draft, 1), cost.verify(num_draft + 1) + num_draft * cost.draft_step

    tokens, paid = _walk(prompts, round_at)
    return Candidate(name=f"hybrid chain N={num_draft}", method="chain", expected_tokens=tokens,
                     round_cost=paid + cost.round_overhead, num_draft_tokens=num_draft, hybrid=True,
                     branch=num_draft)


def recommend(options: Sequence[Candidate]) -> Candidate:
    """The highest predicted speed-up; on a tie the earlier (simpler) candidate, so plain wins a draw (ValueError
    without candidates)."""
    return max(options, key=lambda option: option.predicted_speedup)  # max keeps the first of equals


def overhead_from_run(measured_verify_cost: float, num_draft: int, cost: CostModel) -> float:
    """o = the N-chain run's verification cost per round minus the bare forward v(N+1); never below 0."""
    return max(0.0, measured_verify_cost - cost.verify(num_draft + 1))


def format_table(options: Sequence[Candidate], chosen: Candidate | None = None) -> list[str]:
    rows = [f"{'shape':<29} {'E tokens/round':>14} {'round cost':>11} {'predicted':>10}"]
    for o in options:
        mark = "  <- recommended" if chosen is not None and o == chosen else ""
        rows.append(f"{o.name:<29} {o.expected_tokens:>14.3f} {o.round_cost:>11.3f} {o.predicted_speedup:>9.3f}x{mark}")
    return rows


# Measurement helpers: the only functions here that touch a model.


@torch.inference_mode()
def measure_verify_cost(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    ks: Iterable[int],
    aux_layer_ids: Sequence[int] | None = None,
    repeats: int = 5,
) -> dict[int, float]:
    """v(k) for each k: the fastest of ``repeats`` timed verifier forwards over k tokens appended to the prompt's KV
    cache (then cropped back), divided by that of k = 1. With ``aux_layer_ids`` the capture hooks run as in the loop.

    The lengths are timed round-robin and the minimum kept, because on a shared CPU a burst of other work lands on
    whichever length is running: the minimum is the cost of the forward itself, and round-robin spreads the bursts.
    A forward over more tokens never costs less, so the result is made non-decreasing in k. The k tokens are the
    prompt's own tokens repeated: content does not change a forward's cost, only its length.
    """
    device = next(model.parameters()).device
    ks = sorted(set(ks) | {1})
    best = {k: float("inf") for k in ks}
    with VerifierSession(model, aux_layer_ids) as session:
        session.prefill([prompt_ids])
        pool = prompt_ids.to(device).repeat(max(ks) // max(prompt_ids.numel(), 1) + 1)
        for attempt in range(repeats + 1):
            for k in ks:
                start = clock(device)
                session.forward([pool[:k]])
                seconds = clock(device) - start
                session.commit([[]])  # back to the prompt
                if attempt:  # the first pass is untimed: first calls pay for allocation
                    best[k] = min(best[k], seconds)
    return relative_costs(best)


def relative_costs(seconds: dict[int, float]) -> dict[int, float]:
    """v(k) from the fastest time of each k: seconds[k] / seconds[1], made non-decreasing in k (a forward over
    more tokens never costs less; a smaller measured ratio is noise that survived the minimum)."""
    out, floor = {}, 0.0
    for k in sorted(seconds):
        floor = max(floor, seconds[k] / seconds[1])
        out[k] = floor
    return out


@torch.inference_mode()
def measure_tree_draft_seconds(model: torch.nn.Module, drafter: Drafter, prompt_ids: torch.Tensor, shape: TreeShape,
                               aux_layer_ids: Sequence[int] | None) -> float:
    """Seconds of one greedy tree proposal of ``shape`` after the drafter has read the prompt (the fastest of three,
    as for v(k))."""
    device = next(model.parameters()).device
    with VerifierSession(model, aux_layer_ids if drafter.needs_aux else None) as session:
        auxes = session.prefill([prompt_ids])
    batch = batch_drafter([drafter.fresh()])  # what the loop runs at batch 1
    batch.start([prompt_ids.cpu()], auxes)
    sampling = SamplingParams()
    batch.propose_trees([shape], sampling, None)  # untimed: first-call allocation
    # Each proposal leaves speculative entries behind; advancing by nothing would need aux, so restart instead.
    seconds = []
    for _ in range(3):
        batch.start([prompt_ids.cpu()], auxes)
        start = clock(device)
        batch.propose_trees([shape], sampling, None)
        seconds.append(clock(device) - start)
    return min(seconds)

