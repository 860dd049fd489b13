"""The arithmetic of a job's plan: memory per GPU, FLOPs per token and cache disk, from shapes alone.

Every term is derived from the code that allocates it, and tests/test_plan.py holds the derivation to it:

- **Activations** (``ttt_saved_bytes``) are the tensors autograd keeps for the backward of one TTT forward
  (``train/ttt.py``, ``models/draft.py``), term by term. A test walks the real autograd graph of tiny drafts and
  finds exactly these bytes, in fp32 and under bf16 autocast. Per unroll step, for N = B·T tokens:

  * the loss: the teacher's probabilities gathered at the counted positions and the log-softmax of the draft's
    logits, both fp32 over the draft vocabulary (8·n·V_draft bytes; n = counted positions);
  * the attention (``models/ttt_attention.py``): through the flash kernel (``ttt.attention=auto`` on CPUs and CUDA
    GPUs) q, K, V, the output and two float32 log-sum-exps per query: O(T), no [T, T] tensor. Through the explicit
    scores (``blocks``) the [B, heads, T, T+k] probabilities (fp32, plus a bf16 copy under autocast):
    4-6·B·heads·T² bytes, which at 8B shapes is the largest term from ~1,300 tokens on (21 GiB of 31 at 4,096);
  * the MLP keeps gate, SiLU, up and their product ([N, I] each); the attention keeps q (and its copy for the
    batched product), the grouped K and V expanded to every query head, the o_proj input; the norms keep their
    inputs and normalised outputs in fp32 (the draft casts its hidden state to its fp32 weights' dtype);
  * under autocast, the bf16 copies of the weights the backward multiplies by (every linear but ``fc``, whose
    input needs no gradient), and of the inputs of each linear (q/k/v cast the same fp32 input three times).

- **The peak** is the largest of three moments (``peak_memory``): the end of the forward (all activations, the
  teacher's probabilities [N, V_draft] and the last step's logits), early in the backward (the activations less
  the last step's loss and MLP, every weight's gradient — the unroll uses each weight K times, so its gradient
  is accumulated over the whole backward before any engine hook sees it — and the attention backward's two
  [B, heads, T, T+k] temporaries), and the optimizer step (gradients, the engine's buffers, the optimizer's;
  under ZeRO-1/2 this moment starts at the end of the backward, when their reduction bucket is allocated).

- **Engines** (``train/engine.py``): the draft's weights are fp32 in every engine (bf16 is autocast), so there is
  no separate low-precision copy; DeepSpeed ZeRO-1/2/3 still clones its partition as the fp32 master. AdamW keeps
  two fp32 moments (Muon one, for the hidden matrices). DDP allocates gradient buckets as large as the gradients
  (``gradient_as_bucket_view`` is off). DeepSpeed's reduction bucket is ``reduce_bucket_size`` (5e8) fp32
  elements, 1.9 GiB whatever the draft's size (fledge's generated config keeps the default): ZeRO-1/2 allocate it
  at the first gradient hook and free it at the end of the backward, ZeRO-3 allocates it once with the optimizer
  and keeps it, with the flat gradient partitions. ZeRO-3 partitions weights (the frozen embedding too) and, with
  several ranks, gathers one module at a time plus the prefetch bucket. A small draft therefore needs more memory
  under ZeRO than under DDP. (Checked with DeepSpeed 0.19.8 on one CPU rank, tracing live tensor bytes: ZeRO-1 and
  -2 peaked at 1,965 MiB against 1,960 predicted, ZeRO-3 at 1,984 against 1,984, for a 1.5 M-parameter draft.)
  The verifier's head (the teacher) is a plain fp32 attribute on every rank, never sharded.

Not counted: the CUDA context, kernels' workspaces, NCCL buffers and the caching allocator's fragmentation (the
plan holds back ``reserve_gib`` for them), and tensors under a megabyte that do not grow with the job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fledge.models.draft import Eagle3Config
from fledge.models.shapes import VerifierShape
from fledge.train.bench import train_step_flops

GIB = 2**30
REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (elements); fledge's generated DeepSpeed config keeps it."""
PREFETCH_BUCKET = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (elements)."""
STAGES = (0, 1, 2, 3)
"""ZeRO stages; 0 is torch DDP (one process: the single engine)."""


@dataclass(frozen=True)
class JobShape:
    """What decides a training job's memory per GPU."""

    draft: Eagle3Config
    verifier: VerifierShape
    micro_batch: int
    """Sequences per forward on each rank."""
    seq_len: int
    """Tokens per sequence (the planned worst case: ``data.max_length``)."""
    ttt_steps: int
    dtype: str
    """'fp32' or 'bf16' (autocast over fp32 weights, as ``train.dtype=bf16``)."""
    optimizer: str = "adamw"
    verifier_bytes: int = 2
    """Bytes per verifier weight when it runs beside training (online): bf16."""
    loss_chunk: int = 1024
    """Positions per chunk of the fused head and loss (``ttt.loss_chunk``)."""
    attention: str = "flash"
    """How the TTT attention runs (``ttt.attention``): ``flash`` (what ``auto`` picks on CPUs and CUDA GPUs) or
    ``blocks`` (the explicit scores, whole: the blocked variant of long sequences is not modelled)."""

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    def counted(self) -> list[int]:
        """Positions the loss counts at each step, at most: every position whose token k+2 ahead exists."""
        return [self.micro_batch * max(0, self.seq_len - k - 2) for k in range(self.ttt_steps)]


def draft_params(c: Eagle3Config) -> dict[str, int]:
    """Parameters of the draft by part (``models/draft.py``); ``embedding`` is the verifier's, frozen."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "fc": 3 * c.target_hidden_size * h,
        "attention": 2 * h * (q + 2 * kv) + q * h,
        "mlp": 3 * h * c.intermediate_size,
        "norms": 4 * h,
        "lm_head": c.draft_vocab_size * h,
        "embedding": c.vocab_size * h,
    }


def trainable_params(c: Eagle3Config) -> int:
    return sum(n for part, n in draft_params(c).items() if part != "embedding")


def ttt_saved_bytes(job: JobShape) -> dict[str, float]:
    """Bytes autograd keeps for the backward of one TTT forward, by term (see the module docstring)."""
    c, b, t = job.draft, job.micro_batch, job.seq_len
    n_tok = b * t
    h, i_size, vd = c.hidden_size, c.intermediate_size, c.draft_vocab_size
    heads, q, kv = c.num_attention_heads, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    bf16 = job.dtype == "bf16"
    s = 2 if bf16 else 4  # outputs of matrix products (and the inputs autocast casts for them)
    # Whether torch.matmul copies its batched operands (models/draft.py ttt_attention): q [B, Hkv, g, T, d] folds
    # into one batch dimension without a copy only for one sequence; K and V broadcast over the g query heads of
    # their group fold only when nothing but the broadcast dimension (or nothing at all) is wider than one.
    kv_heads = c.num_key_value_heads
    group = heads // kv_heads
    q_copy = b > 1 and heads > 1
    kv_copy = (group > 1 and (kv_heads > 1 or b > 1)) or (group == 1 and b > 1 and kv_heads > 1)
    flash = job.attention == "flash"
    terms = dict.fromkeys(
        ("loss: fused head's gradients (input and weight)", "attention probabilities [T, T+k]",
         "mlp", "attention q/k/v/o", "norms and hidden states (fp32)", "bf16 copies of weights and inputs", "other"),
        0.0,
    )
    # The fused, chunked head and loss (models/fused_ce.py) keeps no [positions, V_draft] tensor: only its
    # gradients, computed in the forward, one fp32 row per counted position and one fp32 copy of the head.
    terms["loss: fused head's gradients (input and weight)"] = 4 * vd * h
    for k, n in enumerate(job.counted()):
        terms["loss: fused head's gradients (input and weight)"] += 4 * n * h
        # gate, SiLU(gate), up, SiLU(gate)*up; the MLP's input (fp32, or a bf16 cast for each of gate and up)
        terms["mlp"] += 4 * n_tok * i_size * s + (2 * n_tok * h * 2 if bf16 else 4 * n_tok * h)
        # q/k/v read cat(embedding, hidden): one fp32 tensor, or three bf16 casts
        qkv_input = 3 * 2 * n_tok * h * 2 if bf16 else 2 * n_tok * h * 4
        if flash:
            # models/ttt_attention.py TTTFlashAttention: q, this step's K and V (earlier steps' are already kept),
            # the output (laid out [B, T, H, d] by the kernel, so o_proj's input is a view of it, not a copy), and
            # float32 log-sum-exps (the causal part's, and from step 1 on the merged one): no [T, T] tensor
            terms["attention probabilities [T, T+k]"] += b * heads * t * 4 * (2 if k else 1)
            terms["attention q/k/v/o"] += 2 * n_tok * q * s + 2 * n_tok * kv * s + qkv_input
        else:
            terms["attention probabilities [T, T+k]"] += b * heads * t * (t + k) * (6 if bf16 else 4)
            # o_proj's input; q as the batched product reads it (a copy when several sequences' heads must be
            # folded into one batch dimension), from step 1 also q itself for the diagonal terms; K and V expanded
            # to every query head for the batched products (copies, unless the expansion folds into a view), from
            # step 1 also this step's own K and V
            attn = 2 * n_tok * q * s + (n_tok * q * s if k and q_copy else 0) + (2 * n_tok * kv * s if k else 0)
            attn += 2 * n_tok * q * s if kv_copy else (2 * n_tok * kv * s if k == 0 else 0)
            terms["attention q/k/v/o"] += attn + qkv_input
        # three normalised outputs and two inputs in the layer; at the head the gathered hidden states and their
        # normalised form (in fp32, or a bf16 gather, its fp32 cast and a bf16 normalised form)
        terms["norms and hidden states (fp32)"] += 5 * n_tok * h * 4 + n * h * (4 + 4)
        # RoPE tables, gathered indices, norm scales, loss weights; the explicit scores' causal mask and scale
        terms["other"] += 2 * t * c.head_dim * s + 16 * n + 4 * (2 * n_tok + n) + (0 if flash else t * t + 8)
    if bf16:
        p = draft_params(c)
        # fc's input needs no gradient: its weight is not kept; the fused head casts its weight per call, keeping none
        weights = p["attention"] + p["mlp"]
        terms["bf16 copies of weights and inputs"] = 2 * weights + n_tok * 3 * c.target_hidden_size * 2
    return terms


@dataclass
class Memory:
    """One GPU's memory at its peak, by term (bytes)."""

    terms: dict[str, float]
    moment: str
    """'forward end', 'backward' or 'optimizer step': the moment the peak falls on."""
    moments: dict[str, float] = field(default_factory=dict)
    """Total bytes at each of the three moments."""

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def peak_memory(
    job: JobShape, stage: int, world: int, online: bool, ddp: bool | None = None, foreach: bool = True
) -> Memory:
    """Bytes per GPU at the peak of a training step; ``stage`` 0 is DDP (``ddp`` defaults to ``world > 1``) or a
    single process, 1-3 DeepSpeed ZeRO; ``online``: a verifier replica runs on the same GPU; ``foreach``: the
    optimizer updates all its tensors at once (torch's default on GPUs) rather than one at a time (on CPUs)."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage {stage} is not one of {STAGES}")
    ddp = world > 1 if ddp is None else ddp
    c = job.draft
    p = draft_params(c)
    trainable = trainable_params(c)
    n_tok = job.tokens
    shard = world if stage == 3 else 1
    optimizer_shard = world if stage >= 1 else 1
    if job.optimizer == "muon":  # Muon: one momentum for the hidden matrices; AdamW's two for the head and norms
        muon = p["fc"] + p["attention"] + p["mlp"]
        optimizer = 4 * muon + 8 * (trainable - muon)
    else:
        optimizer = 8 * trainable
    persistent = {
        "verifier_weights": job.verifier_bytes * job.verifier.params() if online else 0.0,
        "draft_weights": 4 * trainable / shard,
        "frozen_embedding": 4 * p["embedding"] / shard,
        # fp32 (train/ttt.py TeacherHead); under autocast also a bf16 copy of the columns outside the draft vocabulary
        # and their norms (fp32)
        "teacher_head": 4 * c.vocab_size * c.target_hidden_size
        + ((2 * c.target_hidden_size + 4) * (c.vocab_size - c.draft_vocab_size) if job.dtype == "bf16" else 0),
        "master_weights": 4 * trainable / world if stage >= 1 else 0.0,
        "optimizer_states": optimizer / optimizer_shard,
        # input_ids, loss_mask, attention_mask int64; aux and final states collated to fp32 (train/sampler.py)
        "batch": n_tok * (3 * 8 + 4 * 4 * c.target_hidden_size) + 8 * c.draft_vocab_size + c.vocab_size,
    }
    buffers = 0.0
    if stage == 0 and ddp:
        buffers = 4 * trainable  # DDP's buckets hold a second copy of the gradients
    elif stage == 3:
        # allocated when DeepSpeed builds the optimizer and kept: the flat gradient partitions and the reduction
        # bucket (``reduce_bucket_size`` elements, fp32); with several ranks also one module's weights gathered
        # and the prefetch bucket (a single rank holds every weight whole and gathers nothing)
        buffers = 4 * trainable / world + 4 * REDUCE_BUCKET
        if world > 1:
            largest = max(p["embedding"], p["lm_head"], c.hidden_size * c.intermediate_size)
            buffers += 4 * largest + 4 * PREFETCH_BUCKET
    if online:
        # the verifier's forward (no grad): the captured states and one layer's widest temporaries, bf16
        v = job.verifier.complete()
        buffers += 2 * n_tok * (4 * v.hidden_size + 3 * v.widest_mlp() + 2 * v.hidden_size)
    persistent["engine_buffers"] = buffers

    saved = sum(ttt_saved_bytes(job).values())
    counted = job.counted()
    s = 2 if job.dtype == "bf16" else 4
    kv = c.num_key_value_heads * c.head_dim
    heads, t, last = c.num_attention_heads, job.seq_len, job.ttt_steps - 1
    # the forward's peak, inside the fused head and loss (models/fused_ce.py): the teacher's probabilities (and each
    # position's top-1), the gathered and the normed states of every counted position, one chunk's logits,
    # log-probabilities and teacher rows (fp32), the TTT cache's step-0 keys/values and the last hidden state; under
    # autocast also the bf16 fused state, fc weight and head weight
    n_counted = sum(counted)
    # (the teacher's rows: every position a trained token follows, all but each sequence's last)
    teacher_rows = n_tok - job.micro_batch
    forward = (4 * teacher_rows * c.draft_vocab_size + n_tok + 8 * n_tok) + 2 * 4 * n_counted * c.hidden_size
    rows = min(job.loss_chunk, n_counted)
    chunk = rows * c.draft_vocab_size
    # (the chunk's logits and logit-gradient buffers in the compute dtype, and the eager terms' fp32 logits, teacher
    # rows and log-probabilities), the transposed input-gradient buffer of a chunk, and the head transposed for the
    # logits' product (in the compute dtype)
    if job.dtype == "bf16":
        forward += 16 * chunk + 2 * rows * c.hidden_size + 2 * p["lm_head"]
    else:
        forward += 16 * chunk + 4 * rows * c.hidden_size + 4 * p["lm_head"]
    forward += 2 * n_tok * kv * s + 4 * n_tok * c.hidden_size
    if job.dtype == "bf16":
        forward += 2 * n_tok * c.hidden_size + 2 * p["fc"] + 2 * p["lm_head"]
    # early backward: the last step's loss and MLP are freed, every weight but fc has its gradient, and the
    # attention backward holds its temporaries: through the flash kernel, float32 and compute-dtype copies of the
    # incoming gradient, the gradients of q, K and V, and the diagonal terms' float32 stacks (O(T)); through the
    # explicit scores two [B, heads, T, T+k] fp32 tensors
    last_step = 4 * n_tok * c.intermediate_size * s
    q_width = c.num_attention_heads * c.head_dim
    if job.attention == "flash":
        attention_backward = n_tok * q_width * (16 + 2 * s) + n_tok * kv * (2 * s + 16 * last)
    else:
        attention_backward = 2 * 4 * job.micro_batch * heads * t * (t + last)
    backward = -last_step + 4 * (trainable - p["fc"]) + attention_backward
    # optimizer step: gradients, the engines' step buffers, the optimizer's temporaries (foreach: one fp32 tensor
    # per parameter it updates; one at a time: the largest)
    largest_param = max(p["lm_head"], c.hidden_size * c.intermediate_size, p["fc"])
    temporaries = 4 * trainable / optimizer_shard if foreach else 4 * largest_param
    if stage == 3:
        # the hooks reduce each gradient into its persistent partition and free it: only the optimizer's
        step = temporaries
    else:
        step = 4 * trainable + temporaries
    if stage in (1, 2):
        # ZeRO-1/2 allocate their reduction bucket at the first gradient hook (the end of the backward: the unroll
        # hands every weight its gradient only then) and keep it until the backward's epilogue, beside the
        # gradients and, from then on, the gradient partition
        step += 4 * REDUCE_BUCKET + 4 * trainable / world
    moments = {"forward end": saved + forward, "backward": saved + backward, "optimizer step": step}
    moment = max(moments, key=moments.__getitem__)
    dynamic = {"gradients": 0.0, "ttt_activations": 0.0, "step_buffers": 0.0}
    if moment == "forward end":
        dynamic["ttt_activations"] = saved + forward
    elif moment == "backward":
        dynamic["gradients"] = 4 * (trainable - p["fc"])
        dynamic["ttt_activations"] = saved + backward - dynamic["gradients"]
    else:
        dynamic["gradients"] = 4 * trainable if stage < 3 else 0.0  # ZeRO-3's partitions are engine buffers
        dynamic["step_buffers"] = step - dynamic["gradients"]
    base = sum(persistent.values())
    return Memory({**persistent, **dynamic}, moment, {m: base + v for m, v in moments.items()})


# --------------------------------------------------------------------------------------------------------- compute
def draft_flops(c: Eagle3Config, seq_len: int, ttt_steps: int, loss_fraction: float = 1.0) -> float:
    """Model FLOPs of training on one sequence (forward + backward over the TTT unroll, the frozen teacher head),
    as ``fledge bench train`` counts them; ``loss_fraction`` of the positions go through lm_head."""
    counted = [loss_fraction * max(0, seq_len - k - 2) for k in range(ttt_steps)]
    return train_step_flops(c, 1, seq_len, ttt_steps, counted)["total"]


def verifier_flops(v: VerifierShape, seq_len: int) -> float:
    """FLOPs of the verifier's forward over one sequence as the cache runs it (decoder only, no head; causal
    attention counts the pairs it keeps; a MoE layer counts its router and the experts each token runs through)."""
    v = v.complete()
    h, q, kv = v.hidden_size, v.num_attention_heads * v.head_dim, v.num_key_value_heads * v.head_dim
    projections = h * q + 2 * h * kv + q * h
    attention = 2 * 2 * q * seq_len * (seq_len + 1) / 2
    return v.num_hidden_layers * (2 * seq_len * projections + attention) + 2 * seq_len * v.mlp_params(active=True)


def cache_bytes_per_token(hidden_size: int, storage_bytes: int) -> int:
    """Bytes the cache stores per token (``data/cache.py`` ``write_shard``): three aux states and the final state
    in the storage dtype, the token id (int32) and its loss mask (uint8)."""
    return 4 * hidden_size * storage_bytes + 4 + 1


CACHE_BYTES_PER_CONVERSATION = 16
"""Each conversation's offset and index (int64) in its shard."""


def gib(n: float) -> float:
    return n / GIB


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
