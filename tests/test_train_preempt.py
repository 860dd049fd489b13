"""Preemption: SIGTERM / SIGUSR1 during training end the run at the next step boundary with a checkpoint and exit
status 0, and the resumed run ends bitwise where an uninterrupted one ends; launch/slurm.sbatch passes SLURM's
notice on to training and requeues the job. (The signal from outside a real ``fledge train`` process is in
test_train_resume.py; one rank of two signalled, in test_train_dist.py.)"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fledge.launch.cli import run_stage
from fledge.models.draft_folder import complete_checkpoints
from fledge.train import sampler
from fledge.train.stopping import SIGNAL, TIME_LIMIT, Preempted, PreemptionSignals, stop_reason

from conftest import read_jsonl
from test_train_fixtures import REPO, build_cache, cli_env, shared_root, train_overrides, wait_for

RUN = {"train.max_steps": 6, "train.grad_accum": 2, "train.lr": 1e-2, "train.warmup_steps": 1, "ttt.ttt_steps": 2,
       "checkpoint.every": 2, "checkpoint.keep_last": 3, "validation.every": 2, "validation.holdout": 4}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_cache(shared_root(tmp_path_factory), smollm_tokenizer)


def test_signals_only_raise_a_flag_inside_and_the_previous_handlers_come_back():
    seen: list[int] = []
    before_term = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        cpu = torch.device("cpu")
        with PreemptionSignals() as signals:
            assert signals.installed and signals.received is None
            assert stop_reason(None, time.perf_counter(), signals, cpu) is None
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs in this (main) thread before the next line
            assert signals.received == signal.SIGUSR1 and seen == []
            # A signal outranks the time limit: the run is about to be killed, and a preempted run resumes.
            assert stop_reason(1e-9, time.perf_counter() - 1, signals, cpu) == SIGNAL
        assert not signals.installed
        assert signal.getsignal(signal.SIGTERM) == before_term
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler that was there before gets it again
        assert seen == [signal.SIGUSR1]
        assert stop_reason(1e-9, time.perf_counter() - 1, signals, cpu) == SIGNAL  # the flag itself stays
        assert stop_reason(1e-9, time.perf_counter() - 1, PreemptionSignals(), cpu) == TIME_LIMIT
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_preempted_mid_step_saves_that_step_exits_0_and_resumes_bitwise(cache, tmp_path, monkeypatch, caplog):
    reference = tmp_path / "reference"
    run_stage("train", train_overrides(cache, reference, **RUN))

    # SIGUSR1 arrives between the two micro-batches of step 3 (before the 6th of the run): step 3 completes, is
    # logged and checkpointed (off the checkpoint.every=2 cadence), and the run stops there.
    real_next = sampler.Prefetcher.next
    calls = {"n": 0}

    def next_then_signal(self, indices, ahead=None):
        calls["n"] += 1
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_next(self, indices, ahead)

    monkeypatch.setattr(sampler.Prefetcher, "next", next_then_signal)
    handler_before = signal.getsignal(signal.SIGUSR1)
    run = tmp_path / "preempted"
    with caplog.at_level(logging.WARNING), pytest.raises(Preempted) as stopped:
        run_stage("train", train_overrides(cache, run, **RUN))
    assert stopped.value.code == 0 and stopped.value.step == 3 and stopped.value.signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == handler_before
    assert "preempted by SIGUSR1 at step 3 of 6" in caplog.text and "rerun the same command" in caplog.text
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")] == [2, 3]
    assert not (run / "draft").exists(), "a preempted run is not finished: no final draft"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3]

    monkeypatch.setattr(sampler.Prefetcher, "next", real_next)
    result = run_stage("train", train_overrides(cache, run, **RUN))
    assert result.step == 6
    want = load_file(str(reference / "draft" / "model.safetensors"))
    got = load_file(str(run / "draft" / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs after preemption and resume"
    keys = ("step", "loss", "ploss_1", "acc_0", "grad_norm", "lr", "tokens_seen", "eval/loss")
    history = [[tuple(r.get(k) for k in keys) for r in read_jsonl(p / "metrics.jsonl") if "params/trainable" not in r]
               for p in (reference, run)]
    assert history[0] == history[1]


@pytest.mark.slow
def test_slurm_script_passes_the_notice_on_to_training_and_requeues_the_job(cache, tmp_path):
    """launch/slurm.sbatch with stand-ins for ``srun`` (it runs the task here, by ``exec``, so that a signal to
    "srun" reaches torchrun as srun's forwarding does) and ``scontrol`` (it records the requeue): SIGUSR1 to the
    batch shell, what ``--signal=B:USR1`` sends, goes through torchrun to the worker, which saves the step it
    stops at; the script requeues the job and exits 0. SLURM itself is not exercised."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                                  'export SLURM_NODEID=0\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\ncase $1 in\n  show) echo localhost ;;\n'
                                      '  requeue) echo "$2" >> "$REQUEUED" ;;\nesac\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    run = tmp_path / "run"
    args = train_overrides(cache, run, **{**RUN, "train.max_steps": 12, "checkpoint.every": 1, "validation.every": 0})
    env = cli_env({"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node0",
                   "SLURM_NNODES": "1", "STAGES": "train", "GPUS_PER_NODE": "1", "FLEDGE_ROOT": str(REPO),
                   "MASTER_PORT": "29573", "REQUEUED": str(tmp_path / "requeued")})
    p = subprocess.Popen(["bash", str(REPO / "launch" / "slurm.sbatch"), *args], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(run / "checkpoints" / "step-000002", p)
    p.send_signal(signal.SIGUSR1)
    out, _ = p.communicate(timeout=300)
    stopped = re.search(r"preempted by SIGUSR1 at step (\d+) of 12", out)
    assert stopped, f"training did not stop on the notice (exit {p.returncode}):\n{out[-4000:]}"
    assert p.returncode == 0, out[-4000:]
    assert (tmp_path / "requeued").read_text().split() == ["4242"]
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")][-1] == int(stopped.group(1))
    assert not (run / "draft").exists()
