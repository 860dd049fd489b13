"""Greedy exactness of the real loops on the default verifier (SmolLM2-135M), and the bugs it must catch.

In float32 every loop (chain, tree, the hybrid, batched chain and tree) must give plain greedy decoding's output
token for token, and every position must be the verifier's argmax. Four bugs injected on purpose
(``tests/injected_bugs.py``: a RoPE position off by one, a stale KV entry, a wrong accepted count, a wrong residual)
must each be reported as a mismatch, in float32 and in bf16, where rounding makes the loops part from plain decoding
at ties and only the tie band tells the two apart.
"""

from __future__ import annotations

import contextlib

import pytest

from fledge.eval.ties import TieJudge
from fledge.models.verifier import cpu_has_fast_bf16

from injected_bugs import BUGS, default_setup, loops, verdicts

ALL_LOOPS = ("chain", "tree", "hybrid", "batched chain", "batched tree")
BUG_LOOP = {"rope_off_by_one": "tree", "stale_kv": "batched chain", "accept_one_more": "chain",
            "wrong_residual": "batched tree"}
"""The loop each bug is checked in here: together they cover both single-row loops and both batched ones (the
whole table, every bug in every loop, is ``python tests/injected_bugs.py``)."""


@pytest.fixture(scope="module")
def fp32():
    verifier, prompts, plain = default_setup("float32", 2, 24)
    return verifier, prompts, plain, TieJudge(verifier.model)


@pytest.fixture(scope="module")
def bf16():
    if not cpu_has_fast_bf16():
        pytest.skip("this CPU has no AMX / AVX512-BF16: bf16 is emulated here, hundreds of times slower than fp32")
    verifier, prompts, plain = default_setup("bfloat16", 6, 32)
    return verifier, prompts, plain, TieJudge(verifier.model)


def _run(setup, bug: str | None, which=ALL_LOOPS):
    verifier, prompts, plain, judge = setup
    with BUGS[bug](verifier.model) if bug else contextlib.nullcontext():
        outputs = loops(verifier.model, prompts, plain, len(plain[0]), verifier.aux_layer_ids, which)
    return verdicts(judge, prompts, plain, outputs)


def test_every_real_loop_is_plain_greedy_decoding_in_float32(fp32):
    _, prompts, plain, judge = fp32
    assert all(len(p) == 24 for p in plain)  # no early stop: every position is compared
    for name, v in _run(fp32, None).items():
        assert v["identical"] == len(prompts), name
        assert (v["recheck_ties"], v["recheck_mismatches"], v["positions"]) == (0, 0, 2 * 24), name
    baseline = [judge.recheck(str(i), p, t) for i, (p, t) in enumerate(zip(prompts, plain))]
    assert not any(c.ties or c.mismatches for c in baseline)
    assert max(b for c in baseline for b in c.bands) < 1e-4  # an ulp or so of the logits, not a fraction of one


@pytest.mark.parametrize("bug", list(BUGS))
def test_every_injected_bug_is_a_mismatch_in_float32(fp32, bug):
    for name, v in _run(fp32, bug, (BUG_LOOP[bug],)).items():
        assert v["first_mismatches"] + v["recheck_mismatches"] > 0, (bug, name, v)


def test_in_bf16_the_real_loops_part_from_plain_only_at_ties(bf16):
    for name, v in _run(bf16, None, ("tree", "batched chain")).items():
        assert v["first_mismatches"] == v["recheck_mismatches"] == 0, (name, v)


@pytest.mark.parametrize("bug", list(BUGS))
def test_every_injected_bug_is_a_mismatch_in_bf16(bf16, bug):
    for name, v in _run(bf16, bug, (BUG_LOOP[bug],)).items():
        assert v["first_mismatches"] + v["recheck_mismatches"] > 0, (bug, name, v)
