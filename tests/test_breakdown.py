"""The first-token failure breakdown (``eval/breakdown.py``): its ranks are the ones a real greedy chain round sees
at the same position, its classes follow their order, and ``fledge eval`` reports, prints and plots it."""

from __future__ import annotations

import json

import pytest
import torch

from fledge.decode.drafters import EagleDrafter, HybridDrafter, PromptLookupDrafter
from fledge.decode.loop import decode_one
from fledge.eval.breakdown import (
    CLASSES,
    FirstToken,
    breakdown,
    breakdown_figures,
    breakdown_lines,
    first_tokens,
)
from fledge.eval.exactness import tiny_verifier
from fledge.eval.runner import EvalConfig, evaluate
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.verifier import VerifierConfig, load_verifier

from reference_decode import generate_plain

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128
AUX_IDS = [1, 2, 3]
PROMPT = torch.tensor([3, 17, 42, 99, 5, 120, 8, 64, 31, 7, 42, 99])


def _verifier():
    return tiny_verifier("llama", vocab_size=VOCAB, hidden_size=64, num_layers=4, peak=4.0, seed=3).double().eval()


def _draft(verifier, draft_vocab_size: int) -> Eagle3Draft:
    """A random draft; below the full vocabulary it holds every other verifier id from 4 on."""
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=draft_vocab_size, aux_layer_ids=AUX_IDS)
    draft = Eagle3Draft(config, seed=1)
    draft.load_verifier_embedding(verifier.get_input_embeddings().weight.detach())
    if draft_vocab_size < VOCAB:
        target_ids = torch.arange(4, 4 + 2 * draft_vocab_size, 2)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[target_ids] = True
        draft.set_draft_vocab(target_ids - torch.arange(draft_vocab_size), t2d)
    with torch.no_grad():
        draft.lm_head.weight.mul_(10.0)
    return draft.double().eval()


def _round_starts(accepted: list[int], proposed: list[int], ranks: list[tuple[int, int]]) -> dict[int, int]:
    """{answer position a round started at: the depth-1 rank it recorded}, from a greedy chain's trace."""
    starts, position, at = {}, 0, 0
    for a, p in zip(accepted, proposed):
        reached = min(a + 1, p)
        if reached:
            depth, rank = ranks[at]
            assert depth == 1
            starts[position] = rank
        at += reached
        position += a + 1
    assert at == len(ranks)
    return starts


@pytest.mark.parametrize("draft_vocab_size", [VOCAB, 48])
def test_ranks_are_the_ones_a_greedy_chain_round_sees(draft_vocab_size):
    """In float64, with k = the whole draft vocabulary (so every in-vocabulary token has an exact rank), the rank at
    each position where a real chain round started equals the loop's own depth-1 rank there: the breakdown reads
    the draft at the position the loop proposes from, through the same vocabulary mapping."""
    verifier = _verifier()
    draft = _draft(verifier, draft_vocab_size)
    answer = generate_plain(verifier, PROMPT, max_new_tokens=40).tokens
    eagle = EagleDrafter(draft)
    eagle.rank_top_k = draft_vocab_size
    result = decode_one(verifier, PROMPT, eagle, method="chain", num_draft_tokens=3, max_new_tokens=40,
                        aux_layer_ids=AUX_IDS)
    assert result.tokens == answer
    starts = _round_starts(result.accepted, result.proposed, result.topk_ranks)
    assert len(starts) >= 10
    records = first_tokens(verifier, EagleDrafter(draft), PROMPT, answer, top_k=draft_vocab_size)
    assert [r.position for r in records] == list(range(len(answer)))
    assert {p: records[p].rank for p in starts} == starts
    # The ranks spread over the vocabulary (a random draft), so an off-by-one position could not agree by chance.
    assert len({r.rank for r in records}) >= 8
    mapping = EagleDrafter(draft).draft_to_target
    for r, token in zip(records, answer):  # greedy: the verifier's choice is plain decoding's token
        assert r.in_vocab == (mapping is None or token in mapping.tolist())
        assert r.in_vocab or r.rank == draft_vocab_size
    if draft_vocab_size < VOCAB:
        assert any(not r.in_vocab for r in records) and any(r.in_vocab for r in records)


def test_first_tokens_of_a_one_token_prompt_or_an_empty_answer_are_empty():
    verifier = _verifier()
    eagle = EagleDrafter(_draft(verifier, VOCAB))
    assert first_tokens(verifier, eagle, PROMPT[:1], [5, 6], top_k=4) == []
    assert first_tokens(verifier, eagle, PROMPT, [], top_k=4) == []
    with pytest.raises(ValueError, match="top_k"):
        first_tokens(verifier, eagle, PROMPT, [5], top_k=0)


def test_classes_follow_their_order_and_the_bins_hold_every_position():
    def record(position, prob, rank, in_vocab=True):
        return FirstToken(position=position, verifier_prob=prob, rank=rank, in_vocab=in_vocab, top_k=4)

    records = [
        record(0, 0.95, 0),            # accepted
        record(1, 0.30, 0),            # accepted although the verifier is unsure
        record(2, 0.90, 4, False),     # outside the vocabulary (before "unsure" or "mispredicted")
        record(3, 0.20, 4, False),     # outside, and unsure: outside wins
        record(7, 0.60, 2),            # 3rd choice
        record(8, 0.40, 3),            # 4th choice, verifier unsure: top-k wins
        record(16, 0.49, 4),           # unsure
        record(64, 0.50, 4),           # exactly 1/2: sure, so mispredicted
        record(128, 1.00, 4),          # mispredicted
    ]
    assert [r.outcome() for r in records] == [
        "accepted", "accepted", "outside_vocab", "outside_vocab", "in_top_k", "in_top_k", "verifier_unsure",
        "mispredicted", "mispredicted"]
    b = breakdown(records, top_k=4)
    assert b["counts"] == {"accepted": 2, "outside_vocab": 2, "in_top_k": 2, "verifier_unsure": 1,
                           "mispredicted": 2}
    assert sum(b["shares"].values()) == pytest.approx(1.0) and b["positions"] == 9
    assert b["ceilings"]["with_top_k"] == pytest.approx(4 / 9)
    assert b["ceilings"]["all_in_vocab"] == pytest.approx(7 / 9)
    assert b["ceilings"]["verifier_sure"] == pytest.approx(5 / 9)
    by_prob = {row["bin"]: row for row in b["by_verifier_prob"]}
    assert list(by_prob) == ["[0, 0.25)", "[0.25, 0.5)", "[0.5, 0.75)", "[0.75, 0.9)", "[0.9, 1]"]
    assert [row["positions"] for row in b["by_verifier_prob"]] == [1, 3, 2, 0, 3]
    assert by_prob["[0.25, 0.5)"]["agreement"] == pytest.approx(1 / 3)
    assert by_prob["[0.25, 0.5)"]["among_top_k"] == pytest.approx(2 / 3)
    assert by_prob["[0.75, 0.9)"]["agreement"] is None
    assert by_prob["[0.9, 1]"]["agreement"] == pytest.approx(1 / 3)
    by_position = {row["bin"]: row["positions"] for row in b["by_position"]}
    assert by_position == {"[0, 8)": 5, "[8, 16)": 1, "[16, 32)": 1, "[32, 64)": 0, "[64, 128)": 1, "128+": 1}
    assert breakdown([], top_k=4)["positions"] == 0


@pytest.mark.parametrize("batch_size", [1, [2]])
def test_evaluate_reports_prints_and_plots_the_breakdown(tiny_verifier_dir, tmp_path, batch_size):
    """``fledge eval`` with a hybrid and prompt lookup: each prompt set gets the table over plain decoding's
    answers (one position per plain token), printed, with stable labels and first_token.png."""
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    config = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=2048,
                                        aux_layer_ids=verifier.aux_layer_ids)
    draft = Eagle3Draft(config, seed=0)
    draft.load_verifier_embedding(verifier.model.get_input_embeddings().weight.detach())
    prompts = {"chat": [{"id": "a", "turns": ["Say hello to the world, then say hello again."]},
                        {"id": "b", "turns": ["Count: one two three one two three one two"]}],
               "code": [{"id": "c", "turns": ["def add(a, b): return a + b  # write sub the same way"]}]}
    cfg = EvalConfig(method="chain", num_draft_tokens=3, tree_top_k=4, max_new_tokens=10, warmup_tokens=0,
                     hf_baseline=False, round_floor=False, recheck=False, batch_size=batch_size,
                     out_dir=str(tmp_path / "eval"))
    drafters = {"prompt_lookup": PromptLookupDrafter(),
                "hybrid": HybridDrafter(EagleDrafter(draft), PromptLookupDrafter(min_ngram=1))}
    report = evaluate(verifier, prompts, drafters, cfg)
    for set_name, entry in report["sets"].items():
        b = entry["first_token"]
        plain_tokens = entry["baseline"]["tokens"]
        assert b["positions"] == plain_tokens and b["top_k"] == 4
        assert sum(b["counts"].values()) == plain_tokens
        assert sum(row["positions"] for row in b["by_position"]) == plain_tokens
        assert sum(row["positions"] for row in b["by_verifier_prob"]) == plain_tokens
        # A draft vocabulary of 2,048 of the tokenizer's ids: its coverage is what "outside_vocab" leaves.
        assert b["shares"]["outside_vocab"] == pytest.approx(1.0 - entry["draft_vocab_coverage"])
    lines = breakdown_lines(report)
    assert lines[0].startswith("where the draft's first token fails") and any(l.startswith("code") for l in lines)
    assert [f.split()[:3] for f in breakdown_figures(report)] == [
        ["first_token", s, c] for s in ("chat", "code") for c in CLASSES]
    out = tmp_path / "eval"
    assert (out / "first_token.png").stat().st_size > 0
    assert "first_token" in json.loads((out / "report.json").read_text())["sets"]["code"]
    # Without an EAGLE-3 drafter, or switched off, there is no breakdown (and no PNG).
    none = evaluate(verifier, prompts, {"prompt_lookup": PromptLookupDrafter()},
                    EvalConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "none")}))
    off = evaluate(verifier, prompts, drafters, EvalConfig(**{**cfg.__dict__, "first_token": False, "out_dir": None}))
    for r in (none, off):
        assert all("first_token" not in e for e in r["sets"].values()) and breakdown_lines(r) == []
    assert not (tmp_path / "none" / "first_token.png").exists()
