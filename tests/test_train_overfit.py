"""The draft overfits a handful of cached conversations through the real loop (acc_0 > 0.95).

Slow (~1-3 min on 2 shared cores); the fast smoke version is in test_train_loop.py (the loss drops in 4 steps).
"""

from __future__ import annotations

import pytest

from fledge.launch.cli import run_stage

from conftest import read_jsonl
from test_train_fixtures import build_cache, shared_root, train_overrides


@pytest.mark.slow
def test_draft_overfits_a_tiny_cache(tmp_path_factory, smollm_tokenizer, tmp_path):
    # Six conversations (~700 tokens), one micro-batch per step, a constant high LR and no clipping.
    cache = build_cache(shared_root(tmp_path_factory), smollm_tokenizer, conversations=6)
    out = tmp_path / "run"
    result = run_stage(
        "train",
        train_overrides(
            cache, out, **{"train.max_steps": 90, "train.micro_batch_size": 8, "train.lr": 1e-2,
                           "train.min_lr": 1e-2, "train.clip_norm": 0, "train.warmup_steps": 0,
                           "ttt.ttt_steps": 3, "checkpoint.every": 0, "log.every": 10}
        ),
    )
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert records[0]["acc_0"] < 0.3
    assert result.last["acc_0"] > 0.95, [round(r["acc_0"], 3) for r in records]
    assert result.last["acc_2"] > 0.9  # the unrolled steps learn too
    assert result.last["tau_sim"] > 3.5  # 1 + 0.95 + 0.95^2 + 0.95^3 ~ 3.7
    assert result.last["loss"] < 0.25 * records[0]["loss"]
