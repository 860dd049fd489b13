"""The serving checkpoint format of an EAGLE-3 draft, read in: what vLLM, SGLang and the official EAGLE code load.

Two layouts exist (docs/design.md, "Serving checkpoint"): ``LlamaForCausalLMEagle3`` (a flat config.json,
``midlayer.*`` tensors) and vllm-project/speculators (``Eagle3Speculator``: ``transformer_layer_config`` +
``speculators_config``, ``layers.0.*`` tensors). ``read_serving_checkpoint`` reads either into one flat view under
fledge's tensor names, and ``load_exported`` turns it into an ``Eagle3Draft``: fledge's own exports, or a third
party's. Writing and checking them is the export stage's (``export/``); evaluation reads them through this module.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from fledge.core.errors import FledgeError
from fledge.models.draft import Eagle3Config, Eagle3Draft, draft_vocab_problems, rope_settings
from fledge.models.verifier import default_aux_layer_ids, load_embed_and_head

log = logging.getLogger(__name__)


class ServingFormatError(FledgeError, ValueError):
    """A serving checkpoint that cannot be read, or that fledge's draft cannot represent."""


SERVING_ARCHITECTURE = "LlamaForCausalLMEagle3"
"""The architecture name both engines load as an EAGLE-3 head."""
VLLM_ONLY_ARCHITECTURES = ("Eagle3LlamaForCausalLM",)
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"

MIDLAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# Tensors an engine accepts besides the weights: the verifier's embedding and the draft-vocabulary maps.
OPTIONAL_TENSORS = ("embed_tokens.weight", "d2t", "t2d")
SAME_TENSOR_RTOL = 1e-2
"""A relative difference below this counts as "the same tensor" up to bf16/fp16 rounding (~4e-3)."""


@dataclass
class ServingCheckpoint:
    """A serving checkpoint read into one flat view, whichever of the two formats it is written in."""

    path: Path
    format: Literal["eagle3", "speculators"]
    raw_config: dict
    config: dict
    """Flat, LlamaForCausalLMEagle3-style view: for the speculators format, ``transformer_layer_config`` merged with
    the EAGLE-3 fields that live beside it."""
    tensors: dict[str, torch.Tensor]
    """Tensors under fledge's names (``midlayer.*``; a leading ``model.`` removed, ``layers.0.`` mapped)."""
    raw_names: list[str] = field(default_factory=list)


def is_serving_checkpoint(path: Path) -> bool:
    """A folder with a config.json that names an EAGLE-3 architecture (either format): an exported checkpoint, not
    a fledge training run or draft folder (those hold draft_config.json)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError:
        return False
    return bool(raw.get("architectures")) or raw.get("speculators_model_type") is not None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: ``model.safetensors``, sharded safetensors, or ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    if not files and (path / "pytorch_model.bin").is_file():
        # The original EAGLE-3 releases ship a pickle; weights_only refuses anything but tensors.
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if not tensors:
        raise ServingFormatError(
            f"{path}: no weights (model.safetensors, *.safetensors or pytorch_model.bin)", fix="re-export it"
        )
    return tensors


def canonical_name(name: str) -> str:
    """fledge's name for a tensor as third parties spell it (``model.`` prefix, ``layers.0.`` for ``midlayer.``)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    return name


def read_serving_checkpoint(path: Path) -> ServingCheckpoint:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ServingFormatError(f"{path}: no config.json", fix="point at an exported checkpoint folder")
    raw = json.loads(config_path.read_text())
    if raw.get("speculators_model_type") is not None:
        fmt = "speculators"
        flat = dict(raw.get("transformer_layer_config") or {})
        for key in (
            "draft_vocab_size",
            "target_hidden_size",
            "eagle_aux_hidden_state_layer_ids",
            "norm_before_residual",
            "torch_dtype",
            "dtype",
        ):
            if key in raw:
                flat[key] = raw[key]
        flat["architectures"] = raw.get("architectures")
    else:
        fmt = "eagle3"
        flat = dict(raw)
    tensors = read_tensors(path)
    return ServingCheckpoint(
        path=path,
        format=fmt,
        raw_config=raw,
        config=flat,
        tensors={canonical_name(k): v for k, v in tensors.items()},
        raw_names=sorted(tensors),
    )


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Shape of every required tensor from a flat config (KeyError names the missing key)."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    target_h = int(config.get("target_hidden_size") or h)
    shapes = {
        "fc.weight": (h, 3 * target_h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
    }
    assert len(shapes) == len(MIDLAYER_TENSORS) + 3
    return shapes


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def read_verifier_config(verifier_dir: Path) -> dict:
    """The verifier's text-model config.json as a dict (``text_config`` for multimodal wrappers)."""
    path = Path(verifier_dir) / "config.json"
    if not path.is_file():
        raise ServingFormatError(
            f"verifier directory {verifier_dir} has no config.json", fix="pass the verifier's folder"
        )
    hf = json.loads(path.read_text())
    text = dict(hf.get("text_config") or hf)
    text.setdefault("architectures", hf.get("architectures"))
    # Older and GGUF-converted configs keep bos/eos only in generation_config.json.
    generation = Path(verifier_dir) / "generation_config.json"
    if generation.is_file():
        gen = json.loads(generation.read_text())
        for key in ("bos_token_id", "eos_token_id"):
            if text.get(key) is None and gen.get(key) is not None:
                text[key] = gen[key]
    return text


def _aux_layer_ids(raw: dict, num_target_layers: int | None) -> list[int]:
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(i) for i in top]
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
    if num_target_layers is None:
        raise ServingFormatError(
            "the checkpoint names no aux layer ids and the verifier's depth is unknown",
            fix="pass verifier_dir so the engines' default [2, L//2, L-3] can be used",
        )
    # What vLLM and SGLang capture when a checkpoint names no ids.
    return default_aux_layer_ids(num_target_layers)


def _sorted_vocab(
    d2t: torch.Tensor, lm_head: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d2t, t2d, lm_head) with draft ids in increasing verifier-id order, the order fledge's draft requires.

    Engines scatter logits to ``i + d2t[i]`` and do not care about the order, so a third party may use any: permuting
    the draft ids together with the rows of lm_head changes nothing the draft computes.
    """
    fatal = [p for p in draft_vocab_problems(d2t, vocab_size=vocab_size) if p.code != "d2t-unsorted"]
    if fatal:
        raise ServingFormatError(fatal[0].message, fix="run `fledge export check` on the checkpoint")
    targets = torch.arange(d2t.numel()) + d2t.long()
    order = torch.argsort(targets)
    targets = targets[order]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[targets] = True
    return targets - torch.arange(targets.numel()), t2d, lm_head[order]


def load_exported(path: Path, verifier_dir: Path | None = None) -> Eagle3Draft:
    """An ``Eagle3Draft`` (float32, eval mode) from a serving checkpoint: fledge's, or a third party's in the
    LlamaForCausalLMEagle3 or speculators format.

    The embedding is the checkpoint's when it ships one (what vLLM serves), otherwise the verifier's from
    ``verifier_dir``; a shipped embedding that differs from the verifier's is logged, since SGLang would use the
    verifier's instead.
    """
    path = Path(path)
    ckpt = read_serving_checkpoint(path)
    flat, raw = ckpt.config, ckpt.raw_config
    if ckpt.format == "speculators" and flat.get("norm_before_residual", True):
        raise ServingFormatError(
            f"{path}: norm_before_residual is true (or absent, which vLLM reads as true); fledge's draft keeps the raw "
            "hidden state on the residual and cannot represent this head",
            fix="evaluate it with the engine instead",
        )
    verifier = read_verifier_config(verifier_dir) if verifier_dir is not None else None
    num_target_layers = int(verifier["num_hidden_layers"]) if verifier is not None else None
    if num_target_layers is None and isinstance(raw.get("fledge"), dict):
        num_target_layers = raw["fledge"].get("verifier_num_hidden_layers")
    if int(flat.get("num_hidden_layers", 1)) != 1:
        raise ServingFormatError(
            f"{path}: num_hidden_layers is {flat.get('num_hidden_layers')}; fledge's draft has one layer"
        )
    heads = int(flat["num_attention_heads"])
    rope_theta, rope_scaling = rope_settings(flat, default_theta=10000.0)
    vocab_size = int(flat["vocab_size"])
    config = Eagle3Config(
        hidden_size=int(flat["hidden_size"]),
        intermediate_size=int(flat["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(flat.get("num_key_value_heads") or heads),
        head_dim=int(flat.get("head_dim") or int(flat["hidden_size"]) // heads),
        vocab_size=vocab_size,
        draft_vocab_size=int(flat.get("draft_vocab_size") or vocab_size),
        target_hidden_size=int(flat.get("target_hidden_size") or flat["hidden_size"]),
        rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(flat.get("max_position_embeddings", 2048)),
        aux_layer_ids=_aux_layer_ids(raw, num_target_layers),
        hidden_act=str(flat.get("hidden_act", "silu")),
    )
    draft = Eagle3Draft(config)

    state = {k: v for k, v in ckpt.tensors.items() if k not in ("embed_tokens.weight", "d2t", "t2d")}
    d2t = ckpt.tensors.get("d2t")
    if d2t is None:
        if config.draft_vocab_size != vocab_size:
            raise ServingFormatError(f"{path}: no d2t, but the draft vocabulary is smaller than the verifier's")
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "lm_head.weight" not in state:
        raise ServingFormatError(f"{path}: no lm_head.weight")
    d2t, t2d, state["lm_head.weight"] = _sorted_vocab(d2t, state["lm_head.weight"], vocab_size)
    shipped_t2d = ckpt.tensors.get("t2d")
    if shipped_t2d is not None and not torch.equal(shipped_t2d.bool(), t2d):
        log.warning("%s: t2d disagrees with d2t; using the mask implied by d2t (what the engines use)", path)
    draft.load_trainable_state_dict({**state, "d2t": d2t, "t2d": t2d})

    shipped = ckpt.tensors.get("embed_tokens.weight")
    if verifier_dir is not None:
        verifier_embed, _ = load_embed_and_head(Path(verifier_dir))
        if shipped is not None and relative_difference(shipped, verifier_embed) > SAME_TENSOR_RTOL:
            log.warning("%s ships an embedding that differs from the verifier's; using the shipped one (as vLLM)", path)
    if shipped is not None:
        draft.load_verifier_embedding(shipped.float())
    elif verifier_dir is not None:
        draft.load_verifier_embedding(verifier_embed.float())
    else:
        raise ServingFormatError(
            f"{path} ships no embedding", fix="pass verifier_dir (the draft reads the verifier's embedding)"
        )
    return draft.eval()
