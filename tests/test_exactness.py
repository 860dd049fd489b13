"""Speculative sampling is distributed exactly as the verifier: first the acceptance rules on their own, then the
real chain and tree loops through ``exactness_check``, with a good and a bad draft, and a broken rule that the
check must catch."""

from __future__ import annotations

import math

import pytest
import torch

import fledge.decode.accept
import fledge.decode.loop
from fledge.decode.accept import greedy_from_top, greedy_tokens, leviathan_accept, multi_candidate_accept
from fledge.decode.datastore import NgramDatastore
from fledge.decode.drafters import HybridDrafter, PromptLookupDrafter, RandomDrafter
from fledge.decode.proposals import ChainDraft, TreeShape, grow_tree, propose_chain_with
from fledge.decode.recycle import RecycleTable, bigram_successors
from fledge.eval.exactness import (
    chi2_critical, chi_square, exact_joint, exactness_check, random_eagle_factory, tiny_verifier,
)
from fledge.models.sampling import SamplingParams, sample, target_probs

VOCAB = 16
PROMPT = torch.tensor([1, 5, 7, 2])
RUNS = 300


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the chi-square machinery -------------------------------------------------------------------------------


def test_wilson_hilferty_critical_values():
    # Table values: chi2_{0.95}(10) = 18.307, chi2_{0.999}(15) = 37.697, chi2_{0.99}(100) = 135.807.
    assert chi2_critical(10, 0.05) == pytest.approx(18.307, rel=2e-3)
    assert chi2_critical(15, 0.001) == pytest.approx(37.697, rel=1e-2)
    assert chi2_critical(100, 0.01) == pytest.approx(135.807, rel=2e-3)


def test_chi_square_flags_impossible_tokens_and_bias():
    probs = torch.tensor([0.5, 0.5, 0.0])
    assert chi_square("fair", torch.tensor([510, 490, 0]), probs, 1e-3).passed
    assert not chi_square("biased", torch.tensor([600, 400, 0]), probs, 1e-3).passed
    assert math.isinf(chi_square("impossible", torch.tensor([500, 499, 1]), probs, 1e-3).statistic)


# --- the rules alone ----------------------------------------------------------------------------------------


def random_distribution(generator: torch.Generator, sharpness: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(VOCAB, generator=generator) * sharpness, dim=-1)


def broken_leviathan(p, draft_tokens, q, generator):
    """The classic bug: after a rejection, sample from p instead of the residual max(0, p - q)."""
    k, _ = leviathan_accept(p, draft_tokens, q, generator)
    return k, int(sample(p[k], generator))


def broken_multi_candidate(p, candidates, q, generator):
    """Forgets the residual: after rejecting every candidate it samples the verifier's untouched p."""
    chosen, token = multi_candidate_accept(p, candidates, q, generator)
    return (chosen, token) if chosen >= 0 else (-1, int(sample(p, generator)))


def first_tokens_of_leviathan(rule, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = torch.stack([random_distribution(g) for _ in range(3)])
    q = torch.stack([random_distribution(g) for _ in range(2)])
    counts = torch.zeros(VOCAB)
    for _ in range(draws):
        drafts = torch.cat([sample(q[0], g), sample(q[1], g)])
        k, token = rule(p, drafts, q, g)
        counts[drafts[0] if k >= 1 else token] += 1
    return counts, p[0]


def test_leviathan_rule_is_exact_and_the_check_catches_a_broken_one():
    counts, p = first_tokens_of_leviathan(leviathan_accept, 3000)
    assert chi_square("leviathan", counts, p, 1e-3).passed
    counts, p = first_tokens_of_leviathan(broken_leviathan, 3000)
    assert not chi_square("broken leviathan", counts, p, 1e-3).passed


@pytest.mark.parametrize("sampled", [True, False], ids=["without-replacement", "deterministic"])
def test_multi_candidate_rule_is_exact(sampled):
    g = torch.Generator().manual_seed(1)
    p, q = random_distribution(g), random_distribution(g)
    counts = torch.zeros(VOCAB)
    broken_counts = torch.zeros(VOCAB)
    for _ in range(3000):
        if sampled:
            gumbel = -torch.log(-torch.log(torch.rand(VOCAB, generator=g).clamp_min(1e-20)))
            candidates = torch.topk(q.log() + gumbel, 3).indices
        else:
            candidates = torch.topk(q, 3).indices
        proposal = q if sampled else None
        counts[multi_candidate_accept(p, candidates, proposal, g)[1]] += 1
        broken_counts[broken_multi_candidate(p, candidates, proposal, g)[1]] += 1
    assert chi_square("multi-candidate", counts, p, 1e-3).passed
    assert not chi_square("broken multi-candidate", broken_counts, p, 1e-3).passed


# --- the real loops -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier():
    return tiny_verifier("llama", vocab_size=VOCAB, hidden_size=32, num_layers=1, peak=12.0, seed=0)


class OracleDrafter:
    """A draft built from the verifier's own distribution p (memoised per prefix): q = mix * p^power (renormalised)
    + (1 - mix) * uniform. power 1 is a good draft; power 3 is a sharpened, overconfident one, close to what a
    trained draft looks like at low temperature, and it makes a wrong residual very visible."""

    needs_aux = False
    supports_tree = True
    draft_to_target = None
    target_vocab_size = VOCAB

    def __init__(self, verifier, memo: dict, mix: float = 0.8, power: float = 1.0):
        self.verifier, self.memo, self.mix, self.power = verifier, memo, mix, power

    def start(self, context, aux):
        self.context = context.tolist()
        self.paths: list[list[int]] = []

    def advance(self, new_tokens, aux):
        self.context += new_tokens.tolist()
        self.paths = []

    def _logits(self, path):
        key = tuple(self.context + path)
        if key not in self.memo:
            self.memo[key] = torch.log_softmax(self.verifier(input_ids=torch.tensor([key])).logits[0, -1], -1)
        sharpened = torch.softmax(self.memo[key] * self.power, -1)
        return torch.log(self.mix * sharpened + (1 - self.mix) / VOCAB)

    def root_logits(self):
        return self._logits([])

    def expand(self, parent_slots, tokens):
        rows, slots = [], []
        for parent, token in zip(parent_slots, tokens.tolist()):
            slots.append(len(self.paths))
            self.paths.append((self.paths[parent] if parent >= 0 else []) + [token])
            rows.append(self._logits(self.paths[-1]))
        return torch.stack(rows), slots

    def propose_chain(self, n, sampling, generator):
        return propose_chain_with(self, n, sampling, generator)

    def propose_tree(self, shape, sampling, generator):
        return grow_tree(self, shape, sampling, generator)


def good_draft(verifier):
    memo: dict = {}
    return lambda: OracleDrafter(verifier, memo)


def sharp_draft(verifier):
    memo: dict = {}
    return lambda: OracleDrafter(verifier, memo, mix=1.0, power=3.0)


def bad_draft():
    seeds = iter(range(10**6))
    return lambda: RandomDrafter(VOCAB, seed=next(seeds), sharpness=3.0)


SAMPLING = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.9, top_p=0.9, top_k=12)


@pytest.mark.parametrize(
    "draft, sampling",
    [("good", SAMPLING), ("bad", NUCLEUS)],
)
def test_chain_loop_is_exact(verifier, draft, sampling):
    factory = good_draft(verifier) if draft == "good" else bad_draft()
    report = exactness_check(verifier, factory, "chain", RUNS, prompt_ids=PROMPT, sampling=sampling,
                             num_draft_tokens=3)
    print(report.describe())
    assert report.passed, report.describe()
    # The first round offers 2 drafts; the oracle gets most of them accepted, the random draft hardly any.
    assert (report.mean_accepted > 1.0) if draft == "good" else (report.mean_accepted < 0.5)


@pytest.mark.parametrize(
    "draft, sampled_children, sampling",
    [("good", False, SAMPLING), ("bad", True, NUCLEUS)],
)
def test_tree_loop_is_exact(verifier, draft, sampled_children, sampling):
    factory = good_draft(verifier) if draft == "good" else bad_draft()
    shape = TreeShape(depth=3, top_k=3, total_tokens=8, sampled_children=sampled_children)
    report = exactness_check(verifier, factory, "tree", RUNS, prompt_ids=PROMPT, sampling=sampling, tree_shape=shape)
    print(report.describe())
    assert report.passed, report.describe()


def test_check_fails_a_broken_chain_rule(verifier, monkeypatch):
    monkeypatch.setattr(fledge.decode.loop, "leviathan_accept", broken_leviathan)
    report = exactness_check(verifier, sharp_draft(verifier), "chain", RUNS, prompt_ids=PROMPT, sampling=SAMPLING)
    print(report.describe())
    assert not report.passed


def test_check_fails_a_broken_tree_rule(verifier, monkeypatch):
    monkeypatch.setattr(fledge.decode.accept, "multi_candidate_accept", broken_multi_candidate)
    shape = TreeShape(depth=3, top_k=3, total_tokens=8, sampled_children=False)
    report = exactness_check(verifier, sharp_draft(verifier), "tree", 200, prompt_ids=PROMPT, sampling=SAMPLING,
                             tree_shape=shape)
    print(report.describe())
    assert not report.passed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_break_ties_as_argmax(dtype):
    """The greedy loops' argmax (``max`` with indices, faster on CPUs) takes the first of equal maxima, as the
    plain loop's ``torch.argmax``: rows of the verifier's width and others, 2-4 planted maxima anywhere."""
    gen = torch.Generator().manual_seed(0)
    for vocab, rows in ((49152, 17), (49152, 1), (32000, 5), (4096, 3), (37, 4)):
        x = torch.randn(rows, vocab, generator=gen).to(dtype)
        planted = []
        for r in range(rows):
            where = torch.randperm(vocab, generator=gen)[: 2 + r % 3]
            x[r, where] = 9.0
            planted.append(int(where.min()))
        assert greedy_tokens(x).tolist() == planted == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_from_top_is_argmax_with_any_ties(dtype):
    """The argmax read off a top-k (the recycling loops' one pass over the block) is ``torch.argmax``'s first
    maximum: rows with one maximum, with 2-3 equal maxima (fewer than k), and with k or more (then recomputed)."""
    gen = torch.Generator().manual_seed(1)
    for vocab, rows, k in ((49152, 17, 4), (4096, 9, 4), (37, 6, 2)):
        x = torch.randn(rows, vocab, generator=gen).to(dtype)
        for r in range(rows):
            ties = (1, 2, 3, k, k + 2)[r % 5]
            x[r, torch.randperm(vocab, generator=gen)[:ties]] = 9.0
        values, ids = torch.topk(x, k, dim=-1)
        assert greedy_from_top(values, ids, x).tolist() == torch.argmax(x, dim=-1).tolist()
        assert greedy_from_top(values[None], ids[None], x[None]).tolist() == [torch.argmax(x, dim=-1).tolist()]
    # torch does not promise which of k or more equal maxima topk returns: such a row is recomputed
    x = torch.zeros(2, 10, dtype=dtype)
    x[:, [1, 4, 6, 8]] = 5.0
    x[1, 1] = 0.0
    values, ids = torch.full((2, 3), 5.0, dtype=dtype), torch.tensor([[8, 6, 4], [8, 6, 4]])
    assert greedy_from_top(values, ids, x).tolist() == [1, 4]


def test_target_probs_processing():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert target_probs(logits, SamplingParams(temperature=1.0)).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    # top-p 0.8: 0.5 + 0.3 reaches it, the rest goes.
    assert target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)).tolist() == pytest.approx(
        [0.5 / 0.8, 0.3 / 0.8, 0, 0]
    )
    assert target_probs(logits, SamplingParams(temperature=1.0, top_k=3)).tolist() == pytest.approx(
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_eagle_drafter_is_exact(verifier, method):
    shape = TreeShape(depth=3, top_k=3, total_tokens=8, sampled_children=True)
    report = exactness_check(verifier, random_eagle_factory(verifier, [0, 1, 1]), method, 200, prompt_ids=PROMPT,
                             sampling=SAMPLING, tree_shape=shape, aux_layer_ids=[0, 1, 1])
    print(report.describe())
    assert report.passed, report.describe()
    assert report.mean_accepted > 0


REPEATING = torch.tensor([3, 9, 4, 3, 9, 4, 3, 9])  # the lookup finds its last n-grams earlier: it proposes at once
HYBRID_RUNS = {1: 300, 100: 6000}
"""Runs per hybrid check by batch size. At 6,000 runs the check detects a shift of 3 points of probability mass
(from the verifier's most likely first token to its second) 99 % of the time, by 200 simulated multinomial draws from
the exact joint with the check's four tests at 2.5e-4 each (0.5 % at 300 runs, 55 % at 3,000); a correct loop failed 1
of those 200. Batch 1 keeps 300 runs, a smoke test of the single-row loop: the batched rows run the same rules."""


def hybrid_check(verifier, method, batch_size, made=None, runs=None):
    """The hybrid's exactness check: draft and prompt lookup in one proposal, the lookup continuation
    (deterministic) where the last n-gram occurred before, the draft's proposal (a chain, or EAGLE-2's deterministic
    tree it joins as a branch). In a batch the rows are one ``BatchedHybrid``: the draft batched, the lookup per row."""
    eagle = random_eagle_factory(verifier, [0, 1, 1])
    made = [] if made is None else made
    # A datastore (hybrid_datastore) of random text: where the context has no match, its continuations.
    rng = torch.Generator().manual_seed(0)
    store_text = [torch.randint(0, VOCAB, (64,), generator=rng).tolist() for _ in range(40)]
    store = NgramDatastore(store_text, max_ngram=2, min_ngram=1)

    # Token recycling (hybrid_recycle) from a seed of the same random text: the root's 2 recorded successors and
    # one of each, overwritten each round by the verifier's own top tokens.
    recycle = RecycleTable(bigram_successors(store_text, VOCAB, 2), widths=[2, 1])

    def factory():
        # extend=2: the draft's first two first tokens carry lookup continuations too (hybrid_extend); and up to 3
        # tokens of other occurrences' continuations (hybrid_lookup_nodes)
        # and a budget of 8 of all those candidates (hybrid_budget), chosen by their estimated acceptance; every
        # other sequence goes without the draft in rounds whose lookup is trusted enough (hybrid_draft_cost), so a
        # batch has rows that draft and rows that do not in one round
        made.append(HybridDrafter(eagle(), PromptLookupDrafter(max_ngram=2, min_ngram=1, datastore=store), extend=2,
                                  lookup_nodes=3, recycle=recycle.fresh(), budget=8,
                                  draft_cost=0.6 * (len(made) % 2)))
        return made[-1]

    # The lookup branch may reach deeper than the draft's own tree (TreeShape.lookup_depth).
    shape = TreeShape(depth=2, top_k=3, total_tokens=6, sampled_children=False, lookup_depth=4)
    report = exactness_check(verifier, factory, method, runs or HYBRID_RUNS[batch_size], prompt_ids=HYBRID_PROMPT,
                             sampling=SAMPLING, tree_shape=shape, aux_layer_ids=[0, 1, 1], batch_size=batch_size)
    print(report.describe())
    return report, store


# Odd ids (the draft's vocabulary) in front, so that the draft's first tokens occur in the context: the extensions
# then find continuations.
HYBRID_PROMPT = torch.cat([torch.arange(1, VOCAB, 2), REPEATING])


@pytest.mark.parametrize("batch_size", [1, 100])
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_hybrid_drafter_is_exact(verifier, method, batch_size):
    made: list[HybridDrafter] = []
    report, store = hybrid_check(verifier, method, batch_size, made)
    assert report.passed, report.describe()
    assert sum(d.used_lookup for d in made) > 0  # the lookup branch was taken, and verified exactly
    assert sum(d.lookup_rejected for d in made) > 0  # and rejected too, where the verifier sampled otherwise
    assert store.hits > 0  # some of it from the datastore
    if method == "tree":
        assert sum(d.extended for d in made) > 0  # and branches under the draft's first tokens
        assert sum(d.alternative_nodes for d in made) > 0  # and other occurrences' continuations
        assert sum(d.recycled_nodes for d in made) > 0  # and recycled successors
        assert sum(d.pruned_nodes for d in made) > 0  # of which the budget left some out
        assert sum(d.lookup_alone_rounds for d in made) > 0  # and rounds of the lookup alone
        assert sum(d.recycle.recorded for d in made) > 0  # the verifier's own, once rounds ran


def test_the_hybrid_check_detects_a_three_point_shift(verifier, monkeypatch):
    """A broken loop that moves 3 points of probability from the verifier's likeliest first token to its second."""
    from fledge.eval import exactness

    first = exact_joint(verifier, HYBRID_PROMPT, SAMPLING, 1)
    top, second = (int(i) for i in torch.topk(first, 2).indices)
    move = 0.03 / float(first[top])
    real = exactness.generate
    g = torch.Generator().manual_seed(7)

    def shifted(*args, **kwargs):
        results, seconds = real(*args, **kwargs)
        for r in results:
            if r.tokens[0] == top and float(torch.rand(1, generator=g)) < move:
                r.tokens[0] = second
        return results, seconds

    monkeypatch.setattr(exactness, "generate", shifted)
    report, _ = hybrid_check(verifier, "chain", 100)
    assert not report.passed, report.describe()


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_a_broken_hybrid_fails_the_check(verifier, method, monkeypatch):
    """The hybrid's own bug: after the verifier rejects a lookup token (a point-mass proposal), the token emitted
    instead is drawn from p, the rejected token left in, instead of from p without it."""
    def forgetful_leviathan(p, draft_tokens, q, generator):
        return broken_leviathan(p, draft_tokens, q, generator) if q is None else leviathan_accept(
            p, draft_tokens, q, generator)

    def forgetful_multi_candidate(p, candidates, q, generator):
        return broken_multi_candidate(p, candidates, q, generator) if q is None else multi_candidate_accept(
            p, candidates, q, generator)

    monkeypatch.setattr(fledge.decode.loop, "leviathan_accept", forgetful_leviathan)
    monkeypatch.setattr(fledge.decode.accept, "multi_candidate_accept", forgetful_multi_candidate)
    report, _ = hybrid_check(verifier, method, 100)
    assert not report.passed, report.describe()


def test_a_lookup_branch_joins_the_tree_where_it_agrees():
    from fledge.decode.drafters import with_branch
    from fledge.decode.proposals import DraftTree

    # root -> 5 -> 6, root -> 7
    tree = DraftTree(tokens=torch.tensor([5, 7, 6]), parents=torch.tensor([-1, -1, 0]), depths=torch.tensor([1, 1, 2]),
                     q=None, q_rows=[-1] * 4, draft_to_target=None)
    joined = with_branch(tree, torch.tensor([5, 8, 9]))
    assert joined.tokens.tolist() == [5, 7, 6, 8, 9]
    assert joined.parents.tolist() == [-1, -1, 0, 0, 3]  # 8 hangs from the existing 5, 9 from the new 8
    assert joined.depths.tolist() == [1, 1, 2, 2, 3]
    assert with_branch(tree, torch.tensor([5, 6])).tokens.tolist() == [5, 7, 6]  # already there: nothing added


class DoubtfulOracle(OracleDrafter):
    """A sharp oracle draft whose chains stop where it is unsure (``propose_chain_with``'s min_prob): the number of
    drafts then varies from round to round, zero included. ``biased`` decides on the token it has just sampled
    instead, which skews the drafts it keeps away from q: the check must catch that."""

    def __init__(self, verifier, memo, biased: bool = False, lengths: list[int] | None = None):
        super().__init__(verifier, memo, mix=1.0, power=3.0)
        self.biased, self.lengths = biased, lengths if lengths is not None else []

    def propose_chain(self, n, sampling, generator):
        if not self.biased:
            chain = propose_chain_with(self, n, sampling, generator, min_prob=0.5)
            self.lengths.append(chain.tokens.numel())
            return chain
        logits, ids, qs, slot = self.root_logits(), [], [], -1
        for i in range(n):
            if i:
                step_logits, (slot,) = self.expand([slot], ids[-1])
                logits = step_logits[0]
            q = torch.softmax(logits / sampling.temperature, -1)
            token = torch.multinomial(q, 1, generator=generator)
            if float(q[token]) < 0.5:
                break
            ids.append(token)
            qs.append(q)
        if not ids:
            return ChainDraft(tokens=torch.empty(0, dtype=torch.long), q=None)
        return ChainDraft(tokens=torch.cat(ids), q=torch.stack(qs))


def test_a_chain_that_stops_where_the_draft_doubts_is_exact(verifier):
    memo: dict = {}
    lengths: list[int] = []
    report = exactness_check(verifier, lambda: DoubtfulOracle(verifier, memo, lengths=lengths), "chain", RUNS,
                             prompt_ids=PROMPT, sampling=SAMPLING, num_draft_tokens=3)
    print(report.describe())
    assert report.passed, report.describe()
    assert 0 in lengths and max(lengths) > 0  # it stopped, and it drafted
    # Deciding on the sampled token instead keeps drafts that are not distributed as q: the check sees it.
    biased = exactness_check(verifier, lambda: DoubtfulOracle(verifier, memo, biased=True), "chain", RUNS,
                             prompt_ids=PROMPT, sampling=SAMPLING, num_draft_tokens=3)
    print(biased.describe())
    assert not biased.passed
