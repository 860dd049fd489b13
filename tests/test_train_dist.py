"""Two ranks on gloo (DDP, DeepSpeed ZeRO-1/2/3 with DS_ACCELERATOR=cpu) against one process on the same global batch.

One process with ``grad_accum=2`` and two ranks with ``grad_accum=1`` see the same two micro-batches per step (see
train/sampler.py), so their losses must agree up to the order of floating-point sums: the all-reduce adds two
per-rank gradients where one process accumulates them. Tolerance: losses within 1e-5 relative, final weights
within 1e-5 absolute (in practice they agree to ~1e-7).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fledge.models.draft_folder import complete_checkpoints, load_draft

from conftest import read_jsonl
from test_train_fixtures import build_cache, run_cli, shared_root, train_overrides

pytestmark = pytest.mark.slow

COMMON = {"train.max_steps": 4, "train.micro_batch_size": 2, "train.lr": 1e-2, "train.warmup_steps": 1,
          "ttt.ttt_steps": 2, "checkpoint.every": 2, "eval.every": 2, "eval.holdout": 4}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_cache(shared_root(tmp_path_factory), smollm_tokenizer)


@pytest.fixture(scope="module")
def single(cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_cli(train_overrides(cache, out, **{**COMMON, "train.grad_accum": 2}))
    return out


def losses(run: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in read_jsonl(run / "metrics.jsonl") if key in r]


def assert_matches_single(run: Path, single: Path) -> None:
    assert losses(run) == pytest.approx(losses(single), rel=1e-5)
    assert losses(run, "grad_norm") == pytest.approx(losses(single, "grad_norm"), rel=1e-5)
    assert losses(run, "eval/loss") == pytest.approx(losses(single, "eval/loss"), rel=1e-5)
    assert len(losses(run)) == 4
    got, want = load_file(str(run / "draft" / "model.safetensors")), load_file(str(single / "draft" / "model.safetensors"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    setup = read_jsonl(run / "metrics.jsonl")[0]
    assert setup["params/in_optimizer"] == setup["params/trainable"], "the frozen embedding must stay out of the optimizer"


def test_ddp_two_ranks_match_single_process(cache, single, tmp_path):
    out = tmp_path / "ddp"
    run_cli(train_overrides(cache, out, **{**COMMON, "engine.kind": "ddp"}), nproc=2)
    assert_matches_single(out, single)
    assert {p.name for p in (out / "checkpoints" / "step-000004").glob("rng-*.pt")} == {"rng-00000.pt", "rng-00001.pt"}


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_under_torchrun_matches_single_process(cache, single, tmp_path, stage):
    out = tmp_path / f"zero{stage}"
    run_cli(train_overrides(cache, out, **{**COMMON, "engine.kind": "deepspeed", "engine.zero_stage": stage}), nproc=2)
    assert_matches_single(out, single)
    step = out / "checkpoints" / "step-000004"
    assert (step / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    assert (step / "model.safetensors").is_file()  # the export copy beside DeepSpeed's own state


def test_deepspeed_zero3_under_deepspeed_launcher_killed_and_resumed(cache, single, tmp_path):
    out = tmp_path / "zero3"
    args = train_overrides(cache, out, **{**COMMON, "engine.kind": "deepspeed", "engine.zero_stage": 3})
    # Both ranks SIGKILL themselves while writing step 4's checkpoint; the launcher reports the failure.
    proc = run_cli(args, nproc=2, launcher="deepspeed", env={"FLEDGE_TRAIN_FAULT": "save:4"}, check=False)
    assert proc.returncode != 0
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [2]
    assert not (out / "draft").exists()
    # Relaunched: resumes from DeepSpeed's step-2 checkpoint (partitioned parameters and optimizer state).
    proc = run_cli(args, nproc=2, launcher="deepspeed")
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert_matches_single(out, single)
    draft = load_draft(out)  # ZeRO-3 partitions parameters: the saved weights were gathered, not empty shards
    assert draft.fc.weight.abs().sum() > 0


def test_launch_scripts(cache, single, tmp_path):
    """launch/torchrun.sh (DDP) and launch/deepspeed.sh (ZeRO-2) pass overrides through and train the same steps."""
    import subprocess

    from test_train_fixtures import REPO, cli_env

    for script, extra in (("torchrun.sh", {"engine.kind": "ddp"}), ("deepspeed.sh", {"engine.zero_stage": 2})):
        out = tmp_path / script
        args = train_overrides(cache, out, **{**COMMON, "train.max_steps": 2, **extra})
        env = cli_env({"MASTER_PORT": "29563"})
        proc = subprocess.run([str(REPO / "launch" / script), "2", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        # The 2-step run shares its first step (before any LR difference of its shorter cosine) with the 4-step one.
        assert losses(out)[:1] == pytest.approx(losses(single)[:1], rel=1e-5)
        assert (out / "draft" / "model.safetensors").is_file()


def test_deepspeed_single_process_with_a_user_json(cache, tmp_path):
    """No launcher at all (DeepSpeed gets a one-rank group), and the user's JSON with its own optimizer section:
    DeepSpeed builds that optimizer and fledge's warmup-cosine still drives its learning rate."""
    import json

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}},
    }))
    out = tmp_path / "run"
    run_cli(train_overrides(cache, out, **{**COMMON, "train.max_steps": 3, "train.warmup_steps": 2,
                                           "engine.kind": "deepspeed", "engine.deepspeed_config": ds_json}))
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    # The LR logged after step s is the schedule's multiplier for step s times the JSON's lr: warmup 2/2, then the
    # cosine's start and its end (train.min_lr).
    assert [r["lr"] for r in records] == pytest.approx([1e-2, 1e-2, 3e-5])
    assert records[-1]["loss"] < records[0]["loss"]
