"""kill -9 at any moment, or SIGTERM (a preemption), resume, and end bitwise where an uninterrupted run ends (real
subprocesses)."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fledge.models.draft_folder import complete_checkpoints

from conftest import read_jsonl
from test_train_fixtures import REPO, build_cache, cli_command, cli_env, run_cli, shared_root, train_overrides, wait_for

RUN = {"train.max_steps": 10, "train.lr": 1e-2, "train.warmup_steps": 2, "checkpoint.every": 2,
       "checkpoint.keep_last": 2, "validation.every": 4, "validation.holdout": 4, "ttt.ttt_steps": 2}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_cache(shared_root(tmp_path_factory), smollm_tokenizer)


@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    run_cli(train_overrides(cache, out, **RUN))
    return out


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "draft" / "model.safetensors"))


def history(run: Path) -> list[tuple]:
    keys = ("step", "loss", "ploss_1", "acc_0", "grad_norm", "lr", "tokens_seen", "eval/loss")
    # Setup records ("params/...") are written at every (re)start; the step records must match.
    return [tuple(r.get(k) for k in keys) for r in read_jsonl(run / "metrics.jsonl") if "params/trainable" not in r]


def assert_same_run(run: Path, reference: Path) -> None:
    ref_w, got_w = weights(reference), weights(run)
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], got_w[k]), f"{k} differs after the interruption and resume"
    # The logs tell the same story: each step once, with the same losses, norms, LR and token counts.
    assert history(run) == history(reference)


@pytest.mark.slow
def test_kill9_anywhere_then_resume_is_bitwise_equal(cache, reference, tmp_path):
    run = tmp_path / "killed"
    args = train_overrides(cache, run, **RUN)
    ckpts = run / "checkpoints"

    # 1. SIGKILL in the middle of writing step 4's checkpoint: its folder stays a .tmp and does not count.
    proc = run_cli(args, env={"FLEDGE_TRAIN_FAULT": "save:4"}, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (ckpts / "step-000004.tmp").is_dir()
    assert [s for s, _ in complete_checkpoints(ckpts)] == [2]

    # 2. Resumed from step 2, then SIGKILLed from outside while training, as soon as step 4 is saved.
    p = subprocess.Popen(cli_command(args), cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(ckpts / "step-000004", p)
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err.decode()[-3000:]
    assert not (run / "draft").exists(), "the run finished before the kill; the test needs a slower run"
    assert not (ckpts / "step-000004.tmp").exists(), "the resumed run cleans up the stale folder"

    # 3. Resumed to the end.
    run_cli(args)
    assert_same_run(run, reference)
    assert [s for s, _ in complete_checkpoints(ckpts)] == [8, 10]


@pytest.mark.slow
def test_sigterm_saves_at_a_step_boundary_exits_0_and_resumes_bitwise(cache, reference, tmp_path):
    run = tmp_path / "preempted"
    args = train_overrides(cache, run, **RUN)
    ckpts = run / "checkpoints"
    p = subprocess.Popen(cli_command(args), cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    wait_for(ckpts / "step-000002", p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    stopped = re.search(r"preempted by SIGTERM at step (\d+) of 10: saved ([^;]+);", out)
    assert stopped, f"the run finished before the signal, or did not stop on it (exit {p.returncode}):\n{out[-3000:]}"
    assert p.returncode == 0, out[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < 10 and Path(stopped.group(2)) == ckpts / f"step-{step:06d}"
    assert [s for s, _ in complete_checkpoints(ckpts)][-1] == step
    assert not (run / "draft").exists()

    proc = run_cli(args)  # the same command again
    assert f"resumed from {ckpts / f'step-{step:06d}'}" in proc.stdout + proc.stderr
    assert_same_run(run, reference)
