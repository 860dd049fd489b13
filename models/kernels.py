"""Which kernel runs a frozen model's linear layers when it decodes on a CPU: torch's default, or oneDNN with the
weights packed once.

Speculative decoding lives on the cost of checking k tokens at once, v(k) in plain decoding steps. On a CPU that
cost is decided by the matrix products of a handful of rows, and torch's default fp32 path (MKL) handles those
badly on some CPUs. Measured on a 2-core AMD EPYC (AVX2) with the default verifier (SmolLM2-135M, fp32): MKL
checked 2 tokens in 1.64 plain steps and 3 to 9 tokens in 2.04, while oneDNN with pre-packed weights took 1.10 and
1.23-1.43, and decoded one token 5 % faster (docs/experiments/2026-12-01-speed.md, "Kernels"). Whether it pays
elsewhere is a measurement, never an assumption: ``choose_linear_kernel`` times both on the model's own layer
shapes.

The same holds in bf16 on a CPU with AMX (2-core Intel Xeon, SmolLM2-135M in bf16): torch's default ran the
verifier's one-token step in 35 ms, oneDNN on packed weights in 28 ms, and the draft's products 1.5-2.5x faster
(docs/experiments/2026-12-06-packed-bf16.md).

Only inference is affected (packed weights are constants: no gradient flows through them), and the choice is
made once per loaded model, so plain and speculative decoding of one evaluation run the same arithmetic.

Attention of a verifier with grouped-query heads (fewer key/value heads than query heads): transformers' ``sdpa``
hands the grouping to SDPA (``enable_gqa``) only when there is no mask, and otherwise copies every cached key and
value once per query head group (``repeat_kv``) in every layer of every step. A speculative block always has a mask
(a tree's, or the causal one after a past), so checking k tokens paid for a copy of the whole cache. On a CPU,
SDPA takes the grouping with a mask too, bit for bit the same: ``use_grouped_attention`` installs that
(``GROUPED_SDPA``) on a decoding verifier. Measured with the default verifier (SmolLM2-135M: 9 query heads, 3
key/value heads) in bf16 on a 2-core Intel Xeon with AMX, 400 cached positions: checking 4 or 16 tokens 3.6-3.8 ms
faster (40 → 37 ms, 45 → 41 ms), one token unchanged (docs/experiments/2026-12-06-round-cost.md).
"""

from __future__ import annotations

import logging
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from fledge.core.errors import ConfigError

log = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "default", "onednn")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes oneDNN's packed linear takes on a CPU (the activations must be of the same dtype)."""


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_forward(packed: torch.Tensor):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    return forward


def _packable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.device.type == "cpu" and \
        module.weight.dtype in PACKABLE_DTYPES


def pack_linears(model: nn.Module) -> int:
    """Make every ``nn.Linear`` of a frozen fp32 or bf16 CPU model run oneDNN on weights packed once; returns how
    many.

    The packed copy is taken now: weights changed later are not seen (the model must stay frozen).
    """
    count = 0
    for module in model.modules():
        if _packable(module):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.forward = types.MethodType(_packed_forward(packed), module)
            count += 1
    return count


def unpack_linears(model: nn.Module) -> nn.Module:
    """Undo ``pack_linears``: every ``nn.Linear`` runs its class's forward on its own weight again (needed before a
    copy of a packed model changes dtype, since the packed weights keep the old one). Returns the model."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__dict__.pop("forward", None)
    return model


def _best_seconds(fn, repeats: int = 5, inner: int = 8) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def time_linear_kernels(weight: torch.Tensor, rows: tuple[int, ...] = (1, 5)) -> dict[str, float]:
    """Seconds of one product of ``rows`` x weight^T, summed over ``rows``, for each kernel (fastest of repeats), in
    the weight's dtype."""
    weight = weight.detach().cpu()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    xs = [torch.randn(n, weight.shape[1]).to(weight.dtype) for n in rows]
    return {
        "default": sum(_best_seconds(lambda x=x: nn.functional.linear(x, weight)) for x in xs),
        "onednn": sum(_best_seconds(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
                      for x in xs),
    }


def choose_linear_kernel(model: nn.Module, requested: str) -> str:
    """``default`` or ``onednn`` for this model on this machine. ``auto`` times both on the model's widest and
    narrowest linear layers, for one row and for five (a decoding step and a typical verification), and keeps
    oneDNN only when it is at least 10 % faster: a near tie stays with torch's default."""
    if requested not in LINEAR_KERNELS:
        raise ConfigError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {requested!r}")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packable = bool(linears) and all(_packable(m) for m in linears) and len({m.weight.dtype for m in linears}) == 1
    if requested == "default" or not packable or not onednn_available():
        if requested == "onednn":
            raise ConfigError(
                "linear_kernel=onednn needs a model in float32 or bfloat16 on the CPU and a torch built with oneDNN",
                fix="use linear_kernel=auto or default",
            )
        return "default"
    if requested == "onednn":
        return "onednn"
    by_size = sorted(linears, key=lambda m: m.weight.numel())
    seconds = {"default": 0.0, "onednn": 0.0}
    for module in (by_size[0], by_size[-1]):
        for kernel, s in time_linear_kernels(module.weight).items():
            seconds[kernel] += s
    choice = "onednn" if seconds["onednn"] < 0.9 * seconds["default"] else "default"
    log.info("linear kernel: %s (1- and 5-row products: default %.2f ms, oneDNN %.2f ms)", choice,
             1e3 * seconds["default"], 1e3 * seconds["onednn"])
    return choice


def use_linear_kernel(model: nn.Module, requested: str) -> str:
    """Choose the kernel (``choose_linear_kernel``) and install it; returns the choice."""
    choice = choose_linear_kernel(model, requested)
    if choice == "onednn":
        pack_linears(model)
    return choice


GROUPED_SDPA = "fledge_grouped_sdpa"
"""The attention implementation ``use_grouped_attention`` installs: transformers' ``sdpa``, with SDPA itself doing
the grouped-query heads under a mask on a CPU."""


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: a masked CPU attention over grouped key/value heads runs as one
    SDPA call with ``enable_gqa`` (no copy of the cache per head group); everything else goes to the stock
    ``sdpa``."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = attention_mask is not None and not dropout and kwargs.get("softcap") is None and \
        kwargs.get("position_bias") is None and key.shape[-1] == value.shape[-1]
    if not (grouped and plain and query.device.type == "cpu"):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # (every layer: only here)

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module) -> bool:
    """Run a CPU model's ``sdpa`` attention as ``grouped_sdpa`` when its heads are grouped; returns whether it
    does. Same numbers bit for bit (``tests/test_kernels.py``); a model whose attention cannot be switched keeps its
    own, with one log line."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
    on_cpu = next(model.parameters()).device.type == "cpu"
    if config._attn_implementation != "sdpa" or not on_cpu or not kv_heads or kv_heads >= heads:
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks sdpa gets
    try:
        model.set_attn_implementation(GROUPED_SDPA)
    except (ValueError, KeyError, AttributeError) as e:
        log.info("grouped-query attention: keeping sdpa (%s)", e)
        return False
    return True
