"""The quickstart's time budget: the plan fits the budget, a fast box gets more data, user sizes are kept, a budget
too small is refused with its minimum, and the revisions follow the box's real speed."""

from __future__ import annotations

import json

import pytest

from fledge.core.errors import ConfigError
from fledge.launch.quickstart import QuickstartConfig, run_pipeline
from fledge.plan.budget import (
    MAX_EPOCHS,
    MIN_BUDGET_MINUTES,
    PLAN_FRACTION,
    BoxRates,
    BudgetPlan,
    check_budget,
    fit_budget,
    plan_lines,
    plan_vs_actual,
    revise_epochs,
    revise_prompts,
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
    assert 100 < slow.sizes["cache"] < 250 and slow.sizes["train"] == 2.0 and slow.sizes["eval"] == 8
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
    epochs, limit = revise_epochs(plan, tokens, plan.predicted_s["cache"] * 1.5)  # the cache ran 1.5x slower
    assert epochs < planned and limit * 60 > plan.predicted_s["train"]
    plan.started -= plan.predicted_s["train"] * 2
    prompts = revise_prompts(plan, plan.predicted_s["train"] * 2)  # and training ran late: fewer prompts
    assert 4 <= prompts < 8 and len(plan.revisions) == 2
    plan.actual_s = {"probe": 40, "cache": 300}
    assert "revised after cache" in "\n".join(plan_vs_actual(plan))


def test_a_plan_round_trips_through_json(tmp_path):
    plan = fit_budget(20, rates(1), LENGTHS[:50], eval_rows=5, eval_new_tokens=96, fixed={"train": 3.0})
    plan.save(tmp_path / "budget.json")
    again = BudgetPlan.load(tmp_path / "budget.json")
    assert again.sizes == plan.sizes and again.rates == plan.rates
    record = json.loads((tmp_path / "budget.json").read_text())
    assert record["format"] == 1
    # a plan written before formats were numbered reads alike; a later format or an unknown field is refused
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in record.items() if k != "format"}))
    assert BudgetPlan.load(tmp_path / "old.json") == again
    for bad, words in (({**record, "format": 2}, "format 2"), ({**record, "eval_share": 0.2}, "eval_share")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=words):
            BudgetPlan.load(tmp_path / "bad.json")


def test_the_quickstart_under_a_budget_on_a_tiny_verifier(tmp_path, tiny_verifier_dir):
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 40, max_words=30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"the a of {i} to and"]}) + "\n" for i in range(3)))
    run = tmp_path / "qs"
    verifier = [f"verifier.name_or_path={tiny_verifier_dir}", "verifier.dtype=float32"]
    cfg = QuickstartConfig(
        run_dir=str(run), stages=["cache", "train", "eval"], budget_minutes=3,
        cache=[f"cache.dir={run}/cache", *verifier, f"data.source={source}", "data.max_length=128",
               "cache.draft_vocab_size=128"],
        train=[f"cache_dir={run}/cache", f"output_dir={run}/train", "validation.holdout=2", "validation.every=0",
               "ttt.ttt_steps=2", "log.wandb_mode=disabled", "log.progress=false"],
        eval=[f"draft={run}/train", *verifier, f"prompts=[{prompts}]", "eval.max_new_tokens=6",
              f"eval.out_dir={run}/eval", "eval.warmup_tokens=0", "wandb_mode=disabled"],
    )
    out = run_pipeline(cfg)
    plan = out["plan"]
    # A tiny verifier is fast: every conversation of the source is cached and trained on for more epochs.
    assert plan.sizes["cache"] == 40 and plan.sizes["train"] > 2.0
    assert plan.rates.cache_tokens_per_s > 0 and plan.rates.train_tokens_per_s > 0
    assert set(plan.actual_s) == {"probe", "cache", "train", "eval"}
    manifest = json.loads((run / "cache" / "manifest.json").read_text())
    assert manifest["num_conversations"] == 40
    saved = json.loads((run / "budget.json").read_text())
    assert saved["sizes"] == plan.sizes and saved["key"]
    # the evaluation carries what the budget has left as its time limit
    limit = json.loads((run / "eval" / "report.json").read_text())["config"]["time_limit_minutes"]
    assert 0.5 <= limit <= 3
    # A rerun reuses the plan (no new probe) and skips every finished stage, also from a folder of fledge before
    # budget.json had its name; the plan is then written under the current name only.
    (run / "budget.json").rename(run / "plan.json")
    again = run_pipeline(cfg)
    assert again["plan"].rates == plan.rates and all(t["skipped"] for t in again["timings"].values())
    assert (run / "budget.json").is_file() and not (run / "plan.json").exists()
