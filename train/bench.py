"""``fledge bench train``: training throughput of the default verifier's draft, fp32 and bf16 autocast, and its MFU.

No cache is needed: the batch is synthetic (random token ids, aux / final states of the right shapes), and the
step is the real one (``TorchEngine``: TTT forward, backward, clip, AdamW), on the GPU when CUDA is available
(``device=auto``), else the CPU. The peak is measured in the same run and on the same device with one large matrix
product per dtype, so MFU compares the draft to what this machine's matmul reaches.

``data.mode=online`` also loads the verifier (``verifier.*``, the default one unless named) and times what online
training adds (``data/online.py``): each timed step first runs the verifier over the batch's token ids with the
cache's capture code (``data.cache_job.capture_batch``, states rounded to the cache's storage dtype) and pads the
rows as the data thread does; the offline figure trains on those same states, ready. It prints both tokens/s, their
ratio and the verifier's forward time per token. The two run one after the other here, as they share the CPU in
training (there the data thread computes the next batch while the current one trains: on a GPU the online figure is
a lower bound).

Model FLOPs of one training step, counted from the shapes (``train_step_flops``); element-wise work (norms,
RoPE, softmax, SiLU) is left out, matrix products count 2 FLOPs per multiply-add:

- trainable products count forward + backward = 3x forward (input and weight gradients), except ``fc``, whose
  input (the cached aux states) needs no gradient: 2x;
- the TTT attention counts the causal half of the step-0 scores (query t sees t+1 keys) plus one key per earlier
  step, for QK^T and for PV, also 3x;
- ``lm_head`` runs only on the positions the loss counts, so it is counted on those;
- the frozen teacher (the verifier's head over the full vocabulary, under no_grad, at each position a trained
  token follows: every one but the last in the synthetic batch) counts 1x; the frozen embedding lookup counts 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fledge.core.compile import compile_failed
from fledge.core.dist import DistInfo, pick_device
from fledge.core.errors import ConfigError
from fledge.core.host_memory import keep_freed_memory
from fledge.data.cache import CacheConfig
from fledge.data.online import MODES
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.verifier import Verifier, VerifierConfig
from fledge.train.config import TrainConfig
from fledge.train.engine import EngineConfig, TorchEngine, TTTModule
from fledge.train.ttt import TTTConfig

log = logging.getLogger(__name__)


@dataclass
class BenchDataConfig:
    mode: str = "cache"
    """``cache``: time training steps on ready states (a cache's); ``online``: also time them with the verifier's
    forward in front, as ``fledge train data.mode=online`` runs it, and compare."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"data.mode must be one of {', '.join(MODES)}, got {self.mode!r}")


@dataclass
class TrainBenchConfig:
    hidden_size: int = 576
    """Draft width (SmolLM2-135M-Instruct's, the default verifier's)."""
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    target_hidden_size: int = 576
    vocab_size: int = 49152
    draft_vocab_size: int = 32000
    seq_len: int = 1024
    """Tokens per sequence of the synthetic batch."""
    batch_size: int = 1
    ttt_steps: int = 7
    steps: int = 3
    """Timed training steps per dtype (after ``warmup`` untimed ones); the median is reported."""
    warmup: int = 3
    """Untimed steps first: the first compiles, and the next two still ran up to 1.6x slower than the later ones on a
    2-core AMX Xeon, with host memory kept between steps (``core/host_memory.py``) or not."""
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    matmul_size: int = 2048
    """Side of the square matrices timed for the peak (on a large GPU 2048 may fall short of its peak and inflate
    MFU: try 8192 there)."""
    profile: bool = False
    """Also profile one training step per dtype (torch.profiler) and print the ops that took the most time."""
    profile_rows: int = 5
    compile: bool | None = None
    """``train.compile``: None settles it as training does (on for a head of >= ``COMPILE_MIN_HEAD`` weights)."""
    attention: str = "auto"
    """``ttt.attention`` (``auto``, ``flash``, ``blocks``)."""
    loss_chunk: int = 1024
    """``ttt.loss_chunk``."""
    skip_slow_dtypes: bool = True
    """Skip the training measurement of a dtype whose matmul peak is under half of the best one (on AVX2 CPUs
    without native bf16, a bf16 training step of this draft ran 30x slower than fp32 at 128 tokens: a
    1024-token bf16 step takes many minutes)."""
    seed: int = 0
    device: str = "auto"
    """'auto' (the first GPU when CUDA is available, else the CPU), 'cpu', 'cuda', 'cuda:1', ..."""
    data: BenchDataConfig = field(default_factory=BenchDataConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    """The verifier ``data.mode=online`` runs (the default one); the draft's shapes above must be its shapes."""

    def __post_init__(self) -> None:
        bad = [d for d in self.dtypes if d not in ("fp32", "bf16")]
        if bad or not self.dtypes:
            raise ConfigError(f"dtypes must be a non-empty list of 'fp32' / 'bf16', got {self.dtypes}")
        if self.steps < 1 or self.warmup < 0 or self.seq_len < 4 or self.batch_size < 1:
            raise ConfigError("steps >= 1, warmup >= 0, seq_len >= 4 and batch_size >= 1 are required")

    def draft_config(self) -> Eagle3Config:
        return Eagle3Config(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            rope_theta=100000.0,
            max_position_embeddings=max(2048, self.seq_len + self.ttt_steps),
        )


def train_step_flops(
    c: Eagle3Config, batch: int, seq: int, ttt_steps: int, counted: list[int], causal: bool = True
) -> dict[str, float]:
    """Model FLOPs of one training step by part; ``counted[k]`` = positions the loss counts at step k.

    ``causal=False`` counts the step-0 attention over all T x T query-key pairs and leaves out the per-step
    diagonal terms, and adds the loss's row dot products (``models/fused_ce.py`` runs them as a batched product),
    which is what the implementation executes as matrix products (tests compare against torch's FLOP counter that
    way); MFU uses the causal count."""
    tokens = batch * seq
    h, q_out, kv_out = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    fwd_fc = 2 * tokens * 3 * c.target_hidden_size * h
    fwd_proj = 2 * tokens * (2 * h * (q_out + 2 * kv_out) + q_out * h)  # q, k, v read 2H; o_proj
    fwd_mlp = 2 * tokens * 3 * h * c.intermediate_size
    if causal:
        keys = [batch * seq * (seq + 1) / 2 + tokens * k for k in range(ttt_steps)]
    else:
        keys = [batch * seq * seq] * ttt_steps
    fwd_attn = sum(2 * 2 * q_out * n for n in keys)  # QK^T and PV
    fwd_head = sum(2 * n * h * c.draft_vocab_size for n in counted)
    parts = {
        "fc": 2 * fwd_fc,
        "qkvo": 3 * ttt_steps * fwd_proj,
        "attention": 3 * fwd_attn,
        "mlp": 3 * ttt_steps * fwd_mlp,
        "lm_head": 3 * fwd_head,
        # every position whose next token exists (the teacher is computed only where a trained token follows)
        "teacher_head (frozen, 1x)": 2 * batch * (seq - 1) * c.target_hidden_size * c.vocab_size,
    }
    if not causal:
        parts["loss dot products"] = sum(2 * n * c.draft_vocab_size for n in counted)
    parts["total"] = sum(parts.values())
    return parts


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: a GPU runs asynchronously, and a clock read before it finishes
    measures only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, n: int, reps: int = 8, device: torch.device | str = "cpu") -> float:
    """FLOP/s of an n x n x n matrix product in ``dtype`` on ``device``, in the layout of ``nn.Linear``
    (``x @ w.T``), best of ``reps``. The layout matters on CPUs without native bf16: there a bf16 ``x @ w`` ran 10x
    slower than a bf16 ``x @ w.T``, which is what the draft's linear layers (nearly all of its FLOPs) execute.
    On a GPU each timing covers 16 products queued back to back, so that the launch and the synchronisation are
    not counted as the product's time."""
    device = torch.device(device)
    x = torch.randn(n, n, device=device).to(dtype)
    w = torch.randn(n, n, device=device).to(dtype)
    per_timing = 16 if device.type == "cuda" else 1
    torch.nn.functional.linear(x, w)  # warm up the kernel
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t = time.perf_counter()
        for _ in range(per_timing):
            torch.nn.functional.linear(x, w)
        synchronize(device)
        best = min(best, (time.perf_counter() - t) / per_timing)
    return 2 * n**3 / best


def synthetic_head(config: Eagle3Config, gen: torch.Generator) -> torch.Tensor:
    """A verifier head for the identity draft vocabulary (the first ``draft_vocab_size`` ids): the rows outside it
    are scaled down so that the teacher's top-1 always lies inside it and every position is counted, as on a
    well-chosen vocabulary (and the worst case for memory and FLOPs)."""
    head = torch.randn(config.vocab_size, config.target_hidden_size, generator=gen) * 0.02
    head[config.draft_vocab_size :] *= 0.01
    return head


def synthetic_states(config: Eagle3Config, b: int, t: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A batch of ``b`` x ``t`` random token ids and verifier states on the CPU (drawn from ``gen``, so the same on
    every device)."""
    return {
        "input_ids": torch.randint(0, config.vocab_size, (b, t), generator=gen),
        "loss_mask": torch.ones(b, t, dtype=torch.int64),
        "attention_mask": torch.ones(b, t, dtype=torch.int64),
        "aux": torch.randn(b, t, 3 * config.target_hidden_size, generator=gen),
        "final": torch.randn(b, t, config.target_hidden_size, generator=gen),
    }


def synthetic_batch(cfg: TrainBenchConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The bench's batch: ``synthetic_states`` at ``cfg.batch_size`` x ``cfg.seq_len``."""
    return synthetic_states(cfg.draft_config(), cfg.batch_size, cfg.seq_len, gen)


def counted_positions(cfg: TrainBenchConfig) -> list[int]:
    """Positions the loss counts at each step: those whose predicted token t+k+2 exists (the synthetic teacher's
    top-1 always lies in the draft vocabulary)."""
    return [cfg.batch_size * max(0, cfg.seq_len - k - 2) for k in range(cfg.ttt_steps)]


def bench_dtype(
    cfg: TrainBenchConfig, dtype: str, device: torch.device | None = None,
    capture: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None, online: bool = False,
) -> dict[str, Any]:
    """Time ``cfg.steps`` training steps in ``dtype`` on ``device`` (None: ``cfg.device``). With ``capture`` (the
    verifier's states for token ids, as a padded CPU batch) the steps train on the verifier's states of the
    synthetic token ids; with ``online`` too, each timed step computes them first (``capture_s``: that part)."""
    device = pick_device(cfg.device) if device is None else device
    keep_freed_memory(device)  # as training does (core/host_memory.py)
    config = cfg.draft_config()
    gen = torch.Generator().manual_seed(cfg.seed)
    draft = Eagle3Draft(config, seed=cfg.seed)
    head = synthetic_head(config, gen)
    total = cfg.warmup + cfg.steps
    train = TrainConfig(max_steps=total, dtype=dtype, warmup_steps=0, compile=cfg.compile)
    ttt = TTTConfig(ttt_steps=cfg.ttt_steps, attention=cfg.attention, loss_chunk=cfg.loss_chunk)
    module = TTTModule(draft, head, ttt, train.compiles(config.draft_vocab_size, config.hidden_size))
    engine = TorchEngine(module, train, EngineConfig(), DistInfo(), device, total)
    batch = synthetic_batch(cfg, gen)
    if capture is not None:
        batch = capture(batch["input_ids"])
    batch = {k: v.to(device) for k, v in batch.items()}
    times, capture_times, counted0, first_s = [], [], 0.0, 0.0
    for i in range(total):
        synchronize(device)
        t = time.perf_counter()
        if online:
            batch = {k: v.to(device) for k, v in capture(batch["input_ids"].cpu()).items()}
            synchronize(device)
            if i >= cfg.warmup:
                capture_times.append(time.perf_counter() - t)
        loss, metrics = engine.forward(batch)
        engine.backward(loss, boundary=True)
        engine.step()
        synchronize(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t)
        elif i == 0:
            first_s = time.perf_counter() - t
        counted0 = float(metrics["tokens"])
    step_time = sorted(times)[len(times) // 2]
    top_ops = profile_step(engine, batch, cfg.profile_rows) if cfg.profile else None
    counted = counted_positions(cfg)
    if abs(counted0 - counted[0]) > 0.01 * counted[0]:
        log.warning("step 0 counted %d positions, the FLOP count assumes %d", counted0, counted[0])
    flops = train_step_flops(config, cfg.batch_size, cfg.seq_len, cfg.ttt_steps, counted)
    return {
        "dtype": dtype,
        "step_s": step_time,
        "tokens_per_s": cfg.batch_size * cfg.seq_len / step_time,
        "model_tflops_per_s": flops["total"] / step_time / 1e12,
        "flops_per_step": flops,
        "loss": float(loss.detach()),
        "top_ops": top_ops,
        "capture_s": sorted(capture_times)[len(capture_times) // 2] if capture_times else 0.0,
        "compiled": module.compiled and compile_failed() is None,
        "first_step_s": first_s,
    }


def profile_step(engine: TorchEngine, batch: dict[str, torch.Tensor], rows: int) -> list[dict[str, Any]]:
    """The ops of one training step (forward, backward, optimizer) that took the most time by themselves."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        loss, _ = engine.forward(batch)
        engine.backward(loss, boundary=True)
        engine.step()
    # On a GPU the ops' own time is the device's (the host only launches them); on a CPU, the host's.
    on_gpu = engine.device.type == "cuda"

    def own_us(e: Any) -> float:
        if not on_gpu:
            return float(e.self_cpu_time_total)
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))

    events = sorted(prof.key_averages(), key=own_us, reverse=True)
    total = sum(own_us(e) for e in events) or 1.0
    return [
        {"op": e.key, "self_ms": own_us(e) / 1e3, "share": own_us(e) / total, "calls": e.count} for e in events[:rows]
    ]


def verifier_capture(cfg: TrainBenchConfig, device: torch.device) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """token ids [B, T] -> the padded CPU batch online training makes of them: the verifier's forward with the
    cache's capture code, rows rounded to the cache's storage dtype, padded by the data thread's ``pad_batch``."""
    from fledge.data.cache_job import capture_batch
    from fledge.data.template import Tokenized
    from fledge.models.verifier import load_verifier, parse_dtype
    from fledge.train.sampler import pad_batch

    verifier: Verifier = load_verifier(cfg.verifier, device)
    shapes = (verifier.hidden_size, int(verifier.model.config.vocab_size))
    if shapes != (cfg.target_hidden_size, cfg.vocab_size):
        raise ConfigError(
            f"verifier {cfg.verifier.name_or_path} has hidden size {shapes[0]} and vocabulary {shapes[1]}; the bench's "
            f"draft reads target_hidden_size={cfg.target_hidden_size} and vocab_size={cfg.vocab_size}",
            fix="set target_hidden_size, vocab_size (and hidden_size, heads) to the verifier's",
        )
    storage = parse_dtype(CacheConfig.storage_dtype)

    def capture(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        samples = [Tokenized(row.tolist(), [1] * len(row), False) for row in ids]
        return pad_batch(capture_batch(verifier, samples, list(range(len(samples))), storage))

    return capture


def run(cfg: TrainBenchConfig) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    capture = verifier_capture(cfg, device) if cfg.data.mode == "online" else None
    peaks = {
        d: matmul_peak(torch.float32 if d == "fp32" else torch.bfloat16, cfg.matmul_size, device=device)
        for d in cfg.dtypes
    }
    results, online = [], []
    for d in cfg.dtypes:
        if cfg.skip_slow_dtypes and peaks[d] < 0.5 * max(peaks.values()):
            cpu = f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
            where = describe(device) if device.type == "cuda" else cpu
            print(
                f"{d}: skipped, its matmul peak {peaks[d] / 1e12:.4f} TFLOP/s is {max(peaks.values()) / peaks[d]:.0f}x "
                f"below the best dtype's on {where}; skip_slow_dtypes=false measures it anyway"
            )
            continue
        r = bench_dtype(cfg, d, device, capture)
        if capture is not None:
            online.append(bench_dtype(cfg, d, device, capture, online=True))
        # On a shared machine a burst of other work can land on the peak's few products: measure it again after
        # the steps and keep the better of the two, so that MFU is not inflated by a low peak.
        peaks[d] = max(peaks[d], matmul_peak(torch.float32 if d == "fp32" else torch.bfloat16, cfg.matmul_size,
                                             device=device))
        r["peak_tflops_per_s"] = peaks[d] / 1e12
        r["mfu"] = r["model_tflops_per_s"] * 1e12 / peaks[d]
        results.append(r)
    c = cfg
    print(
        f"draft H={c.hidden_size} Ht={c.target_hidden_size} V={c.vocab_size} V_draft={c.draft_vocab_size} "
        f"batch {c.batch_size}x{c.seq_len} ttt_steps={c.ttt_steps}, on {describe(device)}"
    )
    flops = train_step_flops(cfg.draft_config(), c.batch_size, c.seq_len, c.ttt_steps, counted_positions(c))
    print("model FLOPs per step: " + ", ".join(f"{k} {v / 1e9:.1f}G" for k, v in flops.items()))
    print(f"ttt.attention={c.attention}, ttt.loss_chunk={c.loss_chunk}")
    print(f"{'dtype':<6} {'compiled':>8} {'1st step s':>10} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>9} "
          f"{'peak TFLOP/s':>13} {'MFU':>7}")
    for r in results:
        print(
            f"{r['dtype']:<6} {'yes' if r['compiled'] else 'no':>8} {r['first_step_s']:>10.2f} {r['step_s']:>8.2f} "
            f"{r['tokens_per_s']:>10.1f} {r['model_tflops_per_s']:>9.3f} {r['peak_tflops_per_s']:>13.3f} "
            f"{100 * r['mfu']:>6.1f}%"
        )
    for r in results:
        if r["top_ops"]:
            print(f"\n{r['dtype']}: the {len(r['top_ops'])} ops of one step that took the most time by themselves")
            for op in r["top_ops"]:
                print(f"  {op['op']:<36} {op['self_ms']:9.1f} ms {100 * op['share']:6.1f}%  {op['calls']:5d} calls")
    print("")
    for r in results:
        print(f"mfu {r['dtype']} {r['mfu']:.3f}")  # the stable label a benchmark compares
    tokens = c.batch_size * c.seq_len
    if online:
        print(f"\nonline: verifier {cfg.verifier.name_or_path} in {describe_dtype(cfg.verifier, device)}, its forward "
              "and capture before each step (data.mode=online); offline: the same steps on its states, ready")
    for r, o in zip(results, online):
        print(f"tokens_per_s offline {r['dtype']} {r['tokens_per_s']:.1f}")
        print(f"tokens_per_s online {o['dtype']} {o['tokens_per_s']:.1f}")
        print(f"online_ratio {o['dtype']} {o['tokens_per_s'] / r['tokens_per_s']:.3f}")
        print(f"verifier_forward_ms_per_token {o['dtype']} {1e3 * o['capture_s'] / tokens:.3f}")
    return {"results": results, "online": online, "peaks": peaks, "device": str(device)}


def describe_dtype(verifier: VerifierConfig, device: torch.device) -> str:
    from fledge.models.verifier import parse_dtype

    return str(parse_dtype(verifier.dtype, device)).removeprefix("torch.")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu, {torch.get_num_threads()} threads"
