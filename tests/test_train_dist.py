"""Two ranks on gloo (DDP, DeepSpeed ZeRO-1/2/3 with DS_ACCELERATOR=cpu) against one process on the same global batch.

One process with ``grad_accum=2`` and two ranks with ``grad_accum=1`` see the same two micro-batches per step (see
train/sampler.py), and so do one process with ``grad_accum=4`` and two ranks with ``grad_accum=2``; their losses
must agree up to the order of floating-point sums: the all-reduce adds per-rank gradients where one process
accumulates them. Tolerance: losses within 1e-5 relative, final weights within 1e-5 absolute (in practice they agree
to ~1e-7). Also: DDP all-reduces once per step, on the last micro-batch, and a preemption signal that reaches one
rank stops both at the same step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fledge.models.draft_folder import complete_checkpoints, load_draft

from conftest import read_jsonl
from test_train_fixtures import REPO, build_cache, cli_command, cli_env, run_cli, shared_root, train_overrides, wait_for

pytestmark = pytest.mark.slow

COMMON = {"train.max_steps": 4, "train.micro_batch_size": 2, "train.lr": 1e-2, "train.warmup_steps": 1,
          "ttt.ttt_steps": 2, "checkpoint.every": 2, "validation.every": 2, "validation.holdout": 4}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_cache(shared_root(tmp_path_factory), smollm_tokenizer)


@pytest.fixture(scope="module")
def single(cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_cli(train_overrides(cache, out, **{**COMMON, "train.grad_accum": 2}))
    return out


@pytest.fixture(scope="module")
def single_accum4(cache, tmp_path_factory) -> Path:
    """One process seeing what two ranks with grad_accum=2 see together."""
    out = tmp_path_factory.mktemp("single4") / "run"
    run_cli(train_overrides(cache, out, **{**COMMON, "train.grad_accum": 4}))
    return out


def losses(run: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in read_jsonl(run / "metrics.jsonl") if key in r]


def assert_matches_single(run: Path, single: Path) -> None:
    assert losses(run) == pytest.approx(losses(single), rel=1e-5)
    assert losses(run, "grad_norm") == pytest.approx(losses(single, "grad_norm"), rel=1e-5)
    assert losses(run, "eval/loss") == pytest.approx(losses(single, "eval/loss"), rel=1e-5)
    assert len(losses(run)) == 4
    got, want = load_file(str(run / "draft" / "model.safetensors")), load_file(str(single / "draft" / "model.safetensors"))
    # 1e-4 is 1 % of one step at lr 1e-2: a wrong reduction (a sum for a mean, a missed micro-batch) moves weights by
    # about a step. Adam divides by sqrt(v), so where a gradient is near 0 the ranks' other summation order can move
    # an element by more than 1e-5 (1.5e-5 in one of 2048 on an AMX Xeon), though losses agree to 1e-5.
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4, msg=k)
    setup = read_jsonl(run / "metrics.jsonl")[0]
    assert setup["params/in_optimizer"] == setup["params/trainable"], "the frozen embedding must stay out of the optimizer"


def test_ddp_two_ranks_match_single_process(cache, single, tmp_path):
    out = tmp_path / "ddp"
    run_cli(train_overrides(cache, out, **{**COMMON, "engine.kind": "ddp"}), nproc=2)
    assert_matches_single(out, single)
    assert {p.name for p in (out / "checkpoints" / "step-000004").glob("rng-*.pt")} == {"rng-00000.pt", "rng-00001.pt"}


@pytest.mark.parametrize("kind", ["ddp", "deepspeed"])
def test_two_ranks_accumulating_two_micro_batches_match_single_process(cache, single_accum4, tmp_path, kind):
    out = tmp_path / kind
    extra = {"engine.kind": kind, "train.grad_accum": 2} | ({"engine.zero_stage": 2} if kind == "deepspeed" else {})
    run_cli(train_overrides(cache, out, **{**COMMON, **extra}), nproc=2)
    assert_matches_single(out, single_accum4)


def test_ddp_all_reduces_on_the_last_micro_batch_only(tmp_path):
    """DDP prepares its all-reduce in the forward: with only the backward inside no_sync, every micro-batch would
    be all-reduced (the same result, at grad_accum times the traffic)."""
    run_worker("count_all_reduces", "ddp", tmp_path, 2)
    for rank in (0, 1):
        first, both = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert first == 0, f"rank {rank}: {first} bucket all-reduces inside the accumulation window"
        assert both > 0, f"rank {rank}: no all-reduce on the last micro-batch"
        # the group waits engine.timeout_minutes (60), not torch's 10, for rank 0's first load of a large verifier
        assert json.loads((tmp_path / f"timeout-{rank}.json").read_text()) == 3600


def run_worker(job: str, kind: str, out: Path, nproc: int) -> subprocess.CompletedProcess:
    """tests/dist_worker.py under torchrun (or alone for nproc=1); a hang fails at the timeout instead of blocking."""
    worker = str(Path(__file__).with_name("dist_worker.py"))
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    proc = subprocess.run([*launch, worker, job, kind, str(out)], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_a_rank_with_nothing_counted_runs_the_same_collectives_and_matches_one_process(tmp_path, kind):
    """Rank 1's micro-batch has no counted position. Its head and norm still run (with weight 0), so DDP's buckets
    and ZeRO-3's gathers match rank 0's: the step finishes, and equals one process accumulating both micro-batches.
    (Skipping the head there left rank 1's last bucket unready: DDP hung in the all-reduce.)"""
    run_worker("empty_rank", "single", tmp_path, 1)
    run_worker("empty_rank", kind, tmp_path, 2)
    want = json.loads((tmp_path / "single-rank-0.json").read_text())
    ranks = [json.loads((tmp_path / f"{kind}-rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["losses"][0] for r in ranks] == pytest.approx(want["losses"], rel=1e-6)
    assert ranks[1]["losses"] == [0.0]
    assert ranks[0]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    got, ref = load_file(str(tmp_path / f"{kind}.safetensors")), load_file(str(tmp_path / "single.safetensors"))
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6, msg=k)


def test_a_signal_to_one_rank_stops_both_at_the_same_step_and_the_run_resumes(cache, single, tmp_path):
    """SIGUSR1 to rank 1 only (its process, not torchrun): the flag is OR-reduced, so rank 0 stops after the same
    step, both save it, torchrun exits 0, and the relaunched run ends as the uninterrupted one."""
    import psutil

    out = tmp_path / "ddp"
    args = train_overrides(cache, out, **{**COMMON, "engine.kind": "ddp", "checkpoint.every": 1})
    p = subprocess.Popen(cli_command(args, nproc=2), cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_for(out / "checkpoints" / "step-000001", p)
    workers = [w for w in psutil.Process(p.pid).children(recursive=True) if w.environ().get("RANK") == "1"]
    assert len(workers) == 1, workers
    os.kill(workers[0].pid, signal.SIGUSR1)
    log, _ = p.communicate(timeout=300)
    stopped = re.search(r"preempted by a signal to another rank at step (\d+) of 4", log)
    assert stopped, f"no preemption (exit {p.returncode}); the run may have finished before the signal:\n{log[-4000:]}"
    assert p.returncode == 0, log[-4000:]
    step = int(stopped.group(1))
    last = out / "checkpoints" / f"step-{step:06d}"
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")][-1] == step
    assert {f.name for f in last.glob("rng-*.pt")} == {"rng-00000.pt", "rng-00001.pt"}
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r][-1] == step
    assert not (out / "draft").exists()
    run_cli(args, nproc=2)
    assert_matches_single(out, single)


def test_two_ranks_sized_by_time_stop_at_the_same_step_on_rank_0s_clock(cache, tmp_path):
    """A run sized by time under DDP: every rank takes rank 0's seconds (one all-reduce per step), so both stop
    after the same step (a split would hang in the next collective) with the schedule at its floor."""
    out = tmp_path / "timed"
    timed = {"engine.kind": "ddp", "train.max_steps": 100_000, "train.time_budget_minutes": 0.05,
             "train.min_lr": 1e-3, "checkpoint.every": 0}
    run_cli(train_overrides(cache, out, **{**COMMON, **timed}), nproc=2)
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "lr" in r]
    assert 1 <= records[-1]["step"] < 100_000 and records[-1]["lr"] == pytest.approx(1e-3)
    (step, last), = complete_checkpoints(out / "checkpoints")
    assert step == records[-1]["step"] and {f.name for f in last.glob("rng-*.pt")} == {"rng-00000.pt", "rng-00001.pt"}
    assert torch.load(last / "train_state.pt", weights_only=True)["seconds"] >= 3.0


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


def test_deepspeed_bf16_runs_in_bf16_and_a_json_that_turns_it_off_is_refused(cache, tmp_path):
    """The installed DeepSpeed carries train.dtype=bf16 into its forward (recorded from the forward itself, with the
    engine and versions); a user JSON whose torch_autocast section is off would train in fp32 and is refused."""
    import deepspeed

    out = tmp_path / "bf16"
    base = {**COMMON, "train.max_steps": 1, "validation.every": 0, "engine.kind": "deepspeed", "train.dtype": "bf16"}
    run_cli(train_overrides(cache, out, **base))
    setup = read_jsonl(out / "metrics.jsonl")[0]
    assert (setup["engine"], setup["compute_dtype"], setup["world_size"]) == ("deepspeed-zero2", "bfloat16", 1)
    assert setup["version/deepspeed"] == deepspeed.__version__

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 1}, "torch_autocast": {"enabled": False}}))
    proc = run_cli(train_overrides(cache, tmp_path / "off", **base, **{"engine.deepspeed_config": ds_json}),
                   check=False)
    assert proc.returncode != 0
    assert "train.dtype=bf16 asks for bfloat16, but the deepspeed-zero1 engine's forward ran in float32" in proc.stderr
