"""Training configs: every shipped YAML composes, misspelt and inconsistent settings fail with a clear message,
the DeepSpeed JSON is generated from (or checked against) the typed config, and the LR schedule has its shape."""

from __future__ import annotations

import json

import pytest
from hydra.errors import ConfigCompositionException

from fledge.launch.cli import compose_config
from fledge.train.bench import TrainBenchConfig
from fledge.train.config import TrainConfig
from fledge.train.engine import EngineConfig, deepspeed_config, warmup_cosine
from fledge.train.loop import TrainJobConfig


def test_shipped_configs_compose():
    cfg = compose_config("train")
    assert isinstance(cfg, TrainJobConfig) and isinstance(cfg.train, TrainConfig)
    assert cfg.ttt.ttt_steps == 7 and cfg.ttt.step_decay == 0.8
    assert cfg.engine.kind == "single" and cfg.log.wandb_mode == "offline" and cfg.train.dtype == "auto"
    assert str(cfg.checkpoint_dir) == "runs/train/checkpoints" and str(cfg.jsonl_path) == "runs/train/metrics.jsonl"
    bench = compose_config("bench_train")
    assert isinstance(bench, TrainBenchConfig)
    assert (bench.hidden_size, bench.vocab_size, bench.draft_vocab_size) == (576, 49152, 32000)
    debug = compose_config("train", ["train.max_steps=3", "engine.kind=deepspeed", "engine.zero_stage=3"])
    assert debug.train.max_steps == 3 and debug.engine.zero_stage == 3


def test_misspelt_override_fails_loudly():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_config("train", ["train.lrr=1"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["validation.every=10", "validation.holdout=0"],
         r"validation\.every=10 needs held-out data: set validation\.holdout"),
        (["validation.holdout=5", "validation.cache_dir=/x"],
         r"validation\.holdout and validation\.cache_dir are alternatives"),
        (["engine.deepspeed_config=/x.json"], r"engine\.deepspeed_config is set but engine\.kind='single'"),
        (["train.min_lr=1.0"], r"train\.min_lr \(1\.0\) <= train\.lr"),
        (["train.dtype=fp16"], r"train\.dtype must be one of"),
        (["engine.kind=fsdp"], r"engine\.kind must be one of"),
        (["engine.zero_stage=4"], r"engine\.zero_stage must be 1, 2 or 3"),
        (["train.max_steps=0", "train.epochs=0"], r"train\.max_steps is 0, so train\.epochs must be > 0"),
        (["checkpoint.keep_last=0"], r"checkpoint\.keep_last >= 1"),
        (["log.wandb_mode=cloud"], r"log\.wandb_mode must be one of"),
    ],
)
def test_inconsistent_settings_name_the_fields(overrides, message):
    with pytest.raises(Exception, match=message):
        compose_config("train", overrides)


def test_generated_deepspeed_json():
    train = TrainConfig(max_steps=10, micro_batch_size=3, grad_accum=2, clip_norm=0.7, dtype="bf16")
    ds = deepspeed_config(train, EngineConfig(kind="deepspeed", zero_stage=3), world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 24 and ds["gradient_clipping"] == 0.7
    assert ds["zero_optimization"] == {"stage": 3}
    # bf16 is autocast with fp32 master weights, as in the other engines; no DeepSpeed optimizer / scheduler:
    # the client torch AdamW and warmup-cosine are passed in.
    assert ds["torch_autocast"]["enabled"] and not ds["bf16"]["enabled"]
    assert "optimizer" not in ds and "scheduler" not in ds


def test_user_deepspeed_json_is_checked_and_completed(tmp_path):
    train = TrainConfig(max_steps=10, micro_batch_size=2, grad_accum=1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}))
    ds = deepspeed_config(train, EngineConfig(kind="deepspeed", deepspeed_config=str(path)), world_size=2)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000 and ds["train_batch_size"] == 4
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=8 disagrees with the training config \(2"):
        deepspeed_config(train, EngineConfig(kind="deepspeed", deepspeed_config=str(path)), world_size=2)


def test_warmup_then_cosine_to_min_lr():
    f = warmup_cosine(total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_a_run_sized_by_time_follows_the_time_spent_or_the_steps_whichever_is_further():
    from fledge.train.stopping import TimeShare

    share = TimeShare(budget_minutes=1.0)  # 60 s, at most 110 steps
    f = warmup_cosine(total_steps=110, warmup_steps=10, min_ratio=0.1, share=share)
    step_only = warmup_cosine(total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert [f(s) for s in (0, 4, 60, 110)] == pytest.approx([step_only(s) for s in (0, 4, 60, 110)])  # no time yet
    share.spent_s = 30.0  # half the time spent at step 20: the schedule stands at step 55
    assert f(20) == pytest.approx(step_only(55)) and f(20) < step_only(20)
    assert f(80) == pytest.approx(step_only(80))  # the steps further along than the time
    share.spent_s = 3.0  # 5 % of the time, step 5.5: still in the warmup, which takes the same share of the time
    assert f(0) == pytest.approx(step_only(5.5)) == pytest.approx(0.65)
    share.spent_s = 61.0  # spent: the floor, at any step
    assert f(3) == pytest.approx(0.1) and share.fraction() == 1.0 and share.spent()
    assert not TimeShare().spent() and TimeShare().fraction() == 0.0  # a run sized by steps


def test_bf16_on_a_deepspeed_that_ignores_torch_autocast_is_refused():
    from fledge.core.errors import ConfigError
    from fledge.train.engine import MIN_DEEPSPEED, check_deepspeed_version

    with pytest.raises(ConfigError, match=r"DeepSpeed 0\.16\.9: it ignores the torch_autocast section"):
        check_deepspeed_version("0.16.9", "bf16")
    check_deepspeed_version("0.16.9", "fp32")
    check_deepspeed_version(MIN_DEEPSPEED, "bf16")
    import deepspeed  # the installed one must be new enough: pyproject.toml requires it

    check_deepspeed_version(deepspeed.__version__, "bf16")


def test_the_dtype_a_forward_ran_in_is_checked_against_the_request():
    """The module records the autocast dtype its first forward saw (else the weights'); a request the engine did not
    carry out (bf16 asked, fp32 ran) is refused naming both."""
    import torch

    from fledge.core.errors import ConfigError
    from fledge.models.draft import Eagle3Draft
    from fledge.train.bench import synthetic_batch, synthetic_head
    from fledge.train.engine import TTTModule, check_compute_dtype
    from fledge.train.ttt import TTTConfig

    shape = TrainBenchConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, target_hidden_size=48, vocab_size=512, draft_vocab_size=128, seq_len=8)
    gen = torch.Generator().manual_seed(0)
    batch = synthetic_batch(shape, gen)

    def module() -> TTTModule:
        return TTTModule(Eagle3Draft(shape.draft_config(), seed=0), synthetic_head(shape.draft_config(), gen),
                         TTTConfig(ttt_steps=1))

    plain = module()
    plain(batch)
    assert plain.compute_dtype == "float32" and check_compute_dtype(plain, "fp32", "single") == "float32"
    with pytest.raises(ConfigError, match="train.dtype=bf16 asks for bfloat16, but the deepspeed-zero2 engine's "
                                          "forward ran in float32"):
        check_compute_dtype(plain, "bf16", "deepspeed-zero2")
    autocast = module()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast(batch)
    assert autocast.compute_dtype == "bfloat16" and check_compute_dtype(autocast, "bf16", "single") == "bfloat16"
    with pytest.raises(ConfigError, match="ran in bfloat16"):
        check_compute_dtype(autocast, "fp32", "single")
