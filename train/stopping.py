"""Ending a run before its last step: ``train.time_budget_minutes`` (a run sized by time), ``train.time_limit_minutes``,
or a preemption signal (SIGTERM, SIGUSR1).

A run sized by time (``TimeShare``) ends at the first step boundary after its budget is spent, and its learning rate's
cosine follows the share of that budget spent (``train/engine.py: warmup_cosine``): a box faster than predicted trains
more steps instead of ending early, a slower one fewer, and both end their schedule at its floor. The seconds counted
are rank 0's, handed to every rank in the step's one all-reduce, so that every rank takes the same learning rate
and stops at the same step; a checkpoint records them (``TrainState.seconds``) and a resumed run goes on from there.

A scheduler about to take the machines back sends a signal first (SLURM at ``--signal=...@seconds`` before the time
limit, ``scancel``, a preemption, Kubernetes on eviction: SIGTERM). While the training loop runs,
``PreemptionSignals`` turns those signals into a flag instead of death; the loop reads it once per optimizer step
through ``stop_reason``, saves a checkpoint of that step and raises ``Preempted``: the process exits with status 0
and a rerun of the same command resumes from that checkpoint (``checkpoint.resume``). Under several ranks the
decision is collective, so that every rank stops after the same step even when the signal reached only some.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""SIGTERM: what schedulers, ``kill`` and torchrun send to stop a process. SIGUSR1: what launch/slurm.sbatch asks
SLURM for ahead of the time limit, and what SLURM users conventionally give ``--signal``."""

TIME_LIMIT = "time_limit"
TIME_BUDGET = "time_budget"
SIGNAL = "signal"


class TimeShare:
    """The seconds a run sized by time may train (``budget_s``; None: the run is sized by steps) and the seconds it
    has spent, the same on every rank (``stop_reason`` sets them once per step, before the optimizer step, so that
    the schedule's next learning rate sees the time of the step just taken)."""

    def __init__(self, budget_minutes: float | None = None, before_s: float = 0.0) -> None:
        self.budget_s = None if budget_minutes is None else 60.0 * budget_minutes
        self.before_s = before_s
        """Seconds spent before this process (a resumed run's checkpoint)."""
        self.spent_s = before_s

    def fraction(self) -> float:
        """The share of the budget spent, 0 to 1 (0 for a run sized by steps)."""
        return 0.0 if not self.budget_s else min(1.0, self.spent_s / self.budget_s)

    def spent(self) -> bool:
        return self.budget_s is not None and self.spent_s >= self.budget_s


class PreemptionSignals:
    """While entered, SIGTERM and SIGUSR1 only record that they came (``received``); on exit the handlers that were
    there before are put back. Python runs handlers in the main thread between bytecodes, so the flag is set
    without interrupting a collective or a checkpoint write; the loop acts on it at the next step boundary.
    Outside the main thread nothing is installed (``installed`` is False): Python allows handlers only there."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self.installed = False
        self._previous: dict[signal.Signals, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def __enter__(self) -> PreemptionSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._record)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the closest we can restore.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.installed = False


class Preempted(SystemExit):
    """Raised by the training loop once the checkpoint of the step a preemption signal stopped it at is saved.

    A ``SystemExit`` with status 0: ``fledge train`` exits cleanly (torchrun and SLURM see a success), and whatever
    ran the stage in the same process (the quickstart, a Hydra sweep) stops as well instead of taking an unfinished
    run for a finished one."""

    def __init__(self, step: int, total_steps: int, checkpoint: str, signal_name: str) -> None:
        super().__init__(0)
        self.step = step
        self.total_steps = total_steps
        self.checkpoint = checkpoint
        self.signal_name = signal_name


def stop_reason(
    limit_minutes: float | None, since: float, signals: PreemptionSignals, device: torch.device,
    share: TimeShare | None = None,
) -> str | None:
    """Why the run must end after the step being taken: ``SIGNAL`` (preempted), ``TIME_LIMIT`` (``limit_minutes``
    since ``since`` in this process), ``TIME_BUDGET`` (a run sized by time has spent its ``share``, whose
    ``spent_s`` this sets to the seconds since ``since`` plus those spent before this process), or None.

    Every rank must answer alike at the same step, or some would wait in a collective that the others never join.
    Under several ranks it is therefore one all-reduce (max) per step of the seconds as rank 0's clock sees them
    (the other ranks put in 0, so that clock skew cannot split them) and whether any rank received a signal. It
    runs only when something can stop the run, a time limit, a time budget or installed handlers, which is the same
    on every rank; a single process reads its own clock and flag without a device tensor.
    """
    seconds = time.perf_counter() - since
    signalled = signals.received is not None
    timed = share is not None and share.budget_s is not None
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if several and (limit_minutes is not None or timed or signals.installed):
        flags = torch.tensor([seconds if dist.get_rank() == 0 else 0.0, float(signalled)], device=device,
                             dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        seconds, flag = flags.tolist()
        signalled = bool(flag)
    if share is not None:
        share.spent_s = share.before_s + seconds
    if signalled:
        return SIGNAL
    if limit_minutes is not None and seconds >= 60 * limit_minutes:
        return TIME_LIMIT
    return TIME_BUDGET if share is not None and share.spent() else None
