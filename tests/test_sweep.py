"""Sweeps: ``fledge train -m`` gives each job its own folder, ``fledge eval`` of the sweep folder evaluates every
job's draft side by side, and ``fledge sweep table`` joins the two into one table and a PNG."""

from __future__ import annotations

import json

import pytest

from fledge.core.errors import ConfigError
from fledge.launch.cli import run_stage
from fledge.launch.sweep import short_overrides, sweep_table, table_main, varying_overrides

from test_train_fixtures import build_cache, run_cli, shared_root, train_overrides


def test_a_training_sweep_its_evaluation_and_its_table(tmp_path_factory, tmp_path, smollm_tokenizer, capsys):
    cache = build_cache(shared_root(tmp_path_factory), smollm_tokenizer)
    sweep = tmp_path / "sweep"
    # output_dir is the fixtures' single-run folder; the sweep must not write there but into each job's folder.
    single = tmp_path / "never-written"
    args = [a for a in train_overrides(cache, single, **{"train.max_steps": 2, "eval.holdout": 2, "eval.every": 2})]
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
