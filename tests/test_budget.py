"""The quickstart's time budget: the plan fits the budget, a fast box gets more data, user sizes are kept, a budget
too small is refused with its minimum, and the revisions follow the box's real speed."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from fledge.core.errors import ConfigError
from fledge.launch import quickstart
from fledge.launch.quickstart import QuickstartConfig, run_pipeline
from fledge.models.draft_folder import complete_checkpoints
from fledge.plan import budget
from fledge.plan.budget import (
    EVAL_SHARE,
    MAX_EPOCHS,
    MAX_PROMPTS,
    MIN_BUDGET_MINUTES,
    MIN_PROMPTS,
    PLAN_FRACTION,
    REVISED_FRACTION,
    STAGE_FIXED_S,
    VOCAB_CEIL,
    VOCAB_FLOOR,
    BoxRates,
    BudgetPlan,
    check_budget,
    draft_vocab_for,
    fit_budget,
    fit_shapes,
    plan_lines,
    plan_vs_actual,
    revise_epochs,
    revise_prompts,
    step0_gain,
    train_overrides,
)

from conftest import write_sharegpt_jsonl

LENGTHS = [550] * 3000  # the quickstart's mean conversation at max_length 640


def rates(scale: float = 1.0) -> BoxRates:
    """The 2-core AVX2 box's rates (scale 1), or a box `scale` times as fast."""
    return BoxRates(390 * scale, 320 * scale, 14 * scale, "fp32", 40.0)


def test_the_plan_fits_the_budget_and_a_fast_box_gets_more_data():
    slow = fit_budget(20, rates(1), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
    fast = fit_budget(20, rates(3), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
    for plan in (slow, fast):
        assert sum(plan.predicted_s.values()) <= 20 * 60 * PLAN_FRACTION + 1
        assert sum(plan.predicted_s.values()) >= 20 * 60 * PLAN_FRACTION * 0.95  # the budget is used, not left
    assert 100 < slow.sizes["cache"] < 250 and slow.sizes["train"] == 2.0
    # the evaluation takes its share of the budget (15 %: 5 prompts here), not a fixed minimum of 8
    per_prompt = slow.eval_s(1) - STAGE_FIXED_S["eval"]
    assert slow.sizes["eval"] == int(EVAL_SHARE * 20 * 60 / per_prompt) == 5
    assert fast.sizes["cache"] > 2.5 * slow.sizes["cache"]
    assert fast.sizes["eval"] > slow.sizes["eval"]
    assert "predicted" in plan_lines(fast)[-1]


def test_a_short_source_gets_more_epochs_and_user_sizes_are_kept():
    short = fit_budget(60, rates(1), LENGTHS[:100], eval_rows=5, eval_new_tokens=96, fixed={})
    assert short.sizes["cache"] == 100 and 2.0 < short.sizes["train"] <= MAX_EPOCHS
    fixed = fit_budget(20, rates(1), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={"cache": 400, "eval": 12})
    assert fixed.sizes["cache"] == 400 and fixed.sizes["eval"] == 12 and fixed.fixed == {"cache": True, "eval": True}


def test_a_budget_too_small_is_refused_naming_the_minimum():
    with pytest.raises(ConfigError, match=f"minimum of {MIN_BUDGET_MINUTES:g} minutes"):
        check_budget(1)
    with pytest.raises(ConfigError, match=f"minimum of {MIN_BUDGET_MINUTES:g} minutes"):
        QuickstartConfig(budget_minutes=0.5)
    with pytest.raises(ConfigError, match=r"the minimum here is \d+ minutes") as e:
        fit_budget(4, rates(0.05), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
    need = int(str(e.value).split("the minimum here is ")[1].split()[0])
    fit_budget(need, rates(0.05), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})  # the named minimum fits


def test_revisions_follow_the_boxs_real_speed():
    plan = fit_budget(20, rates(1), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
    planned = plan.sizes["train"]
    tokens = sum(LENGTHS[: int(plan.sizes["cache"])])
    plan.started -= plan.rates.probe_seconds + plan.predicted_s["cache"] * 1.5
    epochs = revise_epochs(plan, tokens, plan.predicted_s["cache"] * 1.5)  # the cache ran 1.5x slower
    assert epochs < planned == 2.0
    # the stages left fill REVISED_FRACTION of the budget: the plan's margin goes to training, not to the evaluation
    eval_s = plan.eval_s(int(plan.sizes["eval"]), plan.rates.decode_tokens_per_s / 1.5)  # as slow as the cache
    left = plan.predicted_s["train"] + eval_s + STAGE_FIXED_S["export"]
    rounding = 0.005 * tokens / (plan.rates.train_tokens_per_s / 1.5)  # the epochs are rounded to 0.01
    assert abs(plan.elapsed() + left - 20 * 60 * REVISED_FRACTION) < rounding + 1
    # training is sized by its share of the time, its epochs only an upper bound (twice the prediction)
    share, cap = train_overrides(plan)
    assert share == f"train.time_budget_minutes={(plan.predicted_s['train'] - STAGE_FIXED_S['train']) / 60:.2f}"
    assert cap == f"train.epochs={2 * epochs:.2f}" and train_overrides(plan) == [share, cap]  # a rerun: the same
    # step 0 alone for a share of the run trains more token-passes a second: the bound makes room for them
    assert train_overrides(plan, step0_share=0.35, ttt_steps=3) == [share, f"train.epochs={2 * 1.7 * epochs:.2f}"]
    assert train_overrides(plan, step0_share=0.35, ttt_steps=1) == [share, cap]
    fixed = fit_budget(20, rates(1), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={"train": 3.0})
    fixed.started -= fixed.rates.probe_seconds + fixed.predicted_s["cache"]
    assert revise_epochs(fixed, tokens, fixed.predicted_s["cache"]) == 3.0  # epochs the user gave stay, with a net
    assert train_overrides(fixed) == [f"train.time_limit_minutes={1.1 * fixed.predicted_s['train'] / 60:.2f}"]
    plan.started -= plan.predicted_s["train"] * 2
    prompts = revise_prompts(plan, plan.predicted_s["train"] * 2)  # and training ran late: the fewest prompts
    assert prompts == MIN_PROMPTS and len(plan.revisions) == 2
    plan.actual_s = {"probe": 40, "cache": 300}
    assert "revised after cache" in "\n".join(plan_vs_actual(plan))


def test_time_that_training_leaves_goes_to_the_evaluation_which_runs_for_the_time_the_budget_has_left():
    plan = fit_budget(20, rates(1), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
    planned = plan.sizes["eval"]
    done = plan.rates.probe_seconds + plan.predicted_s["cache"] + 0.4 * plan.predicted_s["train"]
    plan.started -= done  # training took 0.4x its prediction (its epochs ended early)
    prompts = revise_prompts(plan, 0.4 * plan.predicted_s["train"])
    assert planned < prompts <= MAX_PROMPTS and "eval.max_prompts" in plan.revisions[-1]
    # the prompts are an upper bound, twice those that fit at the probe's decoding rate (not 2.5x faster because
    # training was); the time left decides, all of it (the evaluation's time limit keeps the budget)
    per_prompt = plan.eval_s(1) - STAGE_FIXED_S["eval"]
    left = 20 * 60 - done - STAGE_FIXED_S["export"] - STAGE_FIXED_S["eval"]
    assert prompts == min(MAX_PROMPTS, math.ceil(2 * left / per_prompt))
    assert done + plan.predicted_s["eval"] + plan.predicted_s["export"] == pytest.approx(20 * 60, abs=1)
    fixed = fit_budget(20, rates(1), LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={"eval": 8})
    fixed.started -= done
    assert revise_prompts(fixed, 0.4 * fixed.predicted_s["train"]) == 8  # a size the user gave stays


def test_a_plan_round_trips_through_json(tmp_path):
    plan = fit_budget(20, rates(1), LENGTHS[:50], eval_rows=5, eval_new_tokens=96, fixed={"train": 3.0})
    plan.save(tmp_path / "budget.json")
    again = BudgetPlan.load(tmp_path / "budget.json")
    assert again.sizes == plan.sizes and again.rates == plan.rates
    record = json.loads((tmp_path / "budget.json").read_text())
    assert record["format"] == 2
    # a plan written before formats were numbered, or before the plan chose shapes (format 1), reads alike; a later
    # format or an unknown field is refused
    older = {k: v for k, v in record.items() if k not in ("format", "shapes", "shape_notes")}
    (tmp_path / "old.json").write_text(json.dumps(older))
    assert BudgetPlan.load(tmp_path / "old.json") == again
    (tmp_path / "one.json").write_text(json.dumps({**older, "format": 1}))
    assert BudgetPlan.load(tmp_path / "one.json") == again
    for bad, words in (({**record, "format": 3}, "format 3"), ({**record, "eval_share": 0.2}, "eval_share")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=words):
            BudgetPlan.load(tmp_path / "bad.json")


def zipf_counts(conversations: int, vocab: int = 49152) -> torch.Tensor:
    """Loss-token counts of ``conversations`` conversations, Zipf-distributed like the quickstart's ShareGPT answers
    (432 loss tokens a conversation; the 4,096th token 14 times in 1,217 conversations and 31 in 2,709)."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 0.9
    return (weights / weights.sum() * 432 * conversations).floor().to(torch.int64)


def test_the_draft_vocabulary_holds_the_tokens_the_planned_training_shows_often_enough():
    counts = torch.zeros(49152, dtype=torch.int64)
    counts[:6000] = 20
    counts[6000:9000] = 5
    assert draft_vocab_for(counts, epochs=2.0, min_passes=40) == 6144  # 6,000 tokens seen 40 times, rounded
    assert draft_vocab_for(counts, epochs=8.0, min_passes=40) == 9216  # and 3,000 more at 8 epochs (40 passes)
    assert draft_vocab_for(counts, epochs=1.0, min_passes=40) == VOCAB_FLOOR  # 20 passes learn nothing: the floor
    assert draft_vocab_for((counts + 1) * 1000, epochs=1.0, min_passes=40) == VOCAB_CEIL
    assert draft_vocab_for(torch.full((512,), 1000), epochs=1.0) == 512  # never more than the verifier has
    assert draft_vocab_for(counts, epochs=1.0, min_passes=5) == 9216
    # the default threshold keeps 4,096 wherever it was measured: the 20-minute quickstart's training (1,217
    # conversations, the 4,096th token 14 times, 2 planned epochs) and twice it (2,709, 31 times, 2.36 epochs)
    quickstart, twice = zipf_counts(1217), zipf_counts(2709)
    assert int(quickstart.sort(descending=True).values[4095]) in range(12, 17)
    assert draft_vocab_for(quickstart, epochs=2.0) == draft_vocab_for(twice, epochs=2.36) == 4096
    with pytest.raises(ValueError, match="must be > 0"):
        draft_vocab_for(counts, epochs=0.0)


def test_a_larger_budget_gets_a_larger_vocabulary_at_its_own_training_rate(monkeypatch):
    monkeypatch.setattr(budget, "VOCAB_MIN_PASSES", 32)  # a lower threshold, to see it grow within 120 minutes here
    measured = []

    def rate_at(vocab: int) -> float:  # the output layer's share of a step grows with the vocabulary
        measured.append(vocab)
        return 3 * 320 * 4096 / (4096 + 0.5 * (vocab - 4096))

    def shaped(minutes: float, fixed: bool = False):
        def fit(box):
            return fit_budget(minutes, box, LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
        return fit_shapes(fit(rates(3)), fit, zipf_counts, rate_at, 4096, fixed=fixed)

    small, large = shaped(20), shaped(120)
    assert large.sizes["cache"] * large.sizes["train"] > 3 * small.sizes["cache"] * small.sizes["train"]
    assert large.shapes["draft_vocab_size"] > small.shapes["draft_vocab_size"] == VOCAB_FLOOR
    # each vocabulary the plan moved to was measured, and the plan was refitted at that rate
    assert large.shapes["draft_vocab_size"] in measured
    assert large.rates.train_tokens_per_s == pytest.approx(rate_at(large.shapes["draft_vocab_size"]))
    assert large.rates.probe_seconds >= rates(3).probe_seconds  # the new measurement's time is the probe's
    assert large.shape_notes and "draft vocabulary 4096 ->" in large.shape_notes[0]
    assert sum(large.predicted_s.values()) <= 120 * 60 * PLAN_FRACTION + 1
    assert any("draft   vocabulary" in line for line in plan_lines(large))
    # a vocabulary the user gave is kept, and nothing is measured for it
    measured.clear()
    kept = shaped(120, fixed=True)
    assert kept.shapes == {"draft_vocab_size": 4096} and kept.fixed["draft_vocab_size"] and not measured


def test_the_vocabulary_counts_the_passes_a_step_0_start_adds(monkeypatch):
    monkeypatch.setattr(budget, "VOCAB_MIN_PASSES", 32)

    def shaped(gain: float):
        def fit(box):
            return fit_budget(60, box, LENGTHS, eval_rows=5, eval_new_tokens=96, fixed={})
        return fit_shapes(fit(rates(3)), fit, zipf_counts, lambda vocab: 3 * 320.0, 4096, passes_gain=gain)

    plain, started = shaped(1.0), shaped(step0_gain(0.35, 3))
    assert step0_gain(0.35, 3) == pytest.approx(1.7) and step0_gain(0.0, 7) == step0_gain(0.5, 1) == 1.0
    # the same sizes (the rate does not change here), more passes a token: a larger vocabulary, as the rule gives it
    assert started.sizes == plain.sizes
    epochs = plain.sizes["train"]
    counts = zipf_counts(int(plain.sizes["cache"]))
    assert plain.shapes["draft_vocab_size"] == draft_vocab_for(counts, epochs)
    larger = started.shapes["draft_vocab_size"]
    assert larger == draft_vocab_for(counts, 1.7 * epochs) > plain.shapes["draft_vocab_size"]
    assert f"{1.7 * epochs:.2f} epochs' passes" in started.shape_notes[0]
    with pytest.raises(ValueError, match="passes_gain must be >= 1"):
        shaped(0.9)


def test_the_quickstart_under_a_budget_on_a_tiny_verifier(tmp_path, tiny_verifier_dir, monkeypatch):
    # The vocabulary rule at the tiny run's scale: every token seen once is learnable, in steps of 64 from 64.
    monkeypatch.setattr(budget, "VOCAB_MIN_PASSES", 1)
    monkeypatch.setattr(budget, "VOCAB_GRAIN", 64)
    monkeypatch.setattr(budget, "VOCAB_FLOOR", 64)
    gains = []  # what the vocabulary's rule was told the training's passes gain over the plan's epochs

    def recorded(*args, **kwargs):
        gains.append(kwargs["passes_gain"])
        return budget.fit_shapes(*args, **kwargs)

    monkeypatch.setattr(quickstart, "fit_shapes", recorded)
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 40, max_words=30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"the a of {i} to and"]}) + "\n" for i in range(3)))
    run = tmp_path / "qs"
    verifier = [f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32"]
    cfg = QuickstartConfig(
        run_dir=str(run), stages=["cache", "train", "eval"], budget_minutes=3,
        cache=[f"cache.dir={run}/cache", *verifier, f"data.source={source}", "data.max_length=128"],
        train=[f"cache_dir={run}/cache", f"output_dir={run}/train", "validation.holdout=2", "validation.every=0",
               "ttt.ttt_steps=2", "ttt.step0_share=0.5", "log.wandb_mode=disabled", "log.progress=false"],
        eval=[f"draft={run}/train", *verifier, f"prompts=[{prompts}]", "eval.max_new_tokens=6",
              f"eval.out_dir={run}/eval", "eval.warmup_tokens=0", "wandb_mode=disabled"],
    )
    out = run_pipeline(cfg)
    plan = out["plan"]
    assert gains == [1.5]  # step 0 alone for half the run at TTT 2: 1 + 0.5 (2 - 1)
    # A tiny verifier is fast: every conversation of the source is cached and trained on for more epochs.
    assert plan.sizes["cache"] == 40 and plan.sizes["train"] > 2.0
    assert plan.rates.cache_tokens_per_s > 0 and plan.rates.train_tokens_per_s > 0
    assert set(plan.actual_s) == {"probe", "cache", "train", "eval"}
    manifest = json.loads((run / "cache" / "manifest.json").read_text())
    assert manifest["num_conversations"] == 40
    saved = json.loads((run / "budget.json").read_text())
    assert saved["sizes"] == plan.sizes and saved["key"]
    # the plan chose the vocabulary from the probe's loss tokens (not the 4,096 it started at), measured the
    # training step at it, and the cache was built with it
    vocab = saved["shapes"]["draft_vocab_size"]
    assert 64 <= vocab < 4096 and vocab % 64 == 0 and "draft_vocab_size" not in saved["fixed"]
    assert saved["shape_notes"] and f"draft vocabulary 4096 -> {vocab}" in saved["shape_notes"][0]
    assert manifest["draft_vocab_size"] == vocab
    # training ran for its share of the time, up to twice the epochs predicted, times the step-0 start's gain (here
    # the cap: a tiny draft is fast)
    (_, last), *_ = reversed(complete_checkpoints(run / "train" / "checkpoints"))
    trained = OmegaConf.load(last / "train_config.yaml").train
    assert trained.time_budget_minutes > 0
    assert trained.epochs == pytest.approx(min(MAX_EPOCHS, 2 * 1.5 * plan.sizes["train"]))
    # the evaluation carries what the budget has left as its time limit
    limit = json.loads((run / "eval" / "report.json").read_text())["config"]["time_limit_minutes"]
    assert 0.5 <= limit <= 3
    # A rerun reuses the plan (no new probe) and skips every finished stage, also from a folder of fledge before
    # budget.json had its name; the plan is then written under the current name only.
    (run / "budget.json").rename(run / "plan.json")
    again = run_pipeline(cfg)
    assert again["plan"].rates == plan.rates and all(t["skipped"] for t in again["timings"].values())
    assert (run / "budget.json").is_file() and not (run / "plan.json").exists()
