"""The EAGLE-3 draft head: one Llama-style decoder layer over fused verifier features and token embeddings.

Parameter names are the serving names of vLLM's and SGLang's ``LlamaForCausalLMEagle3`` (``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d``), so export is a state-dict filter with no renaming.

One ``forward`` serves every caller; what differs is only how attention sees the keys:

- no cache: ordinary causal (or ``attn_mask``) attention over the call's own tokens;
- ``DraftKVCache`` (inference): keys/values are appended to a cache and the queries attend to everything cached,
  causally by default or through a tree mask from the evaluator;
- ``TTTCache`` (training-time test, see ``train/ttt.py`` and ``models/ttt_attention.py``): each unroll step appends
  its keys; a query at step k attends causally to the step-0 keys and to the same-position key of steps 1..k.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fledge.core.errors import ConfigError, MismatchError
from fledge.models.fused_ce import fused_soft_cross_entropy
from fledge.models.ttt_attention import TTTCache

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class Eagle3Config:
    hidden_size: int
    """Width of the draft's decoder layer; equal to the verifier's (the draft reads the verifier's embedding)."""
    intermediate_size: int
    """Width of the MLP (EAGLE-3 copies the verifier's)."""
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than ``num_attention_heads`` for grouped-query attention; must divide it."""
    head_dim: int
    vocab_size: int
    """The verifier's vocabulary size (rows of ``embed_tokens``, length of ``t2d``)."""
    draft_vocab_size: int
    """Rows of ``lm_head``: the draft predicts only over this most-frequent subset of the verifier's vocabulary."""
    target_hidden_size: int
    """The verifier's hidden size; ``fc`` reads the three aux states concatenated, 3 * target_hidden_size wide."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """HF-style RoPE scaling (``{"rope_type": "llama3", "factor": 8.0, ...}``); None is plain RoPE."""
    max_position_embeddings: int = 2048
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 2, 2])
    """``output_hidden_states`` indices of the verifier states that ``fc`` fuses (index 0 = embedding output)."""
    hidden_act: str = "silu"
    aux_scale: list[float] | None = None
    """Divisors of the three aux states before ``fc`` (None: 1, 1, 1): a constant per layer, so that the fused
    features and ``fc``'s updates are on one scale although the verifier's layers are not (on SmolLM2-135M their
    RMS runs 2.7 / 6.3 / 23). Export folds them into ``fc.weight``, which then reads the raw states: the served
    checkpoint is a plain EAGLE-3 head."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) must lie in 1..vocab_size ({self.vocab_size})"
            )
        if len(self.aux_layer_ids) != 3:
            raise ConfigError(f"aux_layer_ids must hold 3 indices, got {self.aux_layer_ids}")
        if self.aux_scale is not None:
            if len(self.aux_scale) != 3 or not all(float(v) > 0 for v in self.aux_scale):
                raise ConfigError(f"aux_scale must hold 3 positive numbers, got {self.aux_scale}")
            self.aux_scale = [float(v) for v in self.aux_scale]
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (silu, gelu, gelu_pytorch_tanh, relu)")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)

    @classmethod
    def from_verifier(cls, hf_config: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> Eagle3Config:
        """A draft sized and RoPE-configured like the verifier (what vLLM and SGLang assume when serving it)."""
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        rope_theta, rope_scaling = rope_settings(text)
        return cls(
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(text.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(text.hidden_size),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 2048)),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            hidden_act=str(getattr(text, "hidden_act", "silu")),
        )

    def aux_columns(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                    ) -> torch.Tensor | None:
        """``aux_scale`` per column of ``fc``'s input ([3 * target_hidden_size]), or None without it: what
        ``Eagle3Draft.fuse`` divides the concatenated states by, and what export folds into ``fc.weight``."""
        if self.aux_scale is None:
            return None
        divisors = torch.tensor(self.aux_scale, dtype=dtype, device=device)
        return divisors.repeat_interleave(self.target_hidden_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"Eagle3Config.from_dict: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**d)


def _normalise_rope_scaling(scaling: dict | None) -> dict | None:
    """One spelling for RoPE scaling: ``rope_type`` (older configs say ``type``), None for plain RoPE."""
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"RoPE type {rope_type!r} is not supported by the draft; supported: {ROPE_TYPES}")
    if "factor" not in scaling:
        raise ConfigError(f"RoPE scaling {rope_type!r} needs a 'factor', got {scaling}")
    if rope_type == "llama3":
        needed = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in needed if k not in scaling]
        if missing:
            raise ConfigError(f"llama3 RoPE scaling misses {missing}: {scaling}")
    return {"rope_type": rope_type, **scaling}


def rope_settings(config: Mapping[str, Any] | Any, default_theta: float | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a model config, whichever way it spells them: a transformers-5
    ``rope_parameters`` dict, or the older ``rope_theta`` + ``rope_scaling``; a config object or a config.json dict.

    The one reader for the verifier's config (the draft copies its RoPE) and for serving checkpoints (import).
    ``default_theta`` is what a config without any theta means (the engines' 10000); None refuses it.
    """
    if isinstance(config, Mapping):
        get = config.get
    else:
        def get(key: str, default: Any = None) -> Any:
            return getattr(config, key, default)
    params = get("rope_parameters") or {}
    if isinstance(params, Mapping) and params and "rope_theta" not in params and "rope_type" not in params:
        # Per-layer-type RoPE ({"full_attention": {...}, "sliding_attention": {...}}): the draft's single layer
        # is a full-attention layer.
        params = params.get("full_attention") or next(iter(params.values()))
    theta = params.get("rope_theta") if params else None
    if theta is None:
        theta = get("rope_theta")
    if theta is None:
        theta = default_theta
    if theta is None:
        raise ConfigError("the config has neither rope_parameters with a rope_theta nor rope_theta")
    scaling = dict(params) if params else (dict(get("rope_scaling")) if get("rope_scaling") else None)
    return float(theta), _normalise_rope_scaling(scaling)


def rope_inv_freq(config: Eagle3Config) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, as Hugging Face and vLLM compute them for each RoPE type."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        # Positions divided by the factor, i.e. every frequency divided by it.
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class VocabProblem:
    code: str
    """``d2t-out-of-range``, ``d2t-duplicates``, ``d2t-unsorted`` or ``d2t-t2d-mismatch``."""
    message: str


def draft_vocab_problems(
    d2t: torch.Tensor, t2d: torch.Tensor | None = None, vocab_size: int | None = None
) -> list[VocabProblem]:
    """What is wrong with a draft vocabulary, most fundamental first; empty when it is sound.

    ``d2t`` holds offsets (draft id i is verifier id ``i + d2t[i]``); ``t2d``, when given, is the bool mask over the
    verifier vocabulary that must mark exactly those ids (its length is then the vocabulary size). fledge keeps
    draft ids in ascending verifier-id order (``d2t-unsorted`` otherwise); engines do not mind the order, so
    importers and the export checker treat that one as a warning. The one definition of a consistent vocabulary:
    the draft, the cache's vocabulary file, the importer and the checker all call it.
    """
    if t2d is not None:
        vocab_size = int(t2d.numel())
    if vocab_size is None:
        raise ValueError("draft_vocab_problems needs t2d or vocab_size")
    targets = torch.arange(d2t.numel()) + d2t.detach().cpu().long()
    outside = (targets < 0) | (targets >= vocab_size)
    if outside.any():
        i = int(outside.nonzero()[0])
        return [VocabProblem("d2t-out-of-range", f"d2t maps draft id {i} to target id {int(targets[i])}, outside "
                                                 f"0..{vocab_size - 1} ({int(outside.sum())} such draft ids)")]
    problems = []
    values, counts = targets.unique(return_counts=True)
    if (counts > 1).any():
        problems.append(VocabProblem("d2t-duplicates",
                                     f"d2t maps several draft ids to target id {int(values[counts > 1][0])}"))
    falls = (targets[1:] <= targets[:-1]).nonzero()
    if falls.numel():
        i = int(falls[0]) + 1
        problems.append(VocabProblem(
            "d2t-unsorted",
            f"d2t target ids are not ascending at draft id {i} ({int(targets[i - 1])} then {int(targets[i])})",
        ))
    if t2d is not None:
        marked = t2d.detach().cpu().bool()
        if int(marked.sum()) != targets.numel():
            problems.append(VocabProblem(
                "d2t-t2d-mismatch", f"t2d marks {int(marked.sum())} target ids but d2t has {targets.numel()} draft ids"
            ))
        elif not marked[targets].all():
            i = int((~marked[targets]).nonzero()[0])
            problems.append(VocabProblem(
                "d2t-t2d-mismatch", f"t2d does not mark target id {int(targets[i])}, which d2t maps draft id {i} to"
            ))
    return problems


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the Llama reference does; bf16 variance loses too much on wide states.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DraftKVCache:
    """Inference key/value cache of the draft's single layer: post-RoPE keys and values, [B, kv_heads, L, head_dim].

    Storage is preallocated and grows by doubling, so appending a token is a slice write, not a copy of the cache.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        """Number of cached positions; everything past it in the storage is stale."""

    def __len__(self) -> int:
        return self.length

    def _reserve(self, like: torch.Tensor, need: int) -> None:
        if self.k is not None and self.k.shape[2] >= need:
            return
        capacity = max(self.capacity, need, 2 * (self.k.shape[2] if self.k is not None else 0))
        b, h, _, d = like.shape
        k = like.new_empty(b, h, capacity, d)
        v = like.new_empty(b, h, capacity, d)
        if self.k is not None:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B, kv_heads, T, d] keys/values; returns views of all cached keys/values (length + T)."""
        if self.k is not None and (self.k.shape[0] != k.shape[0] or self.k.dtype != k.dtype):
            raise ValueError(
                f"cache holds batch {self.k.shape[0]} {self.k.dtype}, got {k.shape[0]} {k.dtype}; use a new cache"
            )
        end = self.length + k.shape[2]
        self._reserve(k, end)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, n: int) -> None:
        """Roll back to the first ``n`` positions (rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside 0..{self.length}")
        self.length = n

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the given positions, in the given order (tree pruning after acceptance).

        ``indices`` is [n] (the same positions for every batch row) or [B, n] (per row); all below ``length``.
        """
        if self.k is None:
            raise ValueError("keep() on an empty cache")
        indices = indices.to(self.k.device, torch.long)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.length):
            raise ValueError(f"keep(): indices must lie in 0..{self.length - 1}")
        n = indices.shape[-1]
        if indices.dim() == 1:
            k, v = self.k[:, :, indices], self.v[:, :, indices]
        else:
            idx = indices[:, None, :, None].expand(-1, self.k.shape[1], -1, self.k.shape[3])
            k, v = self.k.gather(2, idx), self.v.gather(2, idx)
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        self.length = n

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        past = self.length
        k_all, v_all = self.append(k, v)
        t = q.shape[2]
        if attn_mask is None and t > 1 and past > 0:
            # New tokens sit after the cached ones: query i sees every cached key and new keys up to itself.
            # (SDPA's is_causal aligns the triangle top-left, which is wrong once there is a past.)
            cols = torch.arange(past + t, device=q.device)
            attn_mask = cols[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
            return _sdpa(q, k_all, v_all, attn_mask, causal=False)
        return _sdpa(q, k_all, v_all, attn_mask, causal=attn_mask is None and past == 0)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # q/k/v read cat(normed embedding, normed hidden): twice the hidden width.
        in_dim = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: DraftKVCache | TTTCache | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if kv_cache is None:
            out = _sdpa(q, k, v, attn_mask, causal=attn_mask is None)
        else:
            out = kv_cache.attend(q, k, v, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = {
            "silu": F.silu,
            "gelu": F.gelu,
            "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "relu": F.relu,
        }[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: DraftKVCache | TTTCache | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # The residual stream carries the incoming hidden state (fused features, or the previous draft step's
        # output); only attention sees the embedding of the next token.
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, kv_cache, attn_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DraftHead(nn.Linear):
    """``lm_head``: a linear layer over the draft vocabulary which, given the teacher, returns its own fused, chunked
    soft cross-entropy instead of logits (``models.fused_ce``). The loss goes through the module's own call, so that
    ZeRO-3 gathers the weight for it as for any forward."""

    def forward(
        self,
        x: torch.Tensor,
        teacher: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        row_weight: torch.Tensor | None = None,
        chunk: int = 1024,
        teacher_top: torch.Tensor | None = None,
        compiled: bool = False,
        fed: torch.Tensor | None = None,
        top_k: int = 0,
    ):
        if teacher is None:
            return super().forward(x)
        return fused_soft_cross_entropy(
            x, self.weight, teacher, index, row_weight, chunk, teacher_top, compiled, fed=fed, top_k=top_k
        )


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = DraftHead(config.hidden_size, config.draft_vocab_size, bias=False)
        # Identity mapping until set_draft_vocab: draft token i is verifier token i.
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d)
        # A plain attribute, not a buffer: module.to(bfloat16) must not round the RoPE frequencies.
        self._inv_freq = rope_inv_freq(config)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int | None = None) -> None:
        """normal(0, 0.02) for linear and embedding weights, ones for norms (as the official EAGLE-3 code)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    w = torch.empty(module.weight.shape, dtype=torch.float32)
                    w.normal_(0.0, 0.02, generator=gen)
                    module.weight.copy_(w)
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def init_head_from_verifier(self, head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """``lm_head`` <- the verifier's head rows of the draft vocabulary, ``norm`` <- the verifier's final norm:
        the draft then reads its last hidden state as the verifier reads its own."""
        cfg = self.config
        if tuple(head.shape) != (cfg.vocab_size, cfg.hidden_size) or tuple(final_norm.shape) != (cfg.hidden_size,):
            raise MismatchError(
                f"verifier head {tuple(head.shape)} / final norm {tuple(final_norm.shape)} do not fit the draft "
                f"({cfg.vocab_size} x {cfg.hidden_size})"
            )
        rows = torch.arange(cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        with torch.no_grad():
            self.lm_head.weight.copy_(head.to(self.lm_head.weight)[rows.to(head.device)])
            self.norm.weight.copy_(final_norm.to(self.norm.weight))

    def init_as_lens(self) -> None:
        """Start as the verifier's logit lens on its top aux layer: ``fc`` passes that layer's state through and the
        decoder layer's two output projections start at zero, so the residual stream is that state, read by the
        (copied) head. Training then learns, from the next token's embedding, the step from there to t+2."""
        cfg = self.config
        if cfg.hidden_size != cfg.target_hidden_size:
            raise MismatchError(f"the lens initialisation needs the draft's hidden size ({cfg.hidden_size}) to be the "
                                f"verifier's ({cfg.target_hidden_size})")
        h = cfg.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * h:] = torch.eye(h, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
            self.midlayer.self_attn.o_proj.weight.zero_()
            self.midlayer.mlp.down_proj.weight.zero_()

    def init_layer_from_verifier(self, weights: dict[str, torch.Tensor], residual_scale: float = 1.0) -> list[str]:
        """The decoder layer <- the verifier's layer that reads the top aux state (``weights`` from
        ``models.verifier.load_layer``): q/k/v's columns over the hidden state, the output projections, the MLP and
        the norms, so that on a residual stream holding that state the layer computes what the verifier's does.
        ``residual_scale``: the residual stream holds the state divided by it (``aux_scale``), so the two output
        projections are divided by it too. q/k/v's columns over the next token's embedding keep their
        initialisation: the verifier has nothing to copy there. Returns the names of the tensors not copied (biases,
        per-head q/k norms), which the draft has no place for."""
        m, h = self.midlayer, self.config.hidden_size
        plan = {f"self_attn.{n}.weight": (getattr(m.self_attn, n).weight, n != "o_proj")
                for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        plan.update({f"mlp.{n}.weight": (getattr(m.mlp, n).weight, False)
                     for n in ("gate_proj", "up_proj", "down_proj")})
        plan["input_layernorm.weight"] = (m.hidden_norm.weight, False)
        plan["post_attention_layernorm.weight"] = (m.post_attention_layernorm.weight, False)
        missing = sorted(set(plan) - set(weights))
        if missing:
            raise MismatchError(f"the verifier's layer has no {', '.join(missing)}: its decoder layer is not a "
                                f"Llama-style one the draft's can copy")
        for name, (target, hidden_half) in plan.items():
            shape = (target.shape[0], h) if hidden_half else tuple(target.shape)
            if tuple(weights[name].shape) != tuple(shape):
                raise MismatchError(f"the verifier's {name} {tuple(weights[name].shape)} does not fit the draft's "
                                    f"{tuple(shape)}", fix="train.layer_init needs the draft shaped as the verifier "
                                                           "(no train.draft_intermediate_size)")
        with torch.no_grad():
            for name, (target, hidden_half) in plan.items():
                value = weights[name].to(target)
                if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    value = value / residual_scale
                (target[:, h:] if hidden_half else target).copy_(value)
        return sorted(set(weights) - set(plan))

    def load_verifier_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise MismatchError(
                f"verifier embedding {tuple(weight.shape)} does not fit the draft's embed_tokens "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary: ``target_id = i + d2t[i]``; ``t2d`` marks the verifier ids that are in it."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise MismatchError(
                f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} must be [{cfg.draft_vocab_size}] / [{cfg.vocab_size}]"
            )
        problems = draft_vocab_problems(d2t, t2d)
        if problems:
            raise ValueError(f"d2t and t2d disagree: {problems[0].message}")
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*target_hidden] concatenated aux states -> [B, T, hidden] fused features."""
        columns = self.config.aux_columns(device=aux.device)
        if columns is not None:
            aux = (aux / columns).to(aux.dtype)  # a bf16 state is divided in float32 and rounded back
        return self.fc(aux.to(self.fc.weight.dtype))

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B or 1, 1, T, head_dim] in float32 for the given positions."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        freqs = pos.float().unsqueeze(-1) * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: DraftKVCache | TTTCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder step. hidden [B, T, H] (fused features or the previous step's output), input_ids [B, T]
        (the token after each hidden's position), position_ids [B, T] or [T]. Returns the layer's output [B, T, H]
        before the final norm: what feeds back into the next draft step.

        attn_mask: bool (True = attend) or additive, [B, 1, T, T_total] where T_total counts cached positions
        after this call's append; None means causal.
        """
        hidden = hidden.to(self.fc.weight.dtype)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(position_ids)
        return self.midlayer(embeds, hidden, cos, sin, kv_cache, attn_mask)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary; map an argmax i to the verifier's id with ``i + d2t[i]``."""
        return self.lm_head(self.norm(hidden_out))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint or an export stores: all weights and d2t/t2d, but not the verifier's embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise KeyError(f"draft state dict mismatch: missing {missing}, unexpected {unexpected}")
