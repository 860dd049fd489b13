"""`fledge bench train`: it runs and reports, and its FLOP count agrees with torch's own FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fledge.launch.cli import run_stage
from fledge.models.draft import Eagle3Draft
from fledge.train.bench import TrainBenchConfig, counted_positions, synthetic_batch, synthetic_head, train_step_flops
from fledge.train.engine import TTTModule
from fledge.train.ttt import TTTConfig

TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            target_hidden_size=48, vocab_size=512, draft_vocab_size=128, seq_len=24, ttt_steps=3)


def test_flop_count_matches_torch_flop_counter():
    cfg = TrainBenchConfig(**TINY)
    config = cfg.draft_config()
    gen = torch.Generator().manual_seed(0)
    draft = Eagle3Draft(config, seed=0)
    head = synthetic_head(config, gen)
    # The explicit scores: their products are what torch's counter sees (it has no formula for the CPU flash
    # kernel, whose FLOPs are the same causal ones)
    module = TTTModule(draft, head, TTTConfig(ttt_steps=cfg.ttt_steps, attention="blocks"))
    batch = synthetic_batch(cfg, gen)
    with FlopCounterMode(display=False) as counter:
        loss, metrics = module(batch)
        loss.backward()
    counted = counted_positions(cfg)
    assert metrics["tokens"] == counted[0]  # every position whose target exists is counted
    # What runs as matrix products: the full T x T step-0 scores (the diagonal terms are element-wise).
    executed = train_step_flops(config, cfg.batch_size, cfg.seq_len, cfg.ttt_steps, counted, causal=False)
    assert counter.get_total_flops() == pytest.approx(executed["total"], rel=1e-9)
    # The model-FLOP count used for MFU only differs by counting the causal half of the scores and leaving out the
    # loss's dot products.
    model = train_step_flops(config, cfg.batch_size, cfg.seq_len, cfg.ttt_steps, counted)
    assert model["total"] < executed["total"]
    assert model["total"] - model["attention"] == executed["total"] - executed["attention"] - executed["loss dot products"]


def test_bench_runs_and_reports(capsys):
    out = run_stage("bench_train", [f"{k}={v}" for k, v in TINY.items()] + ["steps=1", "warmup=1", "matmul_size=256",
                                                                           "skip_slow_dtypes=false"])
    text = capsys.readouterr().out
    assert "tokens/s" in text and "MFU" in text
    assert [r["dtype"] for r in out["results"]] == ["fp32", "bf16"]
    cfg = TrainBenchConfig(**TINY)
    flops = train_step_flops(cfg.draft_config(), cfg.batch_size, cfg.seq_len, cfg.ttt_steps, counted_positions(cfg))
    for r in out["results"]:
        # Each figure is what its definition says, from the measured step time and the measured peak.
        assert r["flops_per_step"] == flops
        assert r["tokens_per_s"] == pytest.approx(cfg.batch_size * cfg.seq_len / r["step_s"], rel=1e-12)
        assert r["model_tflops_per_s"] == pytest.approx(flops["total"] / r["step_s"] / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / r["peak_tflops_per_s"], rel=1e-12)
        peak = out["peaks"][r["dtype"]]
        assert r["peak_tflops_per_s"] == pytest.approx(peak / 1e12, rel=1e-12)


def test_bench_config_is_checked():
    with pytest.raises(ValueError, match="dtypes"):
        TrainBenchConfig(dtypes=["fp16"])
