"""Writing serving checkpoints: the folder vLLM, SGLang and the official EAGLE code load as an EAGLE-3 draft, as-is.

The written folder (docs/design.md, "Serving checkpoint"):

    config.json        LlamaForCausalLMEagle3, the verifier's attention/RoPE geometry, num_hidden_layers 1,
                       vocab_size / draft_vocab_size, both layer-id fields; target_hidden_size only with a
                       shipped embedding (see ``serving_config``)
    model.safetensors  fc, midlayer.*, norm, lm_head in the export dtype; d2t int64; t2d bool; the verifier's
                       embedding only with ``ship_embedding``
    README.md          model card: verifier (its Hub id), training data, measured acceptance length, serve commands

With ``speculators=True`` a second folder ``<out_dir>-speculators`` holds the same weights in the
vllm-project/speculators layout (``Eagle3Speculator``: ``transformer_layer_config`` + ``speculators_config``,
``layers.0.*`` tensor names), with ``norm_before_residual`` and ``norm_before_fc`` written as false: vLLM assumes
``norm_before_residual: true`` for that format when the key is absent, which is a different network.

Both folders are built in a temporary sibling, validated with ``export/check.py`` and renamed into place, so a
folder at ``out_dir`` is always complete and loadable. Reading them back is ``models/serving.py``'s.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from fledge.core.errors import FledgeError
from fledge.core.files import publish_dir, staging_dir
from fledge.export.check import check_checkpoint
from fledge.models.draft import Eagle3Config, Eagle3Draft
from fledge.models.serving import (
    SAME_TENSOR_RTOL,
    SERVING_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    read_verifier_config,
    relative_difference,
)
from fledge.models.verifier import load_embed_and_head, parse_dtype, verifier_hub_id, weight_fingerprint

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
SPECULATORS_SUFFIX = "-speculators"
DEFAULT_SPECULATIVE_TOKENS = 3
"""Chain length written into the speculators config; vLLM takes ``num_speculative_tokens`` from it when not given."""
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class ExportError(FledgeError, ValueError):
    """A draft that cannot be exported as trained (another verifier's, or a result an engine would misread)."""


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


def serving_config(cfg: Eagle3Config, verifier: dict, dtype_name: str, name: str, ship_embedding: bool = False) -> dict:
    """config.json of the LlamaForCausalLMEagle3 folder.

    ``target_hidden_size`` is written only when the embedding ships too (or the draft is narrower than its
    verifier): the official EAGLE code reads the key as "this draft brings its own embedding" and otherwise runs
    with a random one, while vLLM and SGLang fall back to ``hidden_size`` without it.
    """
    ids = [int(i) for i in cfg.aux_layer_ids]
    sizes = {"draft_vocab_size": cfg.draft_vocab_size}
    if ship_embedding or cfg.target_hidden_size != cfg.hidden_size:
        sizes["target_hidden_size"] = cfg.target_hidden_size
    return {
        "architectures": [SERVING_ARCHITECTURE],
        **_llama_layer_config(cfg, verifier),
        **sizes,
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


def serving_tensors(draft: Eagle3Draft, dtype: torch.dtype, ship_embedding: bool = False) -> dict[str, torch.Tensor]:
    """The draft's weights in ``dtype`` (d2t int64, t2d bool), under the serving names; the embedding (the
    verifier's) only with ``ship_embedding``."""
    out: dict[str, torch.Tensor] = {}
    weights = draft.trainable_state_dict()
    if ship_embedding:
        weights["embed_tokens.weight"] = draft.embed_tokens.weight
    columns = draft.config.aux_columns(torch.float64)
    if columns is not None:
        # fc reads aux_i / s_i in training (Eagle3Config.aux_scale); engines feed it the raw states, so the divisors
        # go into its columns: the same product, a plain EAGLE-3 fc.
        weights["fc.weight"] = (weights["fc.weight"].detach().cpu().double() / columns).float()
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu()
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    if draft.config.draft_vocab_size == draft.config.vocab_size:
        # A draft over the whole vocabulary ships no d2t/t2d: vLLM builds no mapping for it and refuses a checkpoint
        # that has one ("no module or parameter named 'draft_id_to_target_id'", vLLM 0.32.0). Its head rows are put
        # in verifier-id order instead, so that draft id i is verifier id i for every reader.
        order = torch.argsort(torch.arange(draft.config.draft_vocab_size) + out.pop("d2t"))
        out.pop("t2d")
        out["lm_head.weight"] = out["lm_head.weight"][order].contiguous()
    return out


def _format_tau(tau: Any) -> list[str]:
    if tau is None:
        return ["- τ (acceptance length): not measured"]
    if isinstance(tau, dict):
        return [f"- τ (acceptance length), {where}: {float(v):.3f}" for where, v in tau.items()]
    return [f"- τ (acceptance length): {float(tau):.3f}"]


def model_card(
    cfg: Eagle3Config, name: str, verifier: dict, dtype_name: str, card: dict | None, ship_embedding: bool = False
) -> str:
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
        f"- draft vocabulary: {cfg.draft_vocab_size} of {cfg.vocab_size} verifier tokens "
        + ("(`d2t` offsets, `t2d` mask)" if cfg.draft_vocab_size < cfg.vocab_size else "(all: no `d2t`/`t2d`)"),
        f"- aux layers (Hugging Face `output_hidden_states` indices): {ids}; `eagle_config` (SGLang, minus one): "
        f"{[i - 1 for i in ids]}",
        f"- weights: {dtype_name}; the embedding is the verifier's"
        + (" (shipped too)" if ship_embedding else " and is not stored"),
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
    """Build the folder aside, validate it, then swap it into place (replacing an older export, nothing else)."""
    if out_dir.exists() and any(out_dir.iterdir()) and not _is_export(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a fledge export; choose another out_dir or remove it")
    tmp = staging_dir(out_dir)
    try:
        write(tmp)
        validate(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out_dir)


def _raise_on_errors(verifier_dir: Path) -> Callable[[Path], None]:
    def validate(folder: Path) -> None:
        findings = check_checkpoint(folder, verifier_dir)
        for f in findings:
            if f.level == "warning":
                log.warning("%s", f)
        errors = [f for f in findings if f.level == "error"]
        if errors:
            raise ExportError(
                "the exported checkpoint would not serve correctly:\n" + "\n".join(map(str, errors)),
                fix="see each finding's fix; `fledge export check` describes the rules",
            )

    return validate


def _check_draft_fits_verifier(draft: Eagle3Draft, verifier: dict, verifier_dir: Path) -> None:
    cfg = draft.config
    if int(verifier["hidden_size"]) != cfg.target_hidden_size or int(verifier["vocab_size"]) != cfg.vocab_size:
        raise ExportError(
            f"the draft (target_hidden_size {cfg.target_hidden_size}, vocab_size {cfg.vocab_size}) was not built for "
            f"the verifier in {verifier_dir} (hidden_size {verifier['hidden_size']}, "
            f"vocab_size {verifier['vocab_size']})",
            fix="export against the verifier the draft was trained with",
        )
    embed, _ = load_embed_and_head(verifier_dir)
    diff = relative_difference(draft.embed_tokens.weight.detach().cpu(), embed)
    if not diff <= SAME_TENSOR_RTOL:
        raise ExportError(
            f"the draft's embed_tokens differs from the verifier's in {verifier_dir} (relative difference {diff:.3g}): "
            "served drafts read the verifier's embedding, so this export would not behave as trained",
            fix="load it with draft.load_verifier_embedding(...), or export against the verifier the draft was "
            "trained with",
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
    ship_embedding: bool = False,
) -> Path:
    """Write the serving checkpoint of ``draft`` (trained for the verifier in ``verifier_dir``) to ``out_dir``.

    ``card`` fills README.md (see ``model_card``); ``card["num_speculative_tokens"]`` sets the chain length of the
    speculators config. With ``speculators`` the speculators-format copy goes to ``speculators_dir(out_dir)``. With
    ``ship_embedding`` the LlamaForCausalLMEagle3 folder also carries the verifier's embedding (and
    ``target_hidden_size``); without it, every consumer reads the verifier's own. Returns ``out_dir``. Refuses
    (``ExportError``) a draft whose embedding is not the verifier's, and any result that ``check_checkpoint`` finds
    an error in.
    """
    verifier_dir, out_dir = Path(verifier_dir), Path(out_dir)
    cfg = draft.config
    verifier = read_verifier_config(verifier_dir)
    _check_draft_fits_verifier(draft, verifier, verifier_dir)
    torch_dtype = parse_dtype(dtype)
    dtype_name = DTYPE_NAMES[torch_dtype]
    name = str((card or {}).get("verifier") or verifier_hub_id(verifier_dir))
    tensors = serving_tensors(draft, torch_dtype, ship_embedding)
    validate = _raise_on_errors(verifier_dir)
    # Which verifier's weights the draft was trained on: `fledge eval` refuses a checkpoint given another one.
    fingerprint = weight_fingerprint(verifier_dir)

    from safetensors.torch import save_file

    def write_serving(folder: Path) -> None:
        config = serving_config(cfg, verifier, dtype_name, name, ship_embedding)
        config["fledge"]["verifier_fingerprint"] = fingerprint
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / "README.md").write_text(model_card(cfg, name, verifier, dtype_name, card, ship_embedding))

    _write_folder(out_dir, write_serving, validate)
    log.info("wrote serving checkpoint %s (%s)", out_dir, dtype_name)

    if speculators:
        tokens = int((card or {}).get("num_speculative_tokens") or DEFAULT_SPECULATIVE_TOKENS)
        renamed = {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
            for k, v in tensors.items()
            if k != "embed_tokens.weight"
        }

        def write_speculators(folder: Path) -> None:
            config = speculators_config(cfg, verifier, dtype_name, name, tokens)
            config["fledge"]["verifier_fingerprint"] = fingerprint
            (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            save_file(renamed, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
            (folder / "README.md").write_text(model_card(cfg, name, verifier, dtype_name, card))

        _write_folder(speculators_dir(out_dir), write_speculators, validate)
        log.info("wrote speculators-format checkpoint %s", speculators_dir(out_dir))
    return out_dir


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
