"""Sweeps: ``fledge train -m`` gives each job its own folder, ``fledge eval`` of the sweep folder evaluates every
job's draft side by side, and ``fledge sweep table`` joins the two into one table and a PNG."""

from __future__ import annotations

import json

import pytest

from fledge.core.errors import ConfigError
from fledge.eval.sweeps import budget_table, short_overrides, sweep_table, varying_overrides
from fledge.launch.cli import run_stage
from fledge.launch.sweep import budget_main, table_main
from fledge.plan.budget import BoxRates, BudgetPlan

from test_train_fixtures import build_cache, run_cli, shared_root, train_overrides


def test_a_training_sweep_its_evaluation_and_its_table(tmp_path_factory, tmp_path, smollm_tokenizer, capsys):
    cache = build_cache(shared_root(tmp_path_factory), smollm_tokenizer)
    sweep = tmp_path / "sweep"
    # output_dir is the fixtures' single-run folder; the sweep must not write there but into each job's folder.
    single = tmp_path / "never-written"
    args = [a for a in train_overrides(cache, single, **{"train.max_steps": 2, "validation.holdout": 2,
                                                          "validation.every": 2})]
    proc = run_cli(["-m", *args, "train.lr=0.001,0.003", f"hydra.sweep.dir={sweep}"])
    assert not single.exists(), proc.stdout
    jobs = sorted(p.parent for p in sweep.glob("*/sweep.json"))
    assert [p.name for p in jobs] == ["0", "1"]
    for job, lr in zip(jobs, ("0.001", "0.003")):
        record = json.loads((job / "sweep.json").read_text())
        assert record["stage"] == "train" and record["finished"] and record["seconds"] > 0
        assert f"train.lr={lr}" in record["overrides"]
        assert (job / "draft").is_dir() and (job / "metrics.jsonl").is_file()

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"the a of {i} to and"]}) + "\n" for i in range(2)))
    verifier = shared_root(tmp_path_factory) / "peaked-llama"
    report = run_stage("eval", [
        f"draft={sweep}", f"verifier.name_or_path={verifier}", "verifier.dtype=float32",
        f"prompts=[{prompts}]", "eval.max_new_tokens=6", "eval.warmup_tokens=0", f"eval.out_dir={sweep}/eval",
        "eval.hf_baseline=false", "eval.round_floor=false", "hybrid=false", "wandb_mode=disabled",
    ])
    rows = report["sets"]["prompts"]["drafters"]
    assert {"eagle3#0", "eagle3#1", "prompt_lookup"} <= set(rows)
    assert all(rows[f"eagle3#{j}"]["greedy_match_rate"] == 1.0 for j in (0, 1))
    assert "train.lr=0.003" in report["draft"]["sweep_jobs"]["1"]

    table = sweep_table(sweep)
    eagle = [r for r in table if r.get("drafter") == "eagle3"]
    assert [r["job"] for r in eagle] == [0, 1]
    for r in eagle:
        assert r["tau"] == rows[f"eagle3#{r['job']}"]["tau"]
        assert r["steps"] == 2 and r["tokens"] > 0 and r["minutes"] > 0 and 0 <= r["acc_0"] <= 1
    assert eagle[1]["overrides"] == "lr=0.003"  # the lever; the settings every job shares are left out

    assert table_main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and (sweep / "table.md").read_text().count("\n") == len(table) + 2
    assert (sweep / "tau.png").stat().st_size > 0


def test_the_table_refuses_a_folder_without_jobs(tmp_path):
    with pytest.raises(ConfigError, match="no sweep jobs"):
        sweep_table(tmp_path)


def test_the_levers_are_the_overrides_that_vary():
    jobs = [["a.x=1", "a.y=2"], ["a.x=1", "a.y=3"], ["a.x=1", "a.y=3", "b=4"]]
    assert varying_overrides(jobs) == [["a.y=2"], ["a.y=3"], ["a.y=3", "b=4"]]
    assert varying_overrides([["a=1"]]) == [["a=1"]]


def test_short_overrides_keep_the_last_key():
    assert short_overrides(["train.head_init=verifier", "ttt.ttt_steps=2", "seed=3"]) == \
        "head_init=verifier ttt_steps=2 seed=3"


def _quickstart_run(folder, budget_minutes, steps, tau, prompts):
    """A quickstart run folder as ``fledge quickstart`` leaves it: budget.json, train/metrics.jsonl,
    eval/report.json."""
    rates = BoxRates(cache_tokens_per_s=800.0, train_tokens_per_s=1000.0, decode_tokens_per_s=17.0,
                     train_dtype="bf16", probe_seconds=50.0)
    plan = BudgetPlan(budget_minutes * 60, rates, [100, 200], eval_rows=10, eval_new_tokens=96,
                sizes={"cache": 2, "train": 2.0, "eval": prompts},
                shapes={"draft_vocab_size": 1024 * budget_minutes} if budget_minutes > 20 else {},
                actual_s={"probe": 50.0, "cache": 100.0, "train": 60.0 * steps, "eval": 90.0, "export": 1.0})
    folder.mkdir(parents=True)
    plan.save_in(folder)
    (folder / "train").mkdir()
    lines = [{"step": 0, "time": 1000.0}]
    lines += [{"step": s, "time": 1000.0 + 60.0 * s, "loss": 3.0, "tokens_seen": 1000 * s} for s in range(1, steps + 1)]
    lines += [{"step": steps, "time": 1000.0 + 60.0 * steps, "eval/acc_0": 0.1 * steps}]
    (folder / "train" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "train" / "draft").mkdir()
    (folder / "train" / "draft" / "draft_config.json").write_text(json.dumps({"draft_vocab_size": 4096}))
    _report(folder / "eval", folder / "train", tau, prompts)


def _report(folder, draft, tau, prompts):
    drafters = {"eagle3": {"method": "tree", "tau": tau, "speedup": 1.1, "speedup_interval": [1.0, 1.2],
                           "vs_prompt_lookup": {"throughput_ratio": 0.9, "interval": [0.8, 1.0]}},
                "prompt_lookup": {"method": "chain", "tau": 1.4, "speedup": 1.2, "speedup_interval": [1.1, 1.3]}}
    report = {"draft": {"path": str(draft)}, "sets": {"mtbench": {"num_prompts": prompts, "drafters": drafters}}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report))


def test_the_budget_table_joins_runs_with_their_largest_evaluation(tmp_path, capsys):
    _quickstart_run(tmp_path / "qs20", 20, steps=2, tau=1.5, prompts=5)
    _quickstart_run(tmp_path / "qs60", 60, steps=6, tau=1.7, prompts=9)
    (tmp_path / "qs60" / "budget.json").rename(tmp_path / "qs60" / "plan.json")  # a run of fledge before the rename
    _report(tmp_path / "qs60_e24", tmp_path / "qs60" / "train", tau=1.9, prompts=24)  # the larger eval wins

    rows = budget_table([tmp_path / "qs20", tmp_path / "qs60", tmp_path / "qs60_e24"])
    eagle = {r["run"]: r for r in rows if r["drafter"] == "eagle3"}
    assert eagle["qs20"]["tau"] == 1.5 and eagle["qs20"]["prompts"] == 5 and eagle["qs20"]["budget"] == 20
    assert eagle["qs60"]["tau"] == 1.9 and eagle["qs60"]["prompts"] == 24
    assert eagle["qs60"]["report"] == str(tmp_path / "qs60_e24")
    assert eagle["qs60"]["steps"] == 6 and eagle["qs60"]["minutes"] == 6.0 and eagle["qs60"]["acc_0"] == pytest.approx(0.6)
    assert eagle["qs60"]["wall_minutes"] == (50 + 100 + 360 + 90 + 1) / 60
    assert eagle["qs60"]["vs_lookup"] == 0.9 and eagle["qs60"]["vs_lookup_interval"] == [0.8, 1.0]
    assert eagle["qs60"]["vocab"] == 60 * 1024  # the plan's choice
    assert eagle["qs20"]["vocab"] == 4096  # a plan that chose none (before fledge chose it): the draft's own

    out = tmp_path / "budget"
    assert budget_main([str(tmp_path / "qs20"), str(tmp_path / "qs60"), str(tmp_path / "qs60_e24"),
                        "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| qs60 | 60 | 2 | 2.00 | 61,440 | 6 | 6,000 | 6.0 |" in printed and "0.90x [0.80, 1.00]" in printed
    assert (out / "budget.md").read_text().count("\n") == len(rows) + 2
    assert (out / "budget.png").stat().st_size > 0
    assert budget_main(["--out"]) == 2


def test_a_named_evaluation_wins_over_the_quickstarts_own(tmp_path):
    _quickstart_run(tmp_path / "qs60", 60, steps=6, tau=1.7, prompts=35)  # its own: cut by its time limit
    _report(tmp_path / "ev_a", tmp_path / "qs60" / "train", tau=1.8, prompts=16)
    _report(tmp_path / "ev_b", tmp_path / "qs60" / "train", tau=1.9, prompts=24)
    for order in (["ev_a", "ev_b"], ["ev_b", "ev_a"]):
        rows = budget_table([tmp_path / "qs60", *(tmp_path / name for name in order)])
        eagle = next(r for r in rows if r["drafter"] == "eagle3")
        assert (eagle["tau"], eagle["prompts"], eagle["report"]) == (1.9, 24, str(tmp_path / "ev_b"))
    rows = budget_table([tmp_path / "qs60"])  # none named: the quickstart's own
    assert next(r for r in rows if r["drafter"] == "eagle3")["prompts"] == 35


def test_the_budget_table_refuses_what_it_cannot_place(tmp_path):
    _quickstart_run(tmp_path / "qs20", 20, steps=2, tau=1.5, prompts=5)
    _report(tmp_path / "stray", tmp_path / "elsewhere" / "train", tau=1.9, prompts=24)
    with pytest.raises(ConfigError, match="none of the runs given trained"):
        budget_table([tmp_path / "qs20", tmp_path / "stray"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a run nor an evaluation"):
        budget_table([tmp_path / "qs20", tmp_path / "empty"])
    with pytest.raises(ConfigError, match="no run among"):
        budget_table([tmp_path / "stray"])
