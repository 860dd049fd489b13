"""The attention of the training-time-test unroll (``train/ttt.py``), without a dense [T, k*T] mask.

At unroll step k the query at position t attends causally to the step-0 keys 0..t and to key t of each later step
1..k (the earlier draft steps of its own chain), which is what the same query sees at inference through the KV
cache. Two implementations give the same numbers (``tests/test_ttt.py``: float64, forward and gradients, against
ordinary attention over the concatenated keys with the block mask [tril | eye | ... | eye]):

- ``flash`` (``TTTFlashAttention``): a flash-attention kernel runs the causal part over the step-0 keys and returns
  its output and log-sum-exp; the k diagonal scores (one dot product per query and step) are merged in by their
  log-sum-exp. Nothing [T, T] is ever materialised, and autograd keeps only q, the keys, the values, the output and
  two log-sum-exps: O(T) memory. The backward calls the kernel's own backward with the incoming gradient scaled by
  the causal part's share of the softmax and with the merged output, which makes the kernel's row term
  rowsum(dO * O) the merged one; the diagonal terms' gradients are a few [T, k] products beside it.
  On the CPU the kernel is torch's ``_scaled_dot_product_flash_attention_for_cpu`` (float64, float32, bfloat16; it
  was 2.4-2.8x faster than the explicit scores at T = 1,024 on an AMX Xeon, docs/design.md); on CUDA, torch's
  memory-efficient attention. Each device's kernel is checked once against the explicit scores before its first
  use (``flash_available``), and a device whose kernel is missing or disagrees falls back to ``blocks`` with one
  warning.
- ``blocks``: the scores against step 0 are one [T, T] product, the diagonal ones dot products, and one softmax runs
  over their concatenation. With ``query_chunk`` > 0 and T longer than it, the queries go in blocks of that many
  rows, each recomputed in the backward (``torch.utils.checkpoint``): peak attention memory O(chunk·T) instead of
  O(k·T²).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.utils.checkpoint

from fledge.core.errors import ConfigError

log = logging.getLogger(__name__)

ATTENTION_KERNELS = ("auto", "flash", "blocks")


class TTTCache:
    """Keys/values of the training-time-test unroll: one [B, kv_heads, T, d] entry per step taken so far.
    ``query_chunk`` and ``kernel``: see ``ttt_attention``."""

    def __init__(self, query_chunk: int = 0, kernel: str = "auto") -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.query_chunk = query_chunk
        self.kernel = kernel

    @property
    def steps(self) -> int:
        return len(self.keys)

    # Eager under torch.compile (``train.compile``'s compiled unroll step): the kernel's own autograd function and
    # the cache's lists stay outside the compiled graphs, which end and resume around this call.
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError("the TTT unroll builds its own attention pattern; attn_mask must be None")
        if self.keys and self.keys[0].shape != k.shape:
            raise ValueError(f"TTT step keys {tuple(k.shape)} differ from step 0's {tuple(self.keys[0].shape)}")
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values, self.query_chunk, self.kernel)


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], query_chunk: int = 0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of step k = len(keys) - 1 of the TTT unroll (the pattern in the module docstring).

    q [B, H, T, d]; keys/values: one [B, Hkv, T, d] per step 0..k. ``kernel``: ``flash``, ``blocks``, or ``auto``
    (``flash`` where the device's kernel passed its check, else ``blocks``); ``query_chunk``: the query block of
    ``blocks`` (0: the whole sequence at once).
    """
    if kernel not in ATTENTION_KERNELS:
        raise ConfigError(f"ttt.attention must be one of {ATTENTION_KERNELS}, got {kernel!r}")
    if kernel == "flash" or (kernel == "auto" and flash_available(q.device)):
        return TTTFlashAttention.apply(q, *keys, *values)
    return block_ttt_attention(q, keys, values, query_chunk)


# ------------------------------------------------------------------------------------------------------------ flash
def _causal_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(output [B, H, T, d] in q's dtype, log-sum-exp [B, H, T] in float32 or float64, what the backward needs)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    # CUDA: memory-efficient attention wants as many key heads as query heads; its log-sum-exp may be padded
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=scale
    )
    return out, lse[..., : q.shape[2]], (lse, seed, offset)


def _causal_backward(grad_out, q, k, v, out, lse, extra, scale: float):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True, scale=scale
        )
    padded_lse, seed, offset = extra
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    kx, vx = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if group > 1 else (k, v)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, kx, vx, torch.empty(0, device=q.device, dtype=q.dtype), out, padded_lse, seed, offset, 0.0,
        [True, True, True, False], True, scale=scale,
    )
    if group > 1:
        b, _, t, d = dk.shape
        dk, dv = dk.view(b, hkv, group, t, d).sum(2), dv.view(b, hkv, group, t, d).sum(2)
    return dq, dk, dv


class TTTFlashAttention(torch.autograd.Function):
    """``ttt_attention`` through a flash-attention kernel for the causal part; arguments (q, *keys, *values)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, *keys_values: torch.Tensor) -> torch.Tensor:
        n = len(keys_values) // 2
        keys, values = keys_values[:n], keys_values[n:]
        b, h, t, d = q.shape
        hkv = keys[0].shape[1]
        scale = 1.0 / math.sqrt(d)
        out, lse0, extra = _causal_forward(q, keys[0], values[0], scale)
        lse = lse0
        if n > 1:
            acc = lse0.dtype  # float32 (float64 for float64 inputs): the merge runs at the softmax's precision
            qg = q.view(b, hkv, h // hkv, t, d).to(acc)
            diag_k = torch.stack(keys[1:], dim=3).to(acc)  # [B, Hkv, T, k, d]
            diag_v = torch.stack(values[1:], dim=3).to(acc)
            scores = torch.einsum("bkgtd,bktnd->bkgtn", qg, diag_k) * scale
            lse = torch.logaddexp(lse0, scores.logsumexp(-1).reshape(b, h, t))
            share = (lse0 - lse).exp()
            probs = (scores - lse.view(b, hkv, h // hkv, t, 1)).exp()
            diagonal = torch.einsum("bkgtn,bktnd->bkgtd", probs, diag_v).reshape(b, h, t, d)
            merged = share[..., None] * out.to(acc) + diagonal
            out = merged.to(q.dtype)
        ctx.save_for_backward(q, *keys, *values, out, lse0, lse, *extra)
        ctx.steps, ctx.scale = n, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        n, scale = ctx.steps, ctx.scale
        saved = ctx.saved_tensors
        q, keys, values = saved[0], saved[1 : 1 + n], saved[1 + n : 1 + 2 * n]
        out, lse0, lse = saved[1 + 2 * n : 4 + 2 * n]
        extra = saved[4 + 2 * n :]
        b, h, t, d = q.shape
        hkv, group = keys[0].shape[1], h // keys[0].shape[1]
        acc = lse0.dtype
        # The kernel's backward forms rowsum(dO' * O') from what it is given: with dO' = share * dO and the merged O
        # that is share * rowsum(dO * O), the merged softmax's term, so its causal-part gradients are the merged ones.
        share = (lse0 - lse).exp()
        scaled = (grad_out.to(acc) * share[..., None]).to(q.dtype).contiguous()
        dq, dk0, dv0 = _causal_backward(scaled, q, keys[0], values[0], out, lse0, extra, scale)
        if n == 1:
            return dq, dk0, dv0
        qg = q.view(b, hkv, group, t, d).to(acc)
        diag_k = torch.stack(keys[1:], dim=3).to(acc)
        diag_v = torch.stack(values[1:], dim=3).to(acc)
        probs = (torch.einsum("bkgtd,bktnd->bkgtn", qg, diag_k) * scale - lse.view(b, hkv, group, t, 1)).exp()
        go = grad_out.reshape(b, hkv, group, t, d).to(acc)
        row = (go * out.view(b, hkv, group, t, d).to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
        dscores = probs * (torch.einsum("bkgtd,bktnd->bkgtn", go, diag_v) - row) * scale
        dq = dq + torch.einsum("bkgtn,bktnd->bkgtd", dscores, diag_k).reshape(b, h, t, d).to(dq.dtype)
        dk = torch.einsum("bkgtn,bkgtd->bktnd", dscores, qg).to(keys[0].dtype)
        dv = torch.einsum("bkgtn,bkgtd->bktnd", probs, go).to(values[0].dtype)
        return (dq, dk0, *dk.unbind(3), dv0, *dv.unbind(3))


_FLASH_CHECKED: dict[str, bool] = {}


def flash_available(device: torch.device) -> bool:
    """Whether ``flash`` runs on this device type: its kernel exists and, on a small random problem in float32,
    gives the explicit scores' output and gradients (checked once per device type; a failure warns once)."""
    kind = device.type
    if kind not in _FLASH_CHECKED:
        _FLASH_CHECKED[kind] = _check_flash(device)
    return _FLASH_CHECKED[kind]


def _check_flash(device: torch.device) -> bool:
    if device.type not in ("cpu", "cuda"):
        log.warning("ttt.attention: no flash kernel for %s; the unroll uses the explicit scores (blocks)", device)
        return False
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 1, 4, 2, 40, 64
    try:
        with torch.autocast(device_type=device.type, enabled=False), torch.enable_grad():
            # drawn on the CPU (the generator's device), the same problem on every device, then moved
            shapes = [(b, h, t, d)] + [(b, hkv, t, d)] * 6
            inputs = [torch.randn(*shape, generator=gen, device="cpu").to(device).requires_grad_() for shape in shapes]
            weight = torch.randn(b, h, t, d, generator=gen, device="cpu").to(device)
            q, keys, values = inputs[0], inputs[1:4], inputs[4:7]
            got = TTTFlashAttention.apply(q, *keys, *values)
            want = block_ttt_attention(q, keys, values, 0)
            got_grads = torch.autograd.grad((got * weight).sum(), inputs)
            want_grads = torch.autograd.grad((want * weight).sum(), inputs)
            for a, e in zip((got, *got_grads), (want, *want_grads)):
                torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-4)
    except Exception as err:  # a missing kernel, an unsupported GPU, a disagreement: fall back, loudly
        log.warning("ttt.attention: the flash kernel on %s failed its check (%s); the unroll uses the explicit "
                    "scores (blocks)", device, str(err).splitlines()[0][:200])
        return False
    return True


# ----------------------------------------------------------------------------------------------------------- blocks
def block_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], query_chunk: int = 0
) -> torch.Tensor:
    """``ttt_attention`` with explicit scores: one [T, T] product against step 0, one dot product per query for each
    later step, one softmax over their concatenation; in recomputed blocks of ``query_chunk`` query rows when T is
    longer than that (module docstring)."""
    t = q.shape[2]
    if query_chunk <= 0 or t <= query_chunk:
        return _ttt_attention_rows(q, keys[0], values[0], keys[1:], values[1:], 0)
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in [q, *keys, *values])
    blocks = []
    for start in range(0, t, query_chunk):
        end = min(start + query_chunk, t)
        args = (q[:, :, start:end], keys[0][:, :, :end], values[0][:, :, :end],
                [k[:, :, start:end] for k in keys[1:]], [v[:, :, start:end] for v in values[1:]], start)
        if recompute:
            blocks.append(torch.utils.checkpoint.checkpoint(_ttt_attention_rows, *args, use_reentrant=False))
        else:
            blocks.append(_ttt_attention_rows(*args))
    return torch.cat(blocks, dim=2)


def _ttt_attention_rows(
    q: torch.Tensor, key0: torch.Tensor, value0: torch.Tensor, diag_keys: list[torch.Tensor],
    diag_values: list[torch.Tensor], start: int,
) -> torch.Tensor:
    """Query rows ``start .. start + n`` (q [B, H, n, d]) against the step-0 keys ``0 .. start + n`` and their own
    rows' keys of the later steps (each [B, Hkv, n, d])."""
    b, h, n, d = q.shape
    hkv = key0.shape[1]
    group = h // hkv
    # Grouped-query attention by broadcasting: [B, Hkv, group, n, d] queries against [B, Hkv, 1, T, d] keys.
    qg = q.reshape(b, hkv, group, n, d) * (1.0 / math.sqrt(d))
    scores0 = torch.matmul(qg, key0.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, g, n, start + n]
    causal = torch.ones(n, key0.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=start)
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    diagonal = [(qg * k_i.unsqueeze(2)).sum(-1, keepdim=True).to(scores0.dtype) for k_i in diag_keys]
    # Softmax in float32 (as the reference implementations do): under bf16 autocast the scores are bf16.
    scores = torch.cat([scores0, *diagonal], dim=-1)
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value0.dtype)
    width = key0.shape[2]
    out = torch.matmul(probs[..., :width], value0.unsqueeze(2))
    for i, v_i in enumerate(diag_values):
        out = out + probs[..., width + i : width + i + 1] * v_i.unsqueeze(2)
    return out.reshape(b, h, n, d)
