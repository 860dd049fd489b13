"""The kernels a decoding verifier runs: oneDNN with packed weights computes what torch's default does, and the
grouped-query attention what transformers' sdpa does."""

from __future__ import annotations

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.eval.ties import TieJudge
from fledge.decode.session import VerifierSession
from fledge.models.kernels import (
    GROUPED_SDPA,
    choose_linear_kernel,
    onednn_available,
    pack_linears,
    use_linear_kernel,
)
from fledge.models.verifier import VerifierConfig, load_verifier

from reference_decode import generate_plain

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear"),
]


def test_packed_linears_compute_what_the_default_does(tiny_verifier_dir):
    default = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    packed = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    linears = sum(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    assert pack_linears(packed.model) == linears > 0
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = default.model(input_ids=ids).logits
        got = packed.model(input_ids=ids).logits
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    # Decoding gives the same tokens whichever kernel runs the products.
    prompt = torch.arange(5, 40)
    assert generate_plain(packed.model, prompt, max_new_tokens=12).tokens == \
        generate_plain(default.model, prompt, max_new_tokens=12).tokens


def test_the_kernel_is_chosen_where_it_applies(tiny_verifier_dir):
    cfg = VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32")
    model = load_verifier(cfg).model
    assert choose_linear_kernel(model, "default") == "default"
    assert choose_linear_kernel(model, "onednn") == "onednn"
    assert choose_linear_kernel(model, "auto") in ("default", "onednn")  # a timing on this machine decides
    with pytest.raises(ConfigError, match="linear_kernel must be one of"):
        choose_linear_kernel(model, "fast")
    # Decoding stages honour the setting and record it; the cache and regeneration never change kernels.
    assert load_verifier(VerifierConfig(**{**cfg.__dict__, "linear_kernel": "onednn"}), decoding=True).linear_kernel == \
        "onednn"
    assert load_verifier(VerifierConfig(**{**cfg.__dict__, "linear_kernel": "onednn"})).linear_kernel == "default"
    # oneDNN packing is an fp32 / bf16 CPU path: an fp16 model cannot ask for it, and auto leaves it alone.
    fp16 = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float16")).model
    assert use_linear_kernel(fp16, "auto") == "default"
    with pytest.raises(ConfigError, match="float32 or bfloat16 on the CPU"):
        use_linear_kernel(fp16, "onednn")


def test_packed_bf16_linears_compute_what_the_default_does(tiny_verifier_dir):
    cfg = VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="bfloat16")
    default, packed = load_verifier(cfg), load_verifier(cfg)
    assert use_linear_kernel(packed.model, "onednn") == "onednn"
    assert all(m.forward.__func__ is not torch.nn.Linear.forward
               for m in packed.model.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = default.model(input_ids=ids).logits.float()
        got = packed.model(input_ids=ids).logits.float()
    # bf16 products summed in another order: equal to bf16 rounding of the logits' scale, not bitwise.
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    # The tie judge's float32 copy of a packed bf16 verifier runs torch's own kernels on float32 weights.
    reference = TieJudge(packed.model).reference
    assert all("forward" not in m.__dict__ for m in reference.modules())
    assert packed.model.model.layers[0].mlp.up_proj.forward.__func__ is not torch.nn.Linear.forward  # still packed
    with torch.inference_mode():
        fp32 = reference(input_ids=ids).logits
        assert fp32.dtype == torch.float32
        assert torch.allclose(fp32, default.model.float()(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_attention_computes_what_sdpa_does(tiny_verifier_dir, dtype, monkeypatch):
    cfg = VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype=dtype, linear_kernel="default")
    stock, grouped = load_verifier(cfg), load_verifier(cfg, decoding=True)
    assert stock.model.config._attn_implementation == "sdpa"
    assert grouped.model.config._attn_implementation == GROUPED_SDPA  # what an evaluation's report records
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def watched(query, key, value, **kwargs):
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False), kwargs.get("attn_mask") is None))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in (23, 9)]
    blocks = [[torch.randint(0, 1000, (n,), generator=gen) for n in sizes] for sizes in ((6, 3), (1, 5), (4, 4))]
    parents = [torch.tensor([-1, -1, 0, 1, 2]), torch.tensor([-1, -1])]  # a tree per row (5 and 2 nodes)
    outputs = {}
    for name, verifier in (("stock", stock), ("grouped", grouped)):
        got = []
        with torch.inference_mode():
            for rows in ([prompts[0]], prompts):  # batch 1 (its causal fast path for chains) and batch 2 (holes)
                with VerifierSession(verifier.model) as session:
                    session.prefill(rows)
                    for block in blocks:
                        block = block[: len(rows)]
                        got.append(session.forward(block)[0])
                        session.commit([list(range(len(b) - 1)) for b in block])
                        trees = [torch.cat([b[:1], p % 1000]) for b, p in zip(block, parents)]
                        got.append(session.forward(trees, parents[: len(rows)])[0])
                        session.commit([[0, 2] for _ in trees])
        outputs[name] = got
    assert len(outputs["stock"]) == 12
    for expected, got in zip(outputs["stock"], outputs["grouped"]):
        assert torch.equal(got, expected)  # bit for bit
    heads, kv_heads = stock.model.config.num_attention_heads, stock.model.config.num_key_value_heads
    grouped_calls = calls[len(calls) // 2:]
    masked = [c for c in grouped_calls if not c[3]]
    assert masked and all(c == (heads, kv_heads, True, False) for c in masked)  # one call, no copy per group
    assert any(c[1] == heads for c in calls[: len(calls) // 2] if not c[3])  # the stock path repeats the keys
