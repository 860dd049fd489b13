"""Every shipped config composes; the quickstart pipeline runs end to end on a tiny verifier and resumes."""

from __future__ import annotations

import importlib
import json

import pytest
from hydra.errors import ConfigCompositionException

from fledge.launch.cli import CONF_DIR, STAGES, compose_config, main
from fledge.launch.quickstart import run_pipeline, split_argv

from conftest import main_exit, tiny_pipeline


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_composes(name):
    assert name in STAGES, f"conf/{name}.yaml has no stage in launch/cli.py"
    cfg = compose_config(name)
    module, _, cls = STAGES[name].config.partition(":")
    assert isinstance(cfg, getattr(importlib.import_module(module), cls))


PRESETS = sorted(p.stem for p in (CONF_DIR / "preset").glob("*.yaml") if p.stem != "none")
PRESET_STAGES = ["cache", "eval", "export", "regenerate", "train", "tune"]
PRESET_PARTS = ["data", "states", "verifier"]
"""The job's parts, each defined once per preset and composed into the stages that read it."""
DATA_STAGES = ["cache", "train", "plan"]


def test_presets_cover_the_real_jobs():
    assert PRESETS == ["llama3.1-8b-instruct", "llama3.3-70b-instruct", "qwen3-30b-a3b", "qwen3-8b"]
    assert sorted(p.name for p in (CONF_DIR / "preset").iterdir() if p.is_dir()) == sorted(PRESET_STAGES + PRESET_PARTS)
    for folder in PRESET_STAGES + PRESET_PARTS:
        assert sorted(p.stem for p in (CONF_DIR / "preset" / folder).glob("*.yaml")) == PRESETS
    # Defined once: no stage file restates the verifier, and only regenerate names its own data source.
    for stage in PRESET_STAGES:
        for preset in PRESETS:
            text = (CONF_DIR / "preset" / stage / f"{preset}.yaml").read_text()
            assert "name_or_path" not in text and "max_length" not in text, f"preset/{stage}/{preset}.yaml"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_stage_of_a_preset_names_the_same_job(preset, monkeypatch):
    """Every stage, training (online or from the cache) included, composes the preset's verifier, data, template
    settings, lengths and draft vocabulary: a training stage that left one out would train another model."""
    monkeypatch.setenv("FLEDGE_RUNS", "/shared/runs")
    cfg = {stage: compose_config(stage, [f"preset={preset}"]) for stage in PRESET_STAGES + ["plan"]}
    model = {"llama3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct", "qwen3-8b": "Qwen/Qwen3-8B",
             "llama3.3-70b-instruct": "meta-llama/Llama-3.3-70B-Instruct", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B"}[preset]
    for stage in ("regenerate", "cache", "train", "plan", "eval", "tune"):
        assert cfg[stage].verifier.name_or_path == model, stage
        assert cfg[stage].verifier.device_map == ("auto" if "70b" in preset else None), stage
        assert cfg[stage].verifier.dtype == "auto", stage
    max_length = 2048 if preset.startswith("qwen3") else 4096
    thinking = {"enable_thinking": False} if "qwen3" in preset else {}
    root = f"/shared/runs/{preset}"
    for stage in DATA_STAGES:
        data = cfg[stage].data
        size = 500_000 if preset == "llama3.1-8b-instruct" else None  # the published-scale job
        assert (data.source, data.max_length, data.max_conversations) == (
            f"{root}/regen/conversations.jsonl", max_length, size), stage
        assert data.chat_template_kwargs == thinking, stage
        assert (cfg[stage].cache.draft_vocab_size, cfg[stage].cache.storage_dtype) == (32000, "bfloat16"), stage
    # regenerate answers the prompts (ShareGPT) with the same template and length; eval and tune prompt the same way
    regen = cfg["regenerate"].data
    assert (regen.max_length, regen.chat_template_kwargs) == (max_length, thinking)
    if preset == "llama3.1-8b-instruct":  # 500k prompts: the embedded ShareGPT and two Hub sets, weights in prompts
        assert regen.max_conversations == 500_000 == sum(regen.sources.values()) and regen.sources["sharegpt"] < 17_322
    else:
        assert regen.source == "sharegpt" and regen.sources is None
    assert cfg["eval"].eval.chat_template_kwargs == cfg["tune"].chat_template_kwargs == thinking
    train = cfg["train"]
    epochs = 3 if preset == "llama3.1-8b-instruct" else 10  # 500k conversations: 3 epochs (speculators #751)
    assert (train.train.lr, train.train.epochs, train.train.micro_batch_size, train.ttt.ttt_steps) == (
        1e-4, epochs, 1, 7)
    assert train.engine.kind == "deepspeed"
    assert train.engine.zero_stage == (3 if "70b" in preset else 2)
    assert train.train.dtype == "bf16"
    # the stages hand their outputs on: regenerate -> cache -> train -> eval -> export, all under $FLEDGE_RUNS
    assert cfg["regenerate"].regenerate.out_dir == f"{root}/regen"
    assert train.cache_dir == cfg["cache"].cache.dir == f"{root}/cache"
    assert cfg["eval"].draft == cfg["tune"].draft == cfg["export"].draft == train.output_dir == f"{root}/train"
    assert cfg["export"].report == f"{cfg['eval'].eval.out_dir}/report.json"
    # online training of a preset is the same job as its cache
    online = compose_config("train", [f"preset={preset}", "data.mode=online"])
    assert (online.verifier.name_or_path, online.data.source, online.data.max_length) == (
        model, f"{root}/regen/conversations.jsonl", max_length)
    # a command-line override still wins over the preset
    assert compose_config("train", [f"preset={preset}", "train.lr=3e-5"]).train.lr == 3e-5


def test_an_unknown_preset_names_the_choices():
    with pytest.raises(Exception, match="qwen3-8b"):
        compose_config("train", ["preset=qwen3-9b"])


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
    cfg = tiny_pipeline(tmp_path, tiny_verifier_dir, 24, ["regenerate", "cache", "train", "eval", "export"])
    run = tmp_path / "qs"
    first = run_pipeline(cfg)
    assert not any(t["skipped"] for t in first["timings"].values())
    assert list(first["timings"]) == ["regenerate", "cache", "train", "eval", "export"]
    # the cache was built on the verifier's answers, not on the source's
    cache_manifest = json.loads((run / "cache" / "manifest.json").read_text())
    assert json.dumps(cache_manifest).count(f"{run}/regen/conversations.jsonl") >= 1
    report = json.loads((run / "eval" / "report.json").read_text())
    entry = report["sets"]["prompts"]["drafters"]["eagle3"]
    assert entry["greedy_match_rate"] == 1.0  # lossless whatever the draft's quality
    # τ is the mean of (accepted + 1) over the verifier calls that the histogram counts.
    histogram = entry["histogram"]
    assert sum(histogram) == entry["rounds"] == entry["verifier_calls"]
    assert entry["tau"] == pytest.approx(sum((k + 1) * n for k, n in enumerate(histogram)) / sum(histogram))
    # Every round commits its accepted drafts and one token of the verifier's; only the last may be cut short.
    prompts_run = report["sets"]["prompts"]["num_prompts"]
    assert entry["tokens"] <= entry["tau"] * entry["rounds"] < entry["tokens"] + prompts_run * (1 + 5)
    assert (run / "eval" / "acceptance.png").stat().st_size > 0
    assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    assert main_exit(["export", "check", str(run / "export"), "--verifier", str(tiny_verifier_dir)]) == 0
    # A rerun skips every finished stage.
    second = run_pipeline(cfg)
    assert all(t["skipped"] for t in second["timings"].values())


def test_exactness_command_runs_the_real_loops(capsys):
    from fledge.launch.cli import run_stage

    assert run_stage("eval_exactness", ["n_runs=150", "methods=[tree]", "drafts=[eagle]", "top_p=0.9"])
    out = capsys.readouterr().out
    assert "exactness tree: PASS" in out and "joint 1-2" in out
