"""Export and import of serving checkpoints: the folder vLLM and SGLang load as an EAGLE-3 draft, as-is.

The written folder (see DESIGN.md, "Serving checkpoint"):

    config.json        LlamaForCausalLMEagle3, the verifier's attention/RoPE geometry, num_hidden_layers 1,
                       vocab_size / draft_vocab_size / target_hidden_size, both layer-id fields
    model.safetensors  fc, midlayer.*, norm, lm_head in the export dtype; d2t int64; t2d bool; no embedding
    README.md          model card: verifier, training data, measured acceptance length

With ``speculators=True`` a second folder ``<out_dir>-speculators`` holds the same weights in the
vllm-project/speculators layout (``Eagle3Speculator``: ``transformer_layer_config`` + ``speculators_config``,
``layers.0.*`` tensor names), with ``norm_before_residual`` and ``norm_before_fc`` written as false: vLLM assumes
``norm_before_residual: true`` for that format when the key is absent, which is a different network.

Both folders are written to a temporary sibling, validated with ``models.export_check`` and renamed into place, so
a folder at ``out_dir`` is always complete and loadable.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from models.draft import Eagle3Config, Eagle3Draft
from models.export_check import (
    SERVING_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    check_checkpoint,
    read_serving_checkpoint,
    relative_difference,
)
from models.verifier import default_aux_layer_ids, load_embed_and_head, parse_dtype

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
SPECULATORS_SUFFIX = "-speculators"
DEFAULT_SPECULATIVE_TOKENS = 3
"""Chain length written into the speculators config; vLLM takes ``num_speculative_tokens`` from it when not given."""
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
EMBEDDING_RTOL = 1e-2
"""The draft's embedding counts as the verifier's up to this relative difference (bf16 rounding is ~4e-3)."""


def read_verifier_config(verifier_dir: Path) -> dict:
    """The verifier's text-model config.json as a dict (``text_config`` for multimodal wrappers)."""
    path = Path(verifier_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"verifier directory {verifier_dir} has no config.json")
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


def verifier_name(verifier_dir: Path) -> str:
    """How the card and the speculators config name the verifier: the GGUF it came from, or its folder name."""
    source = Path(verifier_dir) / "fledge_source.json"
    if source.is_file():
        gguf = json.loads(source.read_text()).get("gguf")
        if gguf:
            return Path(gguf).stem.split(".")[0]
    return Path(verifier_dir).resolve().name


def _rope_fields(cfg: Eagle3Config) -> dict:
    """RoPE in the three spellings readers use: ``rope_theta`` + ``rope_scaling`` (vLLM, SGLang, transformers 4)
    and ``rope_parameters`` (transformers 5, which prefers ``rope_scaling`` when both are set, so they agree)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    parameters = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(scaling or {})}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def _llama_layer_config(cfg: Eagle3Config, verifier: dict) -> dict:
    """The Llama fields of the draft's single decoder layer (shared by both formats)."""
    out = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **_rope_fields(cfg),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if verifier.get(key) is not None:
            out[key] = verifier[key]
    return out


def serving_config(cfg: Eagle3Config, verifier: dict, dtype_name: str, name: str) -> dict:
    """config.json of the LlamaForCausalLMEagle3 folder."""
    ids = [int(i) for i in cfg.aux_layer_ids]
    return {
        "architectures": [SERVING_ARCHITECTURE],
        **_llama_layer_config(cfg, verifier),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": dtype_name,
        # vLLM reads the top-level ids as output_hidden_states indices; SGLang reads eagle_config's and adds one.
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
        "fledge": {
            "format_version": 1,
            "verifier": name,
            "verifier_num_hidden_layers": int(verifier["num_hidden_layers"]),
            "aux_layer_ids": ids,
        },
    }


def speculators_config(cfg: Eagle3Config, verifier: dict, dtype_name: str, name: str, speculative_tokens: int) -> dict:
    """config.json of the vllm-project/speculators folder (``speculators_model_type: eagle3``)."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": name, "architectures": list(verifier.get("architectures") or [])},
        },
        "transformer_layer_config": _llama_layer_config(cfg, verifier),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # Written explicitly: vLLM's speculators reader defaults norm_before_residual to true. fledge's layer keeps
        # the raw hidden state on the residual and feeds fc the raw aux states.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in cfg.aux_layer_ids],
        "torch_dtype": dtype_name,
        "fledge": {
            "format_version": 1,
            "verifier": name,
            "verifier_num_hidden_layers": int(verifier["num_hidden_layers"]),
        },
    }


def serving_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's weights in ``dtype`` (d2t int64, t2d bool), under the serving names, without the embedding."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in draft.trainable_state_dict().items():
        tensor = tensor.detach().cpu()
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    return out


def _format_tau(tau: Any) -> list[str]:
    if tau is None:
        return ["- τ (acceptance length): not measured"]
    if isinstance(tau, dict):
        return [f"- τ (acceptance length), {where}: {float(v):.3f}" for where, v in tau.items()]
    return [f"- τ (acceptance length): {float(tau):.3f}"]


def model_card(cfg: Eagle3Config, name: str, verifier: dict, dtype_name: str, card: dict | None) -> str:
    """README.md. Known ``card`` keys: ``verifier`` (display name), ``training_data``, ``tau`` (a number or
    {eval set: number}), ``tau_source``; any other key is listed as it is."""
    card = dict(card or {})
    shown_name = str(card.pop("verifier", name))
    training_data = card.pop("training_data", None)
    tau = card.pop("tau", None)
    tau_source = card.pop("tau_source", None)
    card.pop("num_speculative_tokens", None)
    ids = [int(i) for i in cfg.aux_layer_ids]
    lines = [
        "---",
        "tags: [eagle3, speculative-decoding, fledge]",
        "---",
        f"# EAGLE-3 draft head for {shown_name}",
        "",
        f"A one-layer EAGLE-3 draft head trained with fledge for the verifier **{shown_name}** "
        f"({int(verifier['num_hidden_layers'])} layers, hidden size {cfg.target_hidden_size}, vocabulary {cfg.vocab_size}).",
        "",
        f"- verifier: {shown_name}",
        f"- training data: {training_data if training_data else 'not recorded'}",
        *_format_tau(tau),
    ]
    if tau_source:
        lines.append(f"- τ measured by: {tau_source}")
    lines += [
        f"- draft vocabulary: {cfg.draft_vocab_size} of {cfg.vocab_size} verifier tokens (`d2t` offsets, `t2d` mask)",
        f"- aux layers (Hugging Face `output_hidden_states` indices): {ids}; `eagle_config` (SGLang, minus one): "
        f"{[i - 1 for i in ids]}",
        f"- weights: {dtype_name}; the embedding is the verifier's and is not stored",
    ]
    for key, value in card.items():
        lines.append(f"- {key.replace('_', ' ')}: {value}")
    lines += [
        "",
        "## Serving",
        "",
        "vLLM:",
        "```bash",
        f"vllm serve {shown_name} --speculative-config "
        f"'{{\"method\": \"eagle3\", \"model\": \"<this folder>\", \"num_speculative_tokens\": {DEFAULT_SPECULATIVE_TOKENS}}}'",
        "```",
        "SGLang:",
        "```bash",
        f"python -m sglang.launch_server --model-path {shown_name} --speculative-algorithm EAGLE3 "
        "--speculative-draft-model-path <this folder> --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4",
        "```",
        "",
        "Validate it with `fledge export check <this folder> --verifier <verifier dir>`.",
        "",
    ]
    return "\n".join(lines)


def _is_export(path: Path) -> bool:
    """A folder that a previous export wrote (and that a new export may therefore replace)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return config.get("architectures") in ([SERVING_ARCHITECTURE], [SPECULATORS_ARCHITECTURE]) and "fledge" in config


def _write_folder(out_dir: Path, write: Callable[[Path], None], validate: Callable[[Path], None]) -> None:
    """Write into a temporary sibling, validate it, then rename it to ``out_dir`` (replacing an older export)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists() and any(out_dir.iterdir()) and not _is_export(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a fledge export; choose another out_dir or remove it")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        validate(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a serving checkpoint is an ordinary shared folder
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_on_errors(verifier_dir: Path) -> Callable[[Path], None]:
    def validate(folder: Path) -> None:
        findings = check_checkpoint(folder, verifier_dir)
        for f in findings:
            if f.level == "warning":
                log.warning("%s", f)
        errors = [f for f in findings if f.level == "error"]
        if errors:
            raise ValueError("the exported checkpoint would not serve correctly:\n" + "\n".join(map(str, errors)))

    return validate


def _check_draft_fits_verifier(draft: Eagle3Draft, verifier: dict, verifier_dir: Path) -> None:
    cfg = draft.config
    if int(verifier["hidden_size"]) != cfg.target_hidden_size or int(verifier["vocab_size"]) != cfg.vocab_size:
        raise ValueError(
            f"the draft (target_hidden_size {cfg.target_hidden_size}, vocab_size {cfg.vocab_size}) was not built for "
            f"the verifier in {verifier_dir} (hidden_size {verifier['hidden_size']}, vocab_size {verifier['vocab_size']})"
        )
    embed, _ = load_embed_and_head(verifier_dir)
    diff = relative_difference(draft.embed_tokens.weight.detach().cpu(), embed)
    if not diff <= EMBEDDING_RTOL:
        raise ValueError(
            f"the draft's embed_tokens differs from the verifier's in {verifier_dir} (relative difference {diff:.3g}): "
            "served drafts read the verifier's embedding, so this export would not behave as trained. Load it with "
            "draft.load_verifier_embedding(...) or export against the verifier the draft was trained with"
        )


def speculators_dir(out_dir: Path) -> Path:
    return Path(out_dir).with_name(Path(out_dir).name + SPECULATORS_SUFFIX)


def export_draft(
    draft: Eagle3Draft,
    verifier_dir: Path,
    out_dir: Path,
    dtype: str = "bfloat16",
    card: dict | None = None,
    speculators: bool = False,
) -> Path:
    """Write the serving checkpoint of ``draft`` (trained for the verifier in ``verifier_dir``) to ``out_dir``.

    ``card`` fills README.md (see ``model_card``); ``card["num_speculative_tokens"]`` sets the chain length of the
    speculators config. With ``speculators`` the speculators-format copy goes to ``speculators_dir(out_dir)``.
    Returns ``out_dir``. Refuses (ValueError) a draft whose embedding is not the verifier's, and any result that
    ``check_checkpoint`` finds an error in.
    """
    verifier_dir, out_dir = Path(verifier_dir), Path(out_dir)
    cfg = draft.config
    verifier = read_verifier_config(verifier_dir)
    _check_draft_fits_verifier(draft, verifier, verifier_dir)
    torch_dtype = parse_dtype(dtype)
    dtype_name = DTYPE_NAMES[torch_dtype]
    name = str((card or {}).get("verifier") or verifier_name(verifier_dir))
    tensors = serving_tensors(draft, torch_dtype)
    validate = _raise_on_errors(verifier_dir)

    from safetensors.torch import save_file

    def write_serving(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(serving_config(cfg, verifier, dtype_name, name), indent=2) + "\n")
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / "README.md").write_text(model_card(cfg, name, verifier, dtype_name, card))

    _write_folder(out_dir, write_serving, validate)
    log.info("wrote serving checkpoint %s (%s)", out_dir, dtype_name)

    if speculators:
        tokens = int((card or {}).get("num_speculative_tokens") or DEFAULT_SPECULATIVE_TOKENS)
        renamed = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}

        def write_speculators(folder: Path) -> None:
            config = speculators_config(cfg, verifier, dtype_name, name, tokens)
            (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            save_file(renamed, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
            (folder / "README.md").write_text(model_card(cfg, name, verifier, dtype_name, card))

        _write_folder(speculators_dir(out_dir), write_speculators, validate)
        log.info("wrote speculators-format checkpoint %s", speculators_dir(out_dir))
    return out_dir


# ----------------------------------------------------------------------------------------------------------- import


def _rope_from_config(config: dict) -> tuple[float, dict | None]:
    params = config.get("rope_parameters") or {}
    if params and "rope_theta" not in params and "rope_type" not in params:
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type RoPE
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = config.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = dict(params)
    return float(theta), scaling


def _aux_layer_ids(raw: dict, num_target_layers: int | None) -> list[int]:
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(i) for i in top]
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
    if num_target_layers is None:
        raise ValueError(
            "the checkpoint names no aux layer ids and the verifier's depth is unknown; pass verifier_dir so the "
            "engines' default [2, L//2, L-3] can be used"
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
    targets = torch.arange(d2t.numel()) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab_size or torch.unique(targets).numel() != targets.numel():
        raise ValueError("d2t maps draft ids outside the verifier vocabulary or twice to one id; run `fledge export check`")
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
        raise ValueError(
            f"{path}: norm_before_residual is true (or absent, which vLLM reads as true); fledge's draft keeps the raw "
            "hidden state on the residual and cannot represent this head"
        )
    verifier = read_verifier_config(verifier_dir) if verifier_dir is not None else None
    num_target_layers = int(verifier["num_hidden_layers"]) if verifier is not None else None
    if num_target_layers is None and isinstance(raw.get("fledge"), dict):
        num_target_layers = raw["fledge"].get("verifier_num_hidden_layers")
    if int(flat.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{path}: num_hidden_layers is {flat.get('num_hidden_layers')}; fledge's draft has one layer")
    heads = int(flat["num_attention_heads"])
    rope_theta, rope_scaling = _rope_from_config(flat)
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
            raise ValueError(f"{path}: no d2t, but the draft vocabulary is smaller than the verifier's")
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "lm_head.weight" not in state:
        raise KeyError(f"{path}: no lm_head.weight")
    d2t, t2d, state["lm_head.weight"] = _sorted_vocab(d2t, state["lm_head.weight"], vocab_size)
    shipped_t2d = ckpt.tensors.get("t2d")
    if shipped_t2d is not None and not torch.equal(shipped_t2d.bool(), t2d):
        log.warning("%s: t2d disagrees with d2t; using the mask implied by d2t (what the engines use)", path)
    draft.load_trainable_state_dict({**state, "d2t": d2t, "t2d": t2d})

    shipped = ckpt.tensors.get("embed_tokens.weight")
    if verifier_dir is not None:
        verifier_embed, _ = load_embed_and_head(Path(verifier_dir))
        if shipped is not None and relative_difference(shipped, verifier_embed) > EMBEDDING_RTOL:
            log.warning("%s ships an embedding that differs from the verifier's; using the shipped one (as vLLM)", path)
    if shipped is not None:
        draft.load_verifier_embedding(shipped.float())
    elif verifier_dir is not None:
        draft.load_verifier_embedding(verifier_embed.float())
    else:
        raise ValueError(f"{path} ships no embedding: pass verifier_dir (the draft reads the verifier's embedding)")
    return draft.eval()


def tau_from_report(report: Any) -> dict[str, float]:
    """Every acceptance length in an eval report (any JSON shape): values under a key ``tau``, keyed by their path.

    The report format belongs to the evaluator; searching for the key keeps the card independent of its layout.
    """
    found: dict[str, float] = {}

    def walk(node: Any, where: list[str]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "tau" and isinstance(value, (int, float)) and math.isfinite(float(value)):
                    found["/".join(where) or "all"] = float(value)
                else:
                    walk(value, [*where, str(key)])
        elif isinstance(node, list):
            for i, value in enumerate(node):
                label = value.get("name") if isinstance(value, dict) and isinstance(value.get("name"), str) else str(i)
                walk(value, [*where, label])

    walk(report, [])
    return found
