"""Loading verifiers (HF directory, GGUF, embedded default) and capturing their hidden states with hooks."""

from __future__ import annotations

import time

import pytest
import torch

from fledge.models.capture import capture_hidden, forward_hidden
from fledge.models.verifier import (
    VerifierConfig,
    check_aux_layer_ids,
    default_aux_layer_ids,
    load_embed_and_head,
    load_verifier,
    parse_dtype,
    resolve_verifier_dir,
    weight_fingerprint,
)

from conftest import TINY_ARCHS, make_tiny_verifier


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_capture_matches_output_hidden_states(arch, tmp_path, smollm_tokenizer):
    path = make_tiny_verifier(tmp_path, arch, smollm_tokenizer, layers=8)
    verifier = load_verifier(VerifierConfig(name_or_path=str(path), dtype="float32"))
    assert verifier.aux_layer_ids == [2, 4, 5] == default_aux_layer_ids(8)
    ids = torch.randint(10, 1000, (2, 17))
    attn = torch.ones_like(ids)
    attn[1, 12:] = 0  # right padding
    captured = forward_hidden(verifier.model, ids, attn, [0, 4, 8])
    with torch.no_grad():
        ref = verifier.model(ids, attention_mask=attn, output_hidden_states=True).hidden_states
    assert len(ref) == 9
    # index 0 = embeddings, i = input of layer i, L = final norm output (what output_hidden_states means).
    for got, idx in zip(captured.aux, [0, 4, 8]):
        torch.testing.assert_close(got, ref[idx])
    torch.testing.assert_close(captured.final, ref[-1])


def test_capture_hooks_are_removed(tiny_verifier_dir):
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    layers = verifier.model.model.layers
    with capture_hidden(verifier.model, [2, 4, 5]):
        assert layers[2]._forward_pre_hooks
    assert not layers[2]._forward_pre_hooks and not verifier.model.model.norm._forward_hooks


def test_bad_layer_ids_and_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="outside 0..8"):
        check_aux_layer_ids([2, 4, 9], 8)
    with pytest.raises(ValueError, match="3 indices"):
        check_aux_layer_ids([2, 4], 8)
    with pytest.raises(FileNotFoundError, match="cannot be downloaded"):
        resolve_verifier_dir(VerifierConfig(name_or_path="meta-llama/Llama-3.1-8B-Instruct"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_verifier_dir(VerifierConfig(name_or_path=str(tmp_path / "empty")))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_verifier_dir(VerifierConfig(name_or_path=str(tmp_path / "x.gguf")))
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("float8")
    assert parse_dtype("auto", "cuda") == torch.bfloat16


def test_fingerprint_follows_the_weights(tmp_path, smollm_tokenizer):
    a = make_tiny_verifier(tmp_path, "llama", smollm_tokenizer, seed=0)
    b = make_tiny_verifier(tmp_path, "llama", smollm_tokenizer, seed=1)
    assert weight_fingerprint(a) == weight_fingerprint(a)
    assert weight_fingerprint(a) != weight_fingerprint(b)


def test_embed_and_head_without_the_model(tiny_verifier_dir):
    from transformers import AutoModelForCausalLM

    embed, head = load_embed_and_head(tiny_verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32)
    torch.testing.assert_close(embed, model.get_input_embeddings().weight.detach())
    torch.testing.assert_close(head, model.get_output_embeddings().weight.detach())


def test_embedded_default_converts_once_and_reloads_fast(tmp_path):
    """The default verifier: its GGUF is de-quantised once into a safetensors dir, then reused."""
    cfg = VerifierConfig(home=str(tmp_path), dtype="float32")
    verifier = load_verifier(cfg)
    assert verifier.path == tmp_path / "verifiers" / "smollm2-135m-instruct"
    assert verifier.num_layers == 30 and verifier.hidden_size == 576
    assert verifier.aux_layer_ids == [2, 15, 27]
    tok = verifier.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "<|im_start|>" in tok.chat_template
    assert not hasattr(verifier.model.config, "quantization_config")
    start = time.perf_counter()
    again = load_verifier(cfg)
    assert time.perf_counter() - start < 15  # the ~40 s conversion is not redone
    assert again.fingerprint == verifier.fingerprint
    text = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    captured = forward_hidden(verifier.model, ids, None, verifier.aux_layer_ids)
    assert [a.shape[-1] for a in captured.aux] == [576] * 3
    # The de-quantised weights still make a working model: its greedy continuation is text, not noise.
    out = verifier.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert len(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()) > 0


def test_a_hub_id_resolves_to_its_snapshot_in_the_hf_cache_offline(tmp_path, monkeypatch, tiny_verifier_dir):
    import shutil

    import huggingface_hub.constants as hf

    from fledge.models.verifier import resolve_verifier_dir

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        resolve_verifier_dir(VerifierConfig(name_or_path="some-org/tiny-llama"))
    # the layout `huggingface-cli download some-org/tiny-llama` leaves behind
    repo = tmp_path / "hub" / "models--some-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_verifier_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    path = resolve_verifier_dir(VerifierConfig(name_or_path="some-org/tiny-llama"))
    assert path == repo / "snapshots" / commit
    with pytest.raises(FileNotFoundError, match="nor an embedded"):
        resolve_verifier_dir(VerifierConfig(name_or_path="no/such/dir"))


def test_device_map_auto_loads_through_accelerate_and_captures_the_same_states(tiny_verifier_dir):
    """verifier.device_map=auto (one process spreading a large verifier over its GPUs): on a CPU-only machine every
    layer lands on the CPU, and the captured states are unchanged."""
    plain = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    mapped = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32", device_map="auto"))
    assert mapped.device == torch.device("cpu")
    ids = torch.randint(10, 1000, (2, 12))
    a = forward_hidden(plain.model, ids, None, plain.aux_layer_ids)
    b = forward_hidden(mapped.model, ids, None, mapped.aux_layer_ids)
    for x, y in zip(a.aux + [a.final], b.aux + [b.final]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
