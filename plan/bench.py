"""``fledge bench plan``: the plan's memory prediction against a real training step, measured on the CPU.

The step is the real one (``TorchEngine``, single process, fp32: the draft, the TTT loss over the unroll, the
backward, clipping and AdamW) at a verifier's real draft shapes (Llama-3.1-8B by default: hidden 4096, verifier
vocabulary 128256, draft vocabulary 32000, TTT 7), on a synthetic batch, in a fresh process. No verifier runs:
the batch stands in for the cache, which supplies the verifier's states.

What is compared: the memory the step adds to what exists before it. The baseline is taken once the draft, the
frozen embedding, the teacher head, the batch and AdamW's moments exist (one update on zero gradients creates the
moments), so that the comparison is about the part the model has to predict (activations, gradients, the
optimizer's temporaries), not about bytes that are parameter counts times four; the persistent part is counted
exactly from the tensors and reported beside. The step's memory is measured two ways:

- **resident memory** (the figure compared): the peak resident set during the step (``VmHWM``, reset through
  ``/proc/self/clear_refs`` at the baseline, so that a higher high-water mark while the model was being built
  cannot hide the step's) less the resident set at the baseline. It sees what the process really holds, with
  glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so that a freed tensor's pages go back to the system
  at once instead of lingering in the heap: a resident-set peak over the whole process, against a baseline taken
  after imports, would otherwise mix allocator effects and the model's construction into the figure.
- **live tensor bytes** (printed as a check): a ``TorchDispatchMode`` trace of the storages every op creates and
  when they die (what a GPU's caching allocator would have to hand out, fragmentation aside).

The presets' 4096 tokens need more memory than a shared CPU box has (23.8 GiB in fp32 at 8B, of which the step
adds 14.9): the bench takes the longest length, in steps of 128 tokens, whose predicted total fits
``ram_limit_gib``, and says so (``seq_len=2048 ram_limit_gib=19``: 8.101 GiB predicted against 8.105 measured
for the step, on the 2-core Xeon of docs/experiments/2026-12-05-training-peak.md).

    fledge bench plan                              # 8B shapes, the longest length under 16 GiB
    fledge bench plan seq_len=512 ram_limit_gib=8

Prints ``plan_memory_predicted_gib``, ``plan_memory_measured_gib`` and ``plan_memory_error_pct`` (the step, above
the baseline) for benchmarks to compare, and the totals; no test asserts a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fledge.core.errors import ConfigError
from fledge.models.draft import Eagle3Config
from fledge.models.shapes import VerifierShape, resolve_shape
from fledge.models.verifier import VerifierConfig
from fledge.plan.memory import GIB, JobShape, Memory, peak_memory, ttt_saved_bytes
from fledge.plan.step import built_step, run_step

MMAP_THRESHOLD = 128 * 1024
"""glibc's initial mmap threshold, fixed (``MALLOC_MMAP_THRESHOLD_``): larger blocks are mapped and unmapped on
free instead of staying in the heap, and glibc stops raising the threshold as blocks are freed."""


@dataclass
class PlanBenchConfig:
    verifier: str = "meta-llama/Llama-3.1-8B-Instruct"
    """Whose draft shapes to measure at (read as ``fledge plan`` reads them: ``models/shapes.py``)."""
    shape: VerifierShape = field(default_factory=VerifierShape)
    """Overrides of the verifier's shape (``shape.hidden_size=1024`` ... for a smaller check)."""
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    seq_len: int = 4096
    """Tokens per sequence (the 8B presets' max length); shortened when the prediction exceeds ``ram_limit_gib``."""
    batch_size: int = 1
    ram_limit_gib: float = 16.0
    """The most the measured step may need (this machine's memory is shared)."""
    threads: int = 0
    """Torch threads in the measured process; 0 keeps torch's default."""
    seed: int = 0
    fake: bool = False
    """Run the step under PyTorch's fake tensors (``plan/fake.py``): no data is allocated, so any shape runs
    (``verifier=meta-llama/Llama-3.3-70B-Instruct seq_len=8192``) at its own length, whatever ``ram_limit_gib``; the
    live-byte peak is compared with the plan's."""
    dtype: str = "fp32"
    """``fake=true``: the step's compute dtype, ``fp32`` or ``bf16`` (autocast, as the presets train)."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.seq_len < 16 or self.batch_size < 1 or self.ram_limit_gib <= 0:
            raise ConfigError("need ttt_steps >= 1, seq_len >= 16, batch_size >= 1 and ram_limit_gib > 0")
        if self.dtype not in ("fp32", "bf16") or (self.dtype == "bf16" and not self.fake):
            raise ConfigError(f"dtype={self.dtype!r}: fp32, or bf16 with fake=true (the measured step runs in fp32)")


def draft_of(shape: VerifierShape, draft_vocab_size: int) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, vocab_size=shape.vocab_size, draft_vocab_size=min(draft_vocab_size, shape.vocab_size),
        target_hidden_size=shape.hidden_size,
    )


PERSISTENT = ("verifier_weights", "draft_weights", "frozen_embedding", "teacher_head", "master_weights",
              "optimizer_states", "batch", "engine_buffers")
"""The plan's terms that exist before the step (at the measured baseline); the rest is what the step adds."""


def predict(job: JobShape) -> Memory:
    """The plan for the bench's step: one process, no DDP, no verifier, AdamW one tensor at a time (as torch runs
    it on a CPU)."""
    return peak_memory(job, 0, 1, online=False, ddp=False, foreach=False)


def step_bytes(memory: Memory) -> float:
    """What the step adds at its peak to the persistent terms (activations, gradients, temporaries)."""
    return memory.total - sum(memory.terms[k] for k in PERSISTENT)


def measure(job: JobShape, threads: int, seed: int, timeout_s: float = 3600) -> dict[str, Any]:
    """Run one training step of ``job`` in a fresh process; what it holds above the baseline (module docstring)."""
    spec = {"draft": job.draft.to_dict(), "batch": job.micro_batch, "seq_len": job.seq_len,
            "ttt_steps": job.ttt_steps, "threads": threads, "seed": seed}
    # (4 KiB pages: a tensor's freed pages leave the resident set at once; the fledge command's huge pages would
    # round each large tensor up to 2 MiB)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "THP_MEM_ALLOC_ENABLE": "0"}
    done = subprocess.run([sys.executable, "-m", "fledge.plan.bench", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the measured step failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(cfg: PlanBenchConfig) -> dict[str, Any]:
    shape, source = resolve_shape(VerifierConfig(name_or_path=cfg.verifier), cfg.shape)
    draft = draft_of(shape, cfg.draft_vocab_size)
    if cfg.fake:
        return run_fake(cfg, shape, draft, source)
    job = JobShape(draft, shape, cfg.batch_size, cfg.seq_len, cfg.ttt_steps, "fp32")
    asked = predict(job).total
    limit = cfg.ram_limit_gib * GIB
    if asked > limit:
        # the longest length, in steps of 128 tokens, whose prediction fits
        fits = [n for n in range(128, cfg.seq_len, 128) if predict(dataclasses.replace(job, seq_len=n)).total <= limit]
        job = dataclasses.replace(job, seq_len=fits[-1] if fits else min(cfg.seq_len, 16))
    memory = predict(job)
    if memory.total > limit:
        raise ConfigError(f"even {job.seq_len} tokens need {memory.total / GIB:.1f} GiB, more than ram_limit_gib="
                          f"{cfg.ram_limit_gib:g}", fix="raise ram_limit_gib or measure a smaller shape (shape.*)")
    print(f"draft of {cfg.verifier} (shape from {source}): hidden {draft.hidden_size}, MLP {draft.intermediate_size}, "
          f"heads {draft.num_attention_heads}/{draft.num_key_value_heads} x {draft.head_dim}, vocabulary "
          f"{draft.vocab_size:,}, draft vocabulary {draft.draft_vocab_size:,}, TTT {job.ttt_steps}, micro-batch "
          f"{job.micro_batch} x {job.seq_len} tokens, fp32, one process (ZeRO-0), AdamW")
    if job.seq_len != cfg.seq_len:
        print(f"seq_len {cfg.seq_len} would need {asked / GIB:.1f} GiB, more than ram_limit_gib={cfg.ram_limit_gib:g}: "
              f"measured at {job.seq_len} tokens, the longest multiple of 128 whose prediction fits")
    print(f"predicted peak at the {memory.moment}: " + ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in memory.terms.items() if v) + " GiB")
    print("activations saved for the backward: " + ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in ttt_saved_bytes(job).items()) + " GiB")
    result = measure(job, cfg.threads, cfg.seed)
    predicted, persistent = step_bytes(memory), memory.total - step_bytes(memory)
    measured = result["rss_step_bytes"]
    traced = result["traced_step_bytes"]
    error = 100 * (predicted - measured) / measured
    measured_total = result["persistent_bytes"] + measured
    total_error = 100 * (memory.total - measured_total) / measured_total
    print(f"measured: the step took {result['step_s']:.0f} s ({result['counted']:.0f} positions counted at TTT "
          f"step 0); resident {result['baseline_rss_bytes'] / GIB:.2f} GiB at the baseline, peak "
          f"{result['peak_rss_bytes'] / GIB:.2f} GiB during the step; tensors at the baseline "
          f"{result['persistent_bytes'] / GIB:.3f} GiB (predicted {persistent / GIB:.3f})\n")
    print(f"plan_memory_seq_len {job.seq_len}")
    print(f"plan_memory_peak_moment {memory.moment.replace(' ', '_')}")
    print(f"plan_memory_predicted_gib {predicted / GIB:.3f}")
    print(f"plan_memory_measured_gib {measured / GIB:.3f}")
    print(f"plan_memory_error_pct {error:+.1f}")
    print(f"plan_memory_traced_gib {traced / GIB:.3f}")
    print(f"plan_memory_traced_error_pct {100 * (predicted - traced) / traced:+.1f}")
    print(f"plan_memory_total_predicted_gib {memory.total / GIB:.3f}")
    print(f"plan_memory_total_measured_gib {measured_total / GIB:.3f}")
    print(f"plan_memory_total_error_pct {total_error:+.1f}")
    return {"seq_len": job.seq_len, "predicted_gib": predicted / GIB, "measured_gib": measured / GIB,
            "error_pct": error, "traced_gib": traced / GIB, "traced_error_pct": 100 * (predicted - traced) / traced,
            "total_predicted_gib": memory.total / GIB, "total_error_pct": total_error, "moment": memory.moment,
            "child": result, "config": asdict(cfg)}


def run_fake(cfg: PlanBenchConfig, shape: VerifierShape, draft: Eagle3Config, source: str) -> dict[str, Any]:
    """The plan's peak against one fake step's (``plan/fake.py``), at the asked length: what the step adds and the
    whole. The split between the two can differ where the plan counts a tensor among the persistent ones that the
    code makes during the step (autocast's bf16 copies of the weights); the total is what a GPU must hold."""
    from fledge.plan.fake import fake_step

    job = JobShape(draft, shape, cfg.batch_size, cfg.seq_len, cfg.ttt_steps, cfg.dtype)
    memory = predict(job)
    start = time.perf_counter()
    fake = fake_step(draft, cfg.batch_size, cfg.seq_len, cfg.ttt_steps, cfg.seed, cfg.dtype, torch_tracker=True)
    seconds = time.perf_counter() - start
    total = fake["persistent_bytes"] + fake["step_bytes"]
    error = 100 * (memory.total - total) / total
    theirs = fake["torch_peak_bytes"]
    theirs_error = 100 * (memory.total - theirs) / theirs
    print(f"draft of {cfg.verifier} (shape from {source}): hidden {draft.hidden_size}, vocabulary "
          f"{draft.vocab_size:,}, draft vocabulary {draft.draft_vocab_size:,}, TTT {cfg.ttt_steps}, micro-batch "
          f"{cfg.batch_size} x {cfg.seq_len:,} tokens, {cfg.dtype}, one process, AdamW; one step under fake tensors "
          f"({seconds:.1f} s, no data allocated)\n")
    print(f"plan_fake_seq_len {cfg.seq_len}")
    print(f"plan_fake_step_gib {fake['step_bytes'] / GIB:.3f}")
    print(f"plan_fake_predicted_step_gib {step_bytes(memory) / GIB:.3f}")
    print(f"plan_fake_total_gib {total / GIB:.3f}")
    print(f"plan_fake_predicted_total_gib {memory.total / GIB:.3f}")
    print(f"plan_fake_total_error_pct {error:+.2f}")
    print(f"plan_fake_torch_tracker_gib {theirs / GIB:.3f}")  # torch.distributed._tools.mem_tracker, same step
    print(f"plan_fake_torch_tracker_error_pct {theirs_error:+.2f}")
    return {"seq_len": cfg.seq_len, "dtype": cfg.dtype, "fake_step_gib": fake["step_bytes"] / GIB,
            "fake_total_gib": total / GIB, "predicted_total_gib": memory.total / GIB, "total_error_pct": error,
            "torch_tracker_gib": theirs / GIB, "torch_tracker_error_pct": theirs_error,
            "predicted_step_gib": step_bytes(memory) / GIB, "config": asdict(cfg)}


def _resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _measured_step(spec: dict[str, Any]) -> dict[str, Any]:
    """The child process: the draft, the batch and AdamW's states, the baseline, then one step."""
    import gc

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    config = Eagle3Config.from_dict(spec["draft"])
    engine, batch, tracker, persistent = built_step(config, spec["batch"], spec["seq_len"], spec["ttt_steps"],
                                                    spec["seed"])
    torch.ones(8, 8) @ torch.ones(8, 8)  # the BLAS loaded
    gc.collect()
    # the baseline: the tensors that exist now (counted exactly), the resident set, the high-water mark reset
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident set
    baseline, hwm = _resident()
    start = time.perf_counter()
    with tracker:
        loss, metrics = run_step(engine, batch)
    elapsed = time.perf_counter() - start
    _, peak = _resident()
    return {"baseline_rss_bytes": baseline, "baseline_hwm_bytes": hwm, "peak_rss_bytes": peak,
            "rss_step_bytes": peak - baseline, "traced_step_bytes": tracker.peak, "persistent_bytes": persistent,
            "step_s": elapsed, "counted": float(metrics["tokens"]), "loss": float(loss)}


if __name__ == "__main__":
    print(json.dumps(_measured_step(json.loads(sys.argv[1]))))
