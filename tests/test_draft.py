"""The EAGLE-3 draft module: serving names, init, RoPE, config from verifiers, and the inference KV cache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from fledge.models.draft import DraftKVCache, Eagle3Config, Eagle3Draft, rope_inv_freq

SERVING_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**over) -> Eagle3Config:
    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        draft_vocab_size=30,
        target_hidden_size=24,
        rope_theta=10000.0,
    )
    kw.update(over)
    return Eagle3Config(**kw)


def tiny_draft(dtype: torch.dtype = torch.float64, **over) -> Eagle3Draft:
    draft = Eagle3Draft(tiny_config(**over), seed=0).to(dtype)
    # Norm weights away from one, so that a mix-up of the three norms would show.
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return draft.eval()


def test_serving_names_shapes_and_frozen_embedding() -> None:
    cfg = tiny_config()
    draft = Eagle3Draft(cfg, seed=0)
    state = draft.trainable_state_dict()
    assert set(state) == SERVING_KEYS
    h, ht = cfg.hidden_size, cfg.target_hidden_size
    assert state["fc.weight"].shape == (h, 3 * ht)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim, 2 * h)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (cfg.num_key_value_heads * cfg.head_dim, 2 * h)
    assert state["midlayer.self_attn.o_proj.weight"].shape == (h, cfg.num_attention_heads * cfg.head_dim)
    assert state["lm_head.weight"].shape == (cfg.draft_vocab_size, h)
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (cfg.draft_vocab_size,)
    assert state["t2d"].dtype == torch.bool and state["t2d"].shape == (cfg.vocab_size,)
    assert not draft.embed_tokens.weight.requires_grad
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trainable == SERVING_KEYS - {"d2t", "t2d"}
    # The RoPE frequencies are not state: a checkpoint holds nothing a config does not determine.
    assert "embed_tokens.weight" in draft.state_dict() and len(draft.state_dict()) == len(SERVING_KEYS) + 1


def test_init_is_official_and_seeded() -> None:
    cfg = tiny_config(hidden_size=64, intermediate_size=256, target_hidden_size=64)
    a, b, c = Eagle3Draft(cfg, seed=3), Eagle3Draft(cfg, seed=3), Eagle3Draft(cfg, seed=4)
    for name, p in a.trainable_state_dict().items():
        assert torch.equal(p, b.trainable_state_dict()[name]), name
    assert not torch.equal(a.fc.weight, c.fc.weight)
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        assert torch.equal(a.get_submodule(norm).weight, torch.ones(64))
    for w in (a.fc.weight.detach(), a.midlayer.mlp.up_proj.weight.detach(), a.lm_head.weight.detach()):
        assert abs(float(w.mean())) < 2e-3 and abs(float(w.std()) - 0.02) < 1e-3


def test_trainable_state_round_trip_and_embedding_load() -> None:
    cfg = tiny_config()
    a, b = Eagle3Draft(cfg, seed=1), Eagle3Draft(cfg, seed=2)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    a.load_verifier_embedding(emb)
    assert torch.equal(a.embed_tokens.weight, emb) and not a.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="does not fit"):
        a.load_verifier_embedding(torch.randn(cfg.vocab_size, cfg.hidden_size + 1))
    b.load_trainable_state_dict(a.trainable_state_dict())
    assert all(torch.equal(v, b.trainable_state_dict()[k]) for k, v in a.trainable_state_dict().items())
    with pytest.raises(KeyError, match="missing"):
        b.load_trainable_state_dict({k: v for k, v in a.trainable_state_dict().items() if k != "fc.weight"})


def test_set_draft_vocab_checks_consistency() -> None:
    cfg = tiny_config()
    draft = Eagle3Draft(cfg)
    chosen = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[: cfg.draft_vocab_size]
    chosen = chosen.sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(cfg.draft_vocab_size)
    draft.set_draft_vocab(d2t, t2d)
    assert torch.equal(torch.arange(cfg.draft_vocab_size) + draft.d2t, chosen)
    bad = d2t.clone()
    bad[3] += 1
    with pytest.raises(ValueError, match="disagree"):
        draft.set_draft_vocab(bad, t2d)
    with pytest.raises(ValueError, match="must be"):
        draft.set_draft_vocab(d2t[:-1], t2d)


def test_config_dict_round_trip_and_validation() -> None:
    cfg = tiny_config(rope_scaling={"type": "linear", "factor": 2.0})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    again = Eagle3Config.from_dict(cfg.to_dict())
    assert again == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        Eagle3Config.from_dict({**cfg.to_dict(), "hiden_size": 3})
    with pytest.raises(ValueError, match="multiple of"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny_config(draft_vocab_size=51)
    with pytest.raises(ValueError, match="not supported"):
        tiny_config(rope_scaling={"rope_type": "longrope", "factor": 2.0})
    assert tiny_config(rope_scaling={"rope_type": "default"}).rope_scaling is None


VERIFIER_CONFIGS = [
    (LlamaConfig, {}, 16),
    (Qwen2Config, {}, 16),  # no head_dim attribute: hidden / heads
    (Qwen3Config, {"head_dim": 32}, 32),  # head_dim independent of hidden / heads
    (MistralConfig, {}, 16),
]


@pytest.mark.parametrize("cls,extra,head_dim", VERIFIER_CONFIGS, ids=lambda x: getattr(x, "__name__", None))
def test_from_verifier_tiny_configs(cls, extra, head_dim) -> None:
    hf = cls(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rope_theta=50000.0,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        **extra,
    )
    cfg = Eagle3Config.from_verifier(hf, draft_vocab_size=128, aux_layer_ids=[2, 2, 1])
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size) == (64, 64, 160)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, head_dim)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.aux_layer_ids) == (300, 128, [2, 2, 1])
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 1024 and cfg.rms_norm_eps == 1e-5 and cfg.hidden_act == "silu"
    draft = Eagle3Draft(cfg)
    out = draft(torch.randn(1, 5, 64), torch.randint(0, 300, (1, 5)), torch.arange(5))
    assert out.shape == (1, 5, 64)


def test_from_verifier_smollm2_values() -> None:
    # SmolLM2-135M-Instruct's config.json values (the default verifier).
    hf = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        tie_word_embeddings=True,
    )
    cfg = Eagle3Config.from_verifier(hf, draft_vocab_size=32000, aux_layer_ids=[2, 15, 27])
    assert cfg == Eagle3Config(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        draft_vocab_size=32000,
        target_hidden_size=576,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        aux_layer_ids=[2, 15, 27],
        hidden_act="silu",
    )


def test_from_verifier_rope_scaling_new_and_old_styles() -> None:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=4,
        vocab_size=100,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **llama3},
    )
    cfg = Eagle3Config.from_verifier(hf, 50, [1, 2, 3])
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == llama3
    # transformers 4.x configs: rope_theta and rope_scaling attributes, "type" instead of "rope_type".
    old = SimpleNamespace(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=100,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        hidden_act="silu",
        rope_theta=20000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
    )
    cfg = Eagle3Config.from_verifier(old, 50, [1, 2, 3])
    assert cfg.rope_theta == 20000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 1


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_matches_transformers(scaling) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=10,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})},
    )
    cfg = Eagle3Config.from_verifier(hf, 10, [0, 0, 0])
    draft = Eagle3Draft(cfg)
    positions = torch.tensor([[0, 1, 7, 300, 4000]])
    cos, sin = draft.rope(positions)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 5, 64), positions)
    torch.testing.assert_close(cos[:, 0], ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], ref_sin, rtol=1e-5, atol=1e-5)
    if scaling is not None:
        assert not torch.allclose(rope_inv_freq(cfg), rope_inv_freq(tiny_config(head_dim=64)))


def test_bfloat16_cast_keeps_rope_exact() -> None:
    draft = Eagle3Draft(tiny_config()).to(torch.bfloat16)
    assert draft._inv_freq.dtype == torch.float32
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.t2d.dtype == torch.bool


def make_inputs(draft: Eagle3Draft, t: int, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    hidden = torch.randn(batch, t, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=g)
    return hidden, ids


def test_kv_cache_token_by_token_equals_full_forward() -> None:
    draft = tiny_draft()
    hidden, ids = make_inputs(draft, 9)
    with torch.no_grad():
        full = draft(hidden, ids, torch.arange(9))
        cache = DraftKVCache(capacity=2)  # forces the storage to grow while decoding
        steps = [draft(hidden[:, i : i + 1], ids[:, i : i + 1], torch.tensor([i]), kv_cache=cache) for i in range(9)]
    assert len(cache) == 9
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    # A multi-token chunk after a cached prefix (causal within the chunk, all of the prefix visible).
    with torch.no_grad():
        cache = DraftKVCache()
        a = draft(hidden[:, :4], ids[:, :4], torch.arange(4), kv_cache=cache)
        b = draft(hidden[:, 4:], ids[:, 4:], torch.arange(4, 9), kv_cache=cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-10, atol=1e-10)


def test_kv_cache_crop_rolls_back() -> None:
    draft = tiny_draft()
    hidden, ids = make_inputs(draft, 8)
    other_hidden, other_ids = make_inputs(draft, 8, seed=1)
    with torch.no_grad():
        cache = DraftKVCache()
        draft(hidden, ids, torch.arange(8), kv_cache=cache)
        cache.crop(5)
        assert len(cache) == 5
        # Positions 5..7 rewritten with different inputs, as after rejected draft tokens.
        tail = draft(other_hidden[:, 5:], other_ids[:, 5:], torch.arange(5, 8), kv_cache=cache)
        mixed_hidden = torch.cat([hidden[:, :5], other_hidden[:, 5:]], 1)
        mixed_ids = torch.cat([ids[:, :5], other_ids[:, 5:]], 1)
        ref = draft(mixed_hidden, mixed_ids, torch.arange(8))
    torch.testing.assert_close(tail, ref[:, 5:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError):
        cache.crop(9)


def test_tree_mask_and_keep() -> None:
    """Three sibling candidates after a prefix, drafted in one call with a tree mask; keep() prunes to one."""
    draft = tiny_draft()
    hidden, ids = make_inputs(draft, 5, batch=1)
    cand_hidden, cand_ids = make_inputs(draft, 3, batch=1, seed=2)
    with torch.no_grad():
        cache = DraftKVCache()
        draft(hidden, ids, torch.arange(5), kv_cache=cache)
        # Each candidate sits at position 5 and sees the prefix and itself only.
        mask = torch.zeros(1, 1, 3, 8, dtype=torch.bool)
        mask[..., :5] = True
        mask[0, 0, torch.arange(3), 5 + torch.arange(3)] = True
        branches = draft(cand_hidden, cand_ids, torch.full((3,), 5), kv_cache=cache, attn_mask=mask)
        # The additive form of the same mask gives the same result.
        cache.crop(5)
        additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
        branches_add = draft(cand_hidden, cand_ids, torch.full((3,), 5), kv_cache=cache, attn_mask=additive)
        torch.testing.assert_close(branches_add, branches, rtol=1e-10, atol=1e-10)
        for j in range(3):
            seq_hidden = torch.cat([hidden, cand_hidden[:, j : j + 1]], 1)
            ref = draft(seq_hidden, torch.cat([ids, cand_ids[:, j : j + 1]], 1), torch.arange(6))
            torch.testing.assert_close(branches[:, j], ref[:, 5], rtol=1e-10, atol=1e-10)
        # Accept candidate 2: keep the prefix and its entry, then continue decoding after it.
        cache.keep(torch.tensor([0, 1, 2, 3, 4, 7]))
        assert len(cache) == 6
        nxt_hidden, nxt_ids = make_inputs(draft, 1, batch=1, seed=3)
        nxt = draft(nxt_hidden, nxt_ids, torch.tensor([6]), kv_cache=cache)
        seq_hidden = torch.cat([hidden, cand_hidden[:, 2:3], nxt_hidden], 1)
        seq_ids = torch.cat([ids, cand_ids[:, 2:3], nxt_ids], 1)
        ref = draft(seq_hidden, seq_ids, torch.arange(7))
    torch.testing.assert_close(nxt[:, 0], ref[:, 6], rtol=1e-10, atol=1e-10)


def test_keep_per_row_indices() -> None:
    cache = DraftKVCache()
    k = torch.arange(2 * 1 * 4 * 1, dtype=torch.float32).view(2, 1, 4, 1)
    cache.append(k, -k)
    cache.keep(torch.tensor([[0, 2], [1, 3]]))
    assert len(cache) == 2
    assert cache.k[0, 0, :2, 0].tolist() == [0.0, 2.0] and cache.k[1, 0, :2, 0].tolist() == [5.0, 7.0]
    assert cache.v[1, 0, :2, 0].tolist() == [-5.0, -7.0]
    with pytest.raises(ValueError, match="indices"):
        cache.keep(torch.tensor([0, 2]))


def test_logits_over_draft_vocab() -> None:
    draft = tiny_draft()
    hidden, ids = make_inputs(draft, 4)
    out = draft(hidden, ids, torch.arange(4))
    logits = draft.logits(out)
    assert logits.shape == (2, 4, draft.config.draft_vocab_size)
    # The final norm is applied before lm_head: scaling the hidden state leaves the logits unchanged.
    torch.testing.assert_close(draft.logits(out * 3.0), logits, rtol=1e-6, atol=1e-6)
    assert math.isfinite(float(logits.detach().sum()))
