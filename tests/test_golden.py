"""Golden numbers: a tiny fixed-seed training run whose losses were recorded, and must come out the same.

The other training tests compare runs with each other (resume against uninterrupted, DDP against one process), so
a change that moves every run alike (the loss, the initialisation, the data order, the LR schedule, AdamW's
settings) passes them all. This one compares against numbers written down once.

Recorded with commit c4a938d (before the package move), one thread, on an AMD EPYC with AVX2 (fp32): the values
did not change with two threads either. A different CPU's kernels may round differently in the last bits; the
tolerance (2e-5) allows for that and little more: a 10 % higher learning rate moves step 2 by 7.6e-4.
"""

from __future__ import annotations

import pytest

from fledge.launch.cli import run_stage

from conftest import read_jsonl
from test_train_fixtures import build_cache, shared_root, train_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

# (step, loss) of `fledge train` on build_cache()'s cache: 24 conversations, draft vocabulary 64, micro-batch 4,
# TTT 3, lr 3e-4 without warmup, cosine to 3e-5 over 6 steps, seed 0.
GOLDEN_LOSSES = [
    (1, 10.182371139526367),
    (2, 10.116716384887695),
    (3, 10.033170700073242),
    (4, 9.881755828857422),
    (5, 9.957779884338379),
    (6, 9.889848709106445),
]


def test_first_losses_match_the_recorded_run(tmp_path_factory, smollm_tokenizer, tmp_path):
    cache = build_cache(shared_root(tmp_path_factory), smollm_tokenizer)
    out = tmp_path / "golden"
    run_stage("train", train_overrides(cache, out, **{"train.max_steps": 6, "checkpoint.every": 0}))
    losses = [(r["step"], r["loss"]) for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [step for step, _ in losses] == [step for step, _ in GOLDEN_LOSSES]
    for (step, got), (_, want) in zip(losses, GOLDEN_LOSSES):
        assert got == pytest.approx(want, rel=2e-5, abs=0), f"step {step}"
