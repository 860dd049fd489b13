"""Every shipped config composes; the quickstart pipeline runs end to end on a tiny verifier and resumes."""

from __future__ import annotations

import json

import pytest
from hydra.errors import ConfigCompositionException

from launch.cli import CONF_DIR, STAGES, compose_config, main
from launch.quickstart import QuickstartConfig, run_pipeline, split_argv

from conftest import write_sharegpt_jsonl


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_composes(name):
    assert name in STAGES, f"conf/{name}.yaml has no stage in launch/cli.py"
    cfg = compose_config(name)
    assert type(cfg).__name__.endswith("Config")


def test_misspelt_override_fails_loudly():
    with pytest.raises(ConfigCompositionException):
        compose_config("cache", ["cache.dirr=x"])
    with pytest.raises(Exception, match="max_conversations"):
        compose_config("cache", ["data.max_conversations=lots"])


def test_cli_usage_and_unknown_command(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    assert "cache" in out and "quickstart" in out and "export check" in out
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_quickstart_argv_routes_stage_overrides():
    own, extra = split_argv(["run_dir=x", "train:train.epochs=3", "cache:data.max_length=64", "force=true"])
    assert own == ["run_dir=x", "force=true"]
    assert extra["train"] == ["train.epochs=3"] and extra["cache"] == ["data.max_length=64"]


def test_quickstart_pipeline_on_a_tiny_verifier(tmp_path, tiny_verifier_dir):
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 24, max_words=30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"the a of {i} to and"]}) + "\n" for i in range(2)))
    run = tmp_path / "qs"
    verifier = f"verifier.name_or_path={tiny_verifier_dir}"
    cfg = QuickstartConfig(
        run_dir=str(run),
        cache=[f"cache.dir={run}/cache", verifier, "verifier.dtype=float32", f"data.source={source}",
               "data.max_length=128", "cache.draft_vocab_size=128"],
        train=[f"cache_dir={run}/cache", f"output_dir={run}/train", "train.max_steps=3", "eval.holdout=2",
               "eval.every=2", "checkpoint.every=2", "ttt.ttt_steps=2", "log.wandb_mode=offline"],
        eval=[f"draft={run}/train", verifier, "verifier.dtype=float32", f"prompts=[{prompts}]",
              "eval.max_new_tokens=6", f"eval.out_dir={run}/eval", "eval.warmup_tokens=0"],
        export=[f"checkpoint={run}/train", f"out_dir={run}/export", f"report={run}/eval/report.json",
                f"verifier={tiny_verifier_dir}"],
    )
    first = run_pipeline(cfg)
    assert not any(t["skipped"] for t in first["timings"].values())
    report = json.loads((run / "eval" / "report.json").read_text())
    entry = report["sets"]["prompts"]["drafters"]["eagle3"]
    assert entry["greedy_match_rate"] == 1.0  # lossless whatever the draft's quality
    assert 1.0 <= entry["tau"] <= 1 + 5
    assert (run / "eval" / "acceptance.png").stat().st_size > 0
    assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    assert main_exit(["export", "check", str(run / "export"), "--verifier", str(tiny_verifier_dir)]) == 0
    # A rerun skips every finished stage.
    second = run_pipeline(cfg)
    assert all(t["skipped"] for t in second["timings"].values())


def main_exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


def test_exactness_command_runs_the_real_loops(capsys):
    from launch.cli import run_stage

    assert run_stage("eval_exactness", ["n_runs=150", "methods=[tree]", "drafts=[eagle]", "top_p=0.9"])
    out = capsys.readouterr().out
    assert "exactness tree: PASS" in out and "joint 1-2" in out
