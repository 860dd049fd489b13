"""``fledge export check``: a clean export passes; each known way a checkpoint goes wrong is caught, with its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge.export.check import check_checkpoint, looks_like_indices
from fledge.export.job import check_main
from fledge.export.write import export_draft
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.verifier import load_embed_and_head

V, H, LAYERS, DRAFT_V = 300, 32, 8, 64
AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("check") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clean(verifier_dir, tmp_path_factory) -> Path:
    """A correct bf16 export of a random draft whose vocabulary looks frequency-chosen (low ids + a scattering)."""
    from transformers import AutoConfig

    draft = Eagle3Draft(Eagle3Config.from_verifier(AutoConfig.from_pretrained(verifier_dir), DRAFT_V, AUX), seed=0)
    draft.load_verifier_embedding(load_embed_and_head(verifier_dir)[0])
    others = 40 + torch.randperm(V - 40, generator=torch.Generator().manual_seed(3))[: DRAFT_V - 40]
    ids = torch.sort(torch.cat([torch.arange(40), others])).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_draft_vocab(ids - torch.arange(DRAFT_V), t2d)
    return export_draft(draft, verifier_dir, tmp_path_factory.mktemp("clean") / "serving")


def broken(
    clean: Path,
    dest: Path,
    config: Callable[[dict], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of the clean export with its config and/or tensors edited in place by the given functions."""
    shutil.copytree(clean, dest)
    if config is not None:
        data = json.loads((dest / "config.json").read_text())
        config(data)
        (dest / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        weights = load_file(str(dest / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(dest / "model.safetensors"))
    return dest


def codes(path: Path, verifier_dir: Path | None, level: str = "error") -> set[str]:
    return {f.code for f in check_checkpoint(path, verifier_dir) if f.level == level}


def test_clean_checkpoint_passes(clean, verifier_dir, capsys):
    assert check_checkpoint(clean, verifier_dir) == []
    assert check_checkpoint(clean) == []
    assert check_main([str(clean), "--verifier", str(verifier_dir)]) == 0
    assert "OK" in capsys.readouterr().out


def _set(key: str, value) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config[key] = value

    return edit


def _indices_instead_of_offsets(weights: dict[str, torch.Tensor]) -> None:
    weights["d2t"] = torch.arange(DRAFT_V) + weights["d2t"]


def _tie_head(weights: dict[str, torch.Tensor], embed: torch.Tensor) -> None:
    rows = torch.arange(DRAFT_V) + weights["d2t"]
    weights["lm_head.weight"] = embed[rows].to(weights["lm_head.weight"].dtype)


def _shift_ids(config: dict) -> None:
    # A common slip: the same ids in both fields (SGLang would read one layer deeper than vLLM).
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(config["eagle_aux_hidden_state_layer_ids"])


FAILURE_MODES = {
    # name: (config edit, tensor edit needing the verifier embedding or not, expected error code)
    "wrong architecture": (_set("architectures", ["LlamaForCausalLM"]), None, "architecture"),
    "missing d2t": (None, lambda w, e: w.pop("d2t"), "d2t-missing"),
    "indices instead of offsets": (None, lambda w, e: _indices_instead_of_offsets(w), "d2t-holds-indices"),
    "tied head": (None, _tie_head, "tied-head"),
    "random embedding": (None, lambda w, e: w.update({"embed_tokens.weight": 0.02 * torch.randn(V, H)}), "embedding-mismatch"),
    "shifted layer ids": (_shift_ids, None, "layer-ids-shifted"),
    "two layers": (_set("num_hidden_layers", 2), None, "num-layers"),
    # The official EAGLE code then expects the checkpoint's own embedding and runs with a random one.
    "target_hidden_size without an embedding": (_set("target_hidden_size", H), None, "eagle-random-embedding"),
}


@pytest.mark.parametrize("mode", list(FAILURE_MODES))
def test_each_failure_mode_is_an_error(mode, clean, verifier_dir, tmp_path, capsys):
    edit_config, edit_tensors, code = FAILURE_MODES[mode]
    embed = load_embed_and_head(verifier_dir)[0]
    path = broken(
        clean,
        tmp_path / "ckpt",
        config=edit_config,
        tensors=(lambda w: edit_tensors(w, embed)) if edit_tensors else None,
    )
    findings = check_checkpoint(path, verifier_dir)
    errors = [f for f in findings if f.level == "error"]
    assert code in {f.code for f in errors}, findings
    assert all(f.fix and f.message for f in findings)
    assert check_main([str(path), "--verifier", str(verifier_dir)]) != 0
    printed = capsys.readouterr().out
    assert f"[{code}]" in printed and "fix:" in printed


def test_more_failure_modes(clean, verifier_dir, tmp_path):
    def case(name: str, **edits) -> set[str]:
        return codes(broken(clean, tmp_path / name, **edits), verifier_dir)

    # SGLang skips layers.0.* names in this format (vLLM would accept them).
    assert "layer-names" in case(
        "names", tensors=lambda w: [w.__setitem__(k.replace("midlayer.", "layers.0."), w.pop(k)) for k in list(w) if "midlayer." in k]
    )
    assert "d2t-out-of-range" in case("range", tensors=lambda w: w.__setitem__("d2t", w["d2t"] + V))
    assert "d2t-t2d-mismatch" in case("t2d", tensors=lambda w: w.__setitem__("t2d", torch.roll(w["t2d"], 1)))
    assert "tied-config" in case("tieflag", config=_set("tie_word_embeddings", True))
    assert "layer-id-not-served" in case(
        "final", config=lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [2, 4, LAYERS],
                                            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, LAYERS - 1]}})
    )
    assert "layer-ids-order" in case(
        "order", config=lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [4, 2, 5],
                                            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 1, 4]}})
    )
    assert "layer-ids-top-missing" in case("only-sglang", config=lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    assert "tensor-shapes" in case("shape", config=_set("draft_vocab_size", DRAFT_V + 1))
    assert "missing-tensors" in case("missing", tensors=lambda w: w.pop("midlayer.hidden_norm.weight"))
    assert "unknown-tensors" in case("unknown", tensors=lambda w: w.__setitem__("model.extra", torch.zeros(1)))
    assert "verifier-vocab-size" in case("vocab", config=_set("vocab_size", V + 1))
    assert codes(broken(clean, tmp_path / "none", config=lambda c: c.pop("eagle_config")), verifier_dir, "warning") == {
        "layer-ids-sglang-missing"
    }


def test_embedding_checks_need_the_verifier(clean, verifier_dir, tmp_path):
    embed = load_embed_and_head(verifier_dir)[0]
    same = broken(clean, tmp_path / "same", tensors=lambda w: w.update({"embed_tokens.weight": embed.to(torch.bfloat16)}))
    assert check_checkpoint(same, verifier_dir) == []  # the verifier's own embedding (bf16-rounded) is fine
    # ... and so is target_hidden_size once the embedding ships: every consumer then reads the same one.
    shipped = broken(same, tmp_path / "shipped", config=_set("target_hidden_size", H))
    assert check_checkpoint(shipped, verifier_dir) == []
    random = broken(clean, tmp_path / "random", tensors=lambda w: w.update({"embed_tokens.weight": torch.randn(V, H)}))
    assert codes(random, None, "warning") == {"embedding-unverified"}
    assert check_main([str(random)]) == 0  # cannot be judged without the verifier: a warning, not an error
    assert check_main([str(random), "--verifier", str(verifier_dir)]) == 1


def test_speculators_format_without_norm_flag(clean, verifier_dir, tmp_path):
    """vLLM reads an absent norm_before_residual as true in the speculators format: a different network."""
    from fledge.export.write import speculators_config
    from fledge.models.serving import read_serving_checkpoint

    spec = tmp_path / "spec"
    spec.mkdir()
    flat = json.loads((clean / "config.json").read_text())
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {k: v for k, v in flat.items() if k not in ("architectures", "eagle_config", "fledge")},
        "draft_vocab_size": DRAFT_V,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": AUX,
        "torch_dtype": "bfloat16",
    }
    (spec / "config.json").write_text(json.dumps(config))
    weights = load_file(str(clean / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}, str(spec / "model.safetensors"))
    assert codes(spec, verifier_dir) == {"norm-flag-missing"}
    config["norm_before_residual"] = False
    (spec / "config.json").write_text(json.dumps(config))
    assert check_checkpoint(spec, verifier_dir) == []
    assert read_serving_checkpoint(spec).format == "speculators" and callable(speculators_config)


def test_not_a_serving_checkpoint(tmp_path):
    assert codes(tmp_path, None) == {"no-config"}
    assert check_main([str(tmp_path)]) == 1


def test_indices_rule():
    """The d2t rule of looks_like_indices: t2d decides when it can; without it, a strictly rising table is indices."""
    targets = torch.tensor([0, 1, 2, 5, 6, 9, 10, 11, 40, 41])
    offsets = targets - torch.arange(10)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[targets] = True
    assert looks_like_indices(offsets, 50, t2d) == (False, "")
    assert looks_like_indices(offsets, 50, None)[0] is False  # non-decreasing, with flat runs: offsets
    assert looks_like_indices(targets, 50, t2d)[0] is True  # t2d marks exactly the values: indices
    assert looks_like_indices(targets, 50, None)[0] is True  # strictly rising at every step
    gappy = torch.tensor([0, 2, 4, 6, 8, 10, 12, 14, 16, 18])  # no two adjacent ids, but t2d agrees: offsets
    gappy_t2d = torch.zeros(50, dtype=torch.bool)
    gappy_t2d[gappy + torch.arange(10)] = True
    assert looks_like_indices(gappy, 50, gappy_t2d)[0] is False
    overflowing = torch.arange(10) * 4 + 10  # ids 10..46; as offsets, i + d2t reaches 55 > 49: the message says so
    verdict, evidence = looks_like_indices(overflowing, 50, None)
    assert verdict and "map past" in evidence


PUBLISHED = Path(__file__).parent / "fixtures" / "published" / "eagle3-llama3.1-instruct-8b"


def test_a_published_eagle3_checkpoint_checks_and_imports(verifier_dir, tmp_path):
    """The EAGLE-3 authors' Llama-3.1-8B draft (its config.json and tensor names, fixtures/published/): its shapes
    are the ones fledge expects, and a scaled-down copy passes the check and imports."""
    from fledge.models.serving import expected_shapes, load_exported

    config = json.loads((PUBLISHED / "config.json").read_text())
    published = {name: tuple(shape) for name, shape in json.loads((PUBLISHED / "tensors.json").read_text()).items()}
    full = expected_shapes(config)
    assert {k: v for k, v in published.items() if k not in ("d2t", "t2d")} == full
    assert published["d2t"] == (config["draft_vocab_size"],) and published["t2d"] == (config["vocab_size"],)

    # Every width scaled to the tiny verifier; the names and every other key kept, the file format too.
    small = {**config, "hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": 4,
             "num_key_value_heads": 1, "vocab_size": V, "draft_vocab_size": DRAFT_V}
    shapes = expected_shapes(small)
    g = torch.Generator().manual_seed(11)
    tensors = {name: (0.05 * torch.randn(shapes[name], generator=g)).to(torch.float16) for name in full}
    ids = torch.sort(torch.randperm(V, generator=g)[:DRAFT_V]).values
    tensors["d2t"] = ids - torch.arange(DRAFT_V)
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    assert set(tensors) == set(published)
    folder = tmp_path / "eagle3-llama3.1-instruct-8b-small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(small))
    torch.save(tensors, folder / "pytorch_model.bin")

    findings = check_checkpoint(folder, verifier_dir)
    # It loads right in every engine; what it leaves to their defaults is reported, nothing more.
    assert sorted((f.level, f.code) for f in findings) == [("warning", "layer-ids-missing"), ("warning", "rope-missing")]
    draft = load_exported(folder, verifier_dir)
    assert draft.config.aux_layer_ids == [2, LAYERS // 2, LAYERS - 3]  # the engines' default, as they serve it
    assert draft.config.rope_theta == 10000.0 and draft.config.rms_norm_eps == 1e-05
    state = draft.state_dict()
    for name in full:
        assert torch.equal(state[name], tensors[name].float()), name
    assert torch.equal(draft.d2t, tensors["d2t"]) and torch.equal(draft.t2d, tensors["t2d"])
