"""The training loop's own knobs: optimizer, schedule, length, batch, numerics (``TrainConfig``), and the held-out
evaluation during training (``HeldOutConfig``).

Each component keeps its own small dataclass beside its code (``EngineConfig`` in engine.py, ``CheckpointConfig`` in
checkpoint.py, ``LogConfig`` in logger.py, ``TTTConfig`` in ttt.py). The root, ``TrainJobConfig``, composes them in
loop.py, the stage itself; this module imports none of them, so that the engine can read ``TrainConfig`` without
an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fledge.core.errors import ConfigError

DTYPES = ("auto", "fp32", "bf16")
HEAD_INITS = ("random", "verifier", "lens")
LAYER_INITS = ("random", "verifier")
OPTIMIZERS = ("adamw", "muon")
COMPILE_MIN_HEAD = 1 << 20
"""``train.compile=null`` compiles drafts whose head has at least this many weights (the default verifier's draft
over 4,096 tokens has 2.4 M; the tests' tiny drafts a few thousand)."""


@dataclass
class TrainConfig:
    # ---- optimizer: AdamW (or Muon for the hidden matrices)
    optimizer: str = "adamw"
    """'adamw', or 'muon': torch's Muon for the decoder layer's matrices and ``fc``, AdamW for ``lm_head`` and the
    norms (``train.engine.make_optimizer``); torch and DDP engines only."""
    lr: float = 3e-4
    """Peak learning rate, reached after warmup. EAGLE-3's published 5e-5 is sized for ~500k conversations x 40
    epochs and barely moves a draft on a small budget; 3e-4 trains the tiny and the 135M-verifier drafts in
    a few thousand steps."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (never to norms)."""
    warmup_steps: int | None = None
    """Linear warmup steps; None means ``warmup_ratio`` of the total steps."""
    warmup_ratio: float = 0.02
    """Warmup as a fraction of the total steps when ``warmup_steps`` is None."""
    clip_norm: float = 0.5
    """Clip the global gradient norm to this (0 turns clipping off; the norm is still computed and logged)."""
    # ---- length of the run
    max_steps: int = 0
    """Optimizer steps to train for; when > 0 it decides the length of the run and ``epochs`` is ignored."""
    epochs: float = 3.0
    """Passes over the training conversations (fractions allowed); used when ``max_steps`` is 0."""
    time_limit_minutes: float | None = None
    """Stop at the first step boundary after this much training time in this process (the final draft and a
    checkpoint are written as at the planned end); None trains all the steps. The schedule still follows the steps."""
    time_budget_minutes: float | None = None
    """Size the run by time: train until this much loop time is spent (held-out evaluations and checkpoint writes
    count; a resumed run goes on from its checkpoint's seconds), with the learning rate's cosine following the share
    of it spent. The steps of ``max_steps`` / ``epochs`` are then an upper bound. The quickstart gives its training
    stage's share of the budget here, so that a box faster than predicted trains longer instead of ending early."""
    # ---- batch
    micro_batch_size: int = 4
    """Sequences per forward on each rank (ignored when ``max_tokens`` > 0)."""
    max_tokens: int = 0
    """Token budget per forward on each rank: longest sequence x sequences <= max_tokens (0: use micro_batch_size)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step on each rank; the global batch is world_size x grad_accum
    micro-batches."""
    # ---- initialisation
    head_init: str = "random"
    """'random' (normal(0, 0.02), as EAGLE-3 and SpecForge); 'verifier': the draft's ``lm_head`` starts as the
    verifier's head rows for the draft vocabulary and its ``norm`` as the verifier's final norm (speculators'
    default); 'lens': that, and the draft starts as the verifier's logit lens on its top aux layer (``fc`` passes
    that layer through, the decoder layer's output projections start at zero; ``Eagle3Draft.init_as_lens``)."""
    head_init_scale: float = 1.0
    """Multiplies the copied final norm (head_init=verifier or lens): the copied head is as sharp as the verifier's
    own, and on a hidden state it was not trained for that gives confident, wrong logits
    (docs/experiments/2026-12-01-budget-and-levers.md)."""
    layer_init: str = "random"
    """'random' (normal(0, 0.02)); 'verifier': the draft's decoder layer starts as the verifier's layer that reads
    the top aux state (its projections over the hidden state, MLP and norms; ``Eagle3Draft.init_layer_from_verifier``),
    meant with head_init=lens, where the residual stream starts as that state: the draft then begins one verifier
    layer further on. Needs the draft shaped as the verifier (no ``draft_intermediate_size``). At the quickstart's
    length: held-out acc_0 +0.015, τ level (docs/experiments/2026-12-07-layer-init.md)."""
    freeze_head: bool = False
    """Keep ``lm_head`` and ``norm`` at their initial values (meant with head_init=verifier; fewer weights to train)."""
    draft_vocab_size: int = 0
    """0: the draft vocabulary the cache chose (``cache.draft_vocab_size``). N: the N tokens most often in the loss,
    chosen again from the token counts the cache kept beside it, without caching again (the hidden states do not
    depend on it), so that one cache serves drafts of several vocabulary sizes."""
    draft_intermediate_size: int = 0
    """0: the draft's MLP is as wide as the verifier's (EAGLE-3's choice, what serving engines expect by default).
    N: an MLP N wide; the exported ``config.json`` carries it, and vLLM and SGLang read it from there."""
    aux_scale: bool = False
    """Divide each aux state by its typical RMS before ``fc`` (``Eagle3Config.aux_scale``, measured on the data at
    the start); exported folded into ``fc``, so the served head is a plain EAGLE-3 one."""
    # ---- numerics
    dtype: str = "auto"
    """'fp32', 'bf16' autocast (fp32 weights, optimizer and gradient reduction; bf16 matrix products), or 'auto':
    the faster of the two for the draft's widest product on this machine, timed at the start of the run
    (``train.engine.choose_train_dtype``) and recorded in the resolved config. Neither is fast everywhere: on an
    AVX2-only CPU a bf16 product ran 6x slower than fp32, on one with AVX512-BF16 4x faster, on GPUs bf16 wins.
    fp32 keeps resume and engine-equivalence checks exact across machines."""
    compile: bool | None = None
    """``torch.compile`` the element-wise work around the step's matrix products: the fused loss's and the teacher's
    per-chunk terms (``core/compile.py``), one or two loops over [positions, vocabulary] instead of a dozen passes,
    and each step of the TTT unroll (norms, RoPE, residuals, activation; not under DeepSpeed: ``train.ttt``).
    None (auto): on when the draft's head has at least ``COMPILE_MIN_HEAD`` weights (every real draft; not the tests'
    tiny ones, where compiling costs more than it saves). A machine where the compiler cannot run trains eagerly,
    after one warning that says why. Measured: docs/design.md, "Training at the hardware's peak"."""
    seed: int = 0
    """Seeds the draft's initialisation, the data order (bucketing and shuffling per epoch) and the RNGs."""

    def __post_init__(self) -> None:
        if self.head_init not in HEAD_INITS:
            raise ConfigError(f"train.head_init must be one of {HEAD_INITS}, got {self.head_init!r}")
        if self.layer_init not in LAYER_INITS:
            raise ConfigError(f"train.layer_init must be one of {LAYER_INITS}, got {self.layer_init!r}")
        if self.head_init_scale <= 0:
            raise ConfigError(f"train.head_init_scale must be > 0, got {self.head_init_scale}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= train.min_lr ({self.min_lr}) <= train.lr ({self.lr}) and train.lr > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {self.betas}")
        for name in ("time_limit_minutes", "time_budget_minutes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be > 0 or null, got {getattr(self, name)}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0 or null, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"train.warmup_ratio must lie in [0, 1), got {self.warmup_ratio}")
        if self.clip_norm < 0:
            raise ConfigError(f"train.clip_norm must be >= 0 (0 = no clipping), got {self.clip_norm}")
        if self.draft_vocab_size < 0:
            raise ConfigError(f"train.draft_vocab_size must be >= 0 (0: the cache's), got {self.draft_vocab_size}")
        if self.draft_intermediate_size < 0:
            raise ConfigError(
                f"train.draft_intermediate_size must be >= 0 (0: the verifier's), got {self.draft_intermediate_size}"
            )
        if self.max_steps < 0 or self.epochs < 0:
            raise ConfigError("train.max_steps and train.epochs must be >= 0")
        if self.max_steps == 0 and self.epochs <= 0:
            raise ConfigError("train.max_steps is 0, so train.epochs must be > 0 (or set train.max_steps)")
        if self.micro_batch_size < 1 or self.max_tokens < 0 or self.grad_accum < 1:
            raise ConfigError(
                "train.micro_batch_size and train.grad_accum must be >= 1, train.max_tokens >= 0 "
                f"(got {self.micro_batch_size}, {self.grad_accum}, {self.max_tokens})"
            )

    def compiles(self, draft_vocab_size: int, hidden_size: int) -> bool:
        """``compile`` settled for a draft with this head."""
        if self.compile is not None:
            return self.compile
        return draft_vocab_size * hidden_size >= COMPILE_MIN_HEAD

    def warmup(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * total_steps)


@dataclass
class HeldOutConfig:
    every: int = 500
    """Evaluate every N optimizer steps (and after the last one); 0 turns periodic eval off."""
    holdout: int = 20
    """Hold out the last N conversations of the training cache for eval (they are never trained on)."""
    cache_dir: str | None = None
    """A second cache to evaluate on instead of a held-out slice (same verifier and aux layers)."""
    max_batches: int = 0
    """Cap on eval micro-batches per rank (0: the whole held-out set)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.holdout < 0 or self.max_batches < 0:
            raise ConfigError("validation.every, validation.holdout and validation.max_batches must be >= 0")
