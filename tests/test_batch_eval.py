"""Batched decoding (``decode/loop.py``, ``decode/batch_draft.py``, ``eval/batch_eval.py``) on tiny random verifiers:
every row's greedy output equals its batch-1 output, the batched draft proposes what each row's drafter alone would,
rows stay exact under sampling (χ²), and the batch sweep's report, table, figures and plot."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fledge.decode.drafters import EagleDrafter, PromptLookupDrafter
from fledge.decode.proposals import TreeShape
from fledge.eval.exactness import tiny_verifier
from fledge.eval.runner import EvalConfig, evaluate
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.sampling import SamplingParams
from fledge.models.verifier import VerifierConfig, load_verifier

from test_spec_loop import (
    AUX_IDS,
    MAX_NEW,
    PROMPT,
    SHAPE,
    VOCAB,
    ReferenceDrafter,
    SpyDrafter,
    random_eagle,
    verifier_aux,
)

from reference_decode import ReferenceEagle, generate_plain

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verifier(request):
    return tiny_verifier(request.param, vocab_size=VOCAB, hidden_size=64, num_layers=4, peak=4.0, seed=1)


BATCH_PROMPTS = [PROMPT, PROMPT[:3], torch.tensor([9]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]),
                 PROMPT[4:]]


@pytest.mark.parametrize("method", ["plain", "chain", "tree"])
def test_batched_greedy_rows_equal_their_batch_one_outputs(verifier, method):
    """Rows of different lengths advance by their own accepted lengths and finish at different rounds (a stop token
    and the length limit); each row's output is its batch-1 plain greedy output, its drafter fed the right features."""
    from fledge.decode.loop import generate

    references = [generate_plain(verifier, p, max_new_tokens=MAX_NEW).tokens for p in BATCH_PROMPTS]
    stop = references[1][5]  # row 1 stops early; others may too, where the token recurs
    expected = [generate_plain(verifier, p, max_new_tokens=MAX_NEW, stop_ids=frozenset({stop})).tokens
                for p in BATCH_PROMPTS]
    drafters = None
    if method != "plain":
        drafters = [SpyDrafter(len(p), ref, seed=i) for i, (p, ref) in enumerate(zip(BATCH_PROMPTS, references))]
    results, seconds = generate(verifier, BATCH_PROMPTS, drafters, method=method, num_draft_tokens=4,
                                shape=SHAPE, max_new_tokens=MAX_NEW, stop_ids=frozenset({stop}),
                                aux_layer_ids=AUX_IDS)
    assert [r.tokens for r in results] == expected and seconds > 0
    assert len({len(r.tokens) for r in results}) > 1  # rows did finish at different lengths
    if method != "plain":
        assert sum(a for r in results for a in r.accepted) > len(BATCH_PROMPTS)  # drafts were accepted
        for prompt, result, spy in zip(BATCH_PROMPTS, results, drafters):
            sequence = prompt.tolist() + result.tokens
            full_aux = verifier_aux(verifier, sequence)
            assert [token for token, _ in spy.pairs] == sequence[1 : len(spy.pairs) + 1]
            if spy.pairs:
                torch.testing.assert_close(torch.stack([a for _, a in spy.pairs]), full_aux[: len(spy.pairs)],
                                           atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["chain", "tree"])
@pytest.mark.parametrize("rows", ["four", "one", "one-token"])
def test_batched_eagle_proposes_what_each_row_would_alone(verifier, method, rows):
    """The batched draft (one forward per draft step for every row, its own ragged KV cache) proposes, row by row,
    exactly what the one-row reference (``ReferenceEagle``) of that row alone proposes: over rounds of commits of
    different lengths, a one-token prompt, a row that leaves the batch, and chains of different lengths (0 included);
    and at batch 1 (its own path for reading the committed tokens), from a prompt and from one token."""
    from fledge.decode.batch_draft import BatchedEagle, RowwiseBatch, batch_drafter

    draft = random_eagle(verifier).double()  # float64: summation order cannot flip an argmax
    prompts = {"four": [PROMPT, torch.tensor([9]), PROMPT[:3], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])],
               "one": [PROMPT], "one-token": [torch.tensor([9])]}[rows]
    batched = batch_drafter([EagleDrafter(draft) for _ in prompts])
    rowwise = RowwiseBatch([ReferenceEagle(draft) for _ in prompts])
    assert isinstance(batched, BatchedEagle)
    sequences = [p.tolist() for p in prompts]
    auxes = [verifier_aux(verifier, s)[:-1] if len(s) > 1 else None for s in sequences]
    for side in (batched, rowwise):
        side.start([p.clone() for p in prompts], auxes)
    rng = random.Random(0)
    for round_ in range(5):
        if method == "chain":
            lengths = [rng.choice([0, 2, 4]) for _ in sequences]
            mine = batched.propose_chains(lengths, SamplingParams(), None)
            theirs = rowwise.propose_chains(lengths, SamplingParams(), None)
            assert [d.tokens.tolist() for d in mine] == [d.tokens.tolist() for d in theirs]
            proposals = [d.tokens.tolist() for d in mine]
        else:
            shapes = [SHAPE if i or round_ or rows != "four" else None for i in range(len(sequences))]
            mine = batched.propose_trees(shapes, SamplingParams(), None)
            theirs = rowwise.propose_trees(shapes, SamplingParams(), None)
            for a, b in zip(mine, theirs):
                assert (a.tokens.tolist(), a.parents.tolist(), a.depths.tolist()) == \
                    (b.tokens.tolist(), b.parents.tolist(), b.depths.tolist())
            # a committed path: the first node, then its first child, and so on
            proposals = []
            for t in mine:
                path, node = [], -1
                for _ in range(rng.randrange(4)):
                    children = [j for j, p in enumerate(t.parents.tolist()) if p == node]
                    if not children:
                        break
                    node = children[0]
                    path.append(int(t.tokens[node]))
                proposals.append(path)
        assert any(proposals)  # the drafts did propose
        updates = []
        for sequence, proposal in zip(sequences, proposals):
            new = proposal[: rng.randrange(len(proposal) + 1)] + [rng.randrange(VOCAB)]
            sequence += new
            updates.append((torch.tensor(new), verifier_aux(verifier, sequence)[len(sequence) - len(new) - 1 : -1]))
        if round_ == 2 and rows == "four":  # row 2 leaves the batch
            keep = [0, 1, 3]
            for side in (batched, rowwise):
                side.keep_rows(keep)
            sequences = [sequences[i] for i in keep]
            updates = [updates[i] for i in keep]
        for side in (batched, rowwise):
            side.advance(updates)
        for mine, theirs in zip(batched._views(), rowwise.rows):  # the next round's root, read back exactly
            torch.testing.assert_close(mine.root_logits(), theirs.root_logits(), rtol=1e-9, atol=1e-9)


def test_batched_plain_decoding_is_hugging_face_generate_at_the_same_batch(verifier):
    """The baseline every batched speed-up divides by: the same tokens as ``generate`` over the same left-padded
    batch (prompts of 1 to 14 tokens, a stop token cutting rows short)."""
    from fledge.decode.loop import generate
    from fledge.eval.hf_baseline import generate_hf_batch

    ours, _ = generate(verifier, BATCH_PROMPTS, None, method="plain", max_new_tokens=MAX_NEW)
    theirs, seconds = generate_hf_batch(verifier, BATCH_PROMPTS, max_new_tokens=MAX_NEW)
    assert [r.tokens for r in ours] == [r.tokens for r in theirs] and seconds > 0
    stop = ours[0].tokens[5]
    ours, _ = generate(verifier, BATCH_PROMPTS, None, method="plain", max_new_tokens=MAX_NEW,
                       stop_ids=frozenset({stop}))
    theirs, _ = generate_hf_batch(verifier, BATCH_PROMPTS, max_new_tokens=MAX_NEW, stop_ids=frozenset({stop}))
    assert [r.tokens for r in ours] == [r.tokens for r in theirs]
    assert len(ours[0].tokens) <= 6


def test_batched_sliding_window_rows_equal_batch_one():
    from fledge.decode.loop import generate

    model = tiny_verifier("mistral", vocab_size=VOCAB, hidden_size=64, num_layers=2, peak=4.0, seed=2,
                          sliding_window=6)
    references = [generate_plain(model, p, max_new_tokens=16).tokens for p in BATCH_PROMPTS]
    drafters = [ReferenceDrafter(len(p), ref, seed=i) for i, (p, ref) in enumerate(zip(BATCH_PROMPTS, references))]
    results, _ = generate(model, BATCH_PROMPTS, drafters, method="tree", shape=SHAPE, max_new_tokens=16)
    assert [r.tokens for r in results] == references


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_batched_sampling_is_exact(method):
    """χ² at batch 40: every row of a batch is distributed as the verifier."""
    from fledge.eval.exactness import exactness_check, random_eagle_factory

    model = tiny_verifier("llama", vocab_size=16, num_layers=1, peak=12.0, seed=0)
    factory = random_eagle_factory(model, [0, 1, 1])
    report = exactness_check(model, factory, method, 600, prompt_ids=torch.tensor([1, 5, 7, 2]),
                             sampling=SamplingParams(temperature=1.0), num_draft_tokens=3,
                             tree_shape=TreeShape(depth=3, top_k=3, total_tokens=8, sampled_children=True),
                             aux_layer_ids=[0, 1, 1], batch_size=40)
    assert report.passed, report.describe()


def test_evaluate_sweeps_batch_sizes_into_a_table_and_a_plot(tiny_verifier_dir, tmp_path):
    """``eval.batch_size='[1,2,3]'``: each drafter's speed-up over plain decoding at the same batch size, greedy rows
    exact at every size, a table row and a stable figure per (set, size, drafter), and the PNG."""
    from fledge.eval.batch_eval import batch_figures, batch_table

    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    config = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=2048,
                                        aux_layer_ids=verifier.aux_layer_ids)
    draft = Eagle3Draft(config, seed=0)
    draft.load_verifier_embedding(verifier.model.get_input_embeddings().weight.detach())
    prompts = [{"id": str(i), "turns": [text]} for i, text in enumerate(
        ["Say hello to the world, then say hello again.", "Count: one two three one two three one two",
         "List the colours of the rainbow.", "Why is the sky blue?", "a b c a b c a b"])]
    cfg = EvalConfig(method="tree", num_draft_tokens=3, tree_depth=3, tree_top_k=3, tree_total_tokens=9,
                     max_new_tokens=10, warmup_tokens=2, batch_size=[3, 1, 2], out_dir=str(tmp_path / "eval"))
    drafters = {"greedy": None, "prompt_lookup": PromptLookupDrafter(), "eagle": EagleDrafter(draft)}
    report = evaluate(verifier, {"toy": prompts}, drafters, cfg)
    sweep = report["batch_sweep"]["toy"]
    assert list(sweep) == ["1", "2", "3"]
    for size, entry in sweep.items():
        assert entry["plain"]["tokens_per_s"] > 0
        assert set(entry["drafters"]) == {"prompt_lookup", "eagle"}
        for d in entry["drafters"].values():
            assert d["greedy_match_rate"] == 1.0 and d["speedup"] > 0 and d["tau"] >= 1.0
            assert d["speedup_interval"][0] <= d["speedup_interval"][1]
    assert sweep["1"]["drafters"]["eagle"]["method"] == "tree"
    assert sweep["1"]["drafters"]["prompt_lookup"]["method"] == "chain"
    # each batch size pairs the draft with prompt lookup group by group (the same prompts decoded together)
    for entry in sweep.values():
        d, ref = entry["drafters"]["eagle"], entry["drafters"]["prompt_lookup"]
        vs = d["vs_prompt_lookup"]
        assert vs["throughput_ratio"] == pytest.approx(d["tokens_per_s"] / ref["tokens_per_s"])
        assert vs["interval"][0] <= vs["throughput_ratio"] <= vs["interval"][1]
        assert "vs_prompt_lookup" not in ref
    assert report["sets"]["toy"]["drafters"]["eagle"]["vs_prompt_lookup"] == sweep["1"]["drafters"]["eagle"][
        "vs_prompt_lookup"]
    # the set's usual entry comes from the smallest batch size
    assert report["sets"]["toy"]["drafters"]["eagle"]["tau"] == sweep["1"]["drafters"]["eagle"]["tau"]
    assert len(batch_table(report)) == 1 + 3 * 2
    # per prompt as at batch 1 (its rounds, its group's speed-up), so fledge sweep compare pairs batched evaluations
    from fledge.eval.compare import compare_main, compare_reports
    from fledge.eval.report import EvalReport

    for entry in sweep.values():
        d = entry["drafters"]["eagle"]
        rows = d["per_prompt"]
        assert [p["id"] for p in rows] == [p["id"] for p in prompts]
        assert sum(p["committed"] for p in rows) / sum(p["rounds"] for p in rows) == pytest.approx(d["tau"])
        assert {p["group"] for p in rows} == set(range(entry["groups"]))
    paired = compare_reports(EvalReport.from_json(report),
                             EvalReport.from_json({"sets": {"toy": {"drafters": sweep["3"]["drafters"]}}}))
    assert {(r["drafter"], r["prompts"]) for r in paired} == {("eagle", 5), ("prompt_lookup", 5)}
    assert all(r["speedup_ratio_interval"][0] <= r["speedup_ratio_interval"][1] for r in paired)
    assert compare_main([str(tmp_path / "eval"), str(tmp_path / "eval")]) == 0
    assert sum(line.startswith("batch_speedup toy/eagle B=") for line in batch_figures(report)) == 3
    # the batched plain baseline against Hugging Face generate at the same batch size: same tokens, both timed
    for entry in sweep.values():
        assert entry["plain"]["hf_generate"]["same_tokens_rate"] == 1.0
        assert entry["plain"]["baseline_vs_hf"] > 0
    assert sum(line.startswith("batch_baseline_vs_hf toy B=") for line in batch_figures(report)) == 3
    assert (tmp_path / "eval" / "speedup_vs_batch.png").stat().st_size > 0
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["batch_sweep"]["toy"]["2"]["drafters"]
    # what fledge eval logs to wandb (offline): a row per batch size with each drafter's speed-up
    from fledge.eval.eval_job import EvalJobConfig, _log_wandb

    from wandb_reader import read_wandb_history

    _log_wandb(EvalJobConfig(wandb_mode="offline", eval=cfg), report)
    rows = [r for r in read_wandb_history(tmp_path / "eval") if "batch_size" in r]
    assert [r["batch_size"] for r in rows] == [1, 2, 3]
    assert [r["toy/eagle/batch_speedup"] for r in rows] == [sweep[s]["drafters"]["eagle"]["speedup"] for s in sweep]
    # each drafter's α table (one row per depth), read from the report through its types
    tables = {k: v for r in read_wandb_history(tmp_path / "eval") for k, v in r.items() if k.endswith("/nrows")}
    drafters = report["sets"]["toy"]["drafters"]
    assert tables == {f"toy/{name}/acceptance/nrows": len(drafters[name]["n_alpha"])
                      for name in ("eagle", "prompt_lookup")}
    assert all(tables.values())


def test_a_batch_mixing_eagle_drafters_with_others_is_refused(verifier):
    """The EAGLE-3 draft steps only batched, so a batch of its rows takes one draft and one set of settings."""
    from fledge.decode.batch_draft import BatchedEagle, RowwiseBatch, batch_drafter

    draft = random_eagle(verifier)
    with pytest.raises(ValueError, match="one kind of drafter"):
        batch_drafter([EagleDrafter(draft), PromptLookupDrafter()])
    with pytest.raises(ValueError, match="one set of settings"):
        batch_drafter([EagleDrafter(draft), EagleDrafter(draft, min_prob=0.5)])
    assert isinstance(batch_drafter([EagleDrafter(draft), EagleDrafter(draft)]), BatchedEagle)
    assert isinstance(batch_drafter([PromptLookupDrafter(), PromptLookupDrafter()]), RowwiseBatch)


@pytest.mark.parametrize("bad", [0, -4, "[1,0]", "many", [2.5]])
def test_a_bad_batch_size_is_refused(bad):
    from fledge.core.errors import ConfigError

    with pytest.raises(ConfigError, match="eval.batch_size"):
        EvalConfig(batch_size=bad)
