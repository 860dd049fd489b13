"""Validating an EAGLE-3 serving checkpoint against what vLLM, SGLang and the official EAGLE code actually read.

Each rule below is there because the engine in question would otherwise load the checkpoint *silently wrong* or
crash at start-up (facts from vLLM ``model_executor/models/llama_eagle3.py`` + ``v1/worker/gpu_model_runner.py`` and
SGLang ``srt/models/llama_eagle3.py`` + its targets' ``set_eagle3_layers_to_capture``):

- ``architectures``: SGLang only knows ``LlamaForCausalLMEagle3``; vLLM maps it and ``Eagle3LlamaForCausalLM`` to its
  EAGLE-3 head. Anything else is loaded as an ordinary model, or not at all.
- Tensor names: vLLM renames ``midlayer.`` to ``layers.0.`` and accepts both; SGLang's loader looks names up as
  ``name`` or ``model.{name}`` and *skips what it does not find*, so a ``layers.0.*`` flat checkpoint leaves SGLang's
  decoder layer at its random init. Unknown names crash vLLM (``params_dict[name]``).
- ``d2t``: both engines map draft id ``i`` to target id ``i + d2t[i]`` and ignore ``t2d``. Without ``d2t`` vLLM keeps
  its zero-initialised mapping (draft id i read as verifier id i). With a draft vocabulary as large as the verifier's,
  vLLM builds no mapping and refuses a ``d2t`` (seen with vLLM 0.32.0's CPU build).
- Layer ids: vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` (when absent, it falls back to
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` *without* shifting it); SGLang reads the ``eagle_config`` ids and
  adds one. Both capture the *input* of decoder layer ``id`` (Hugging Face ``output_hidden_states`` index ``id``)
  inside their layer loop, in ascending layer order: an id equal to L (the final norm's output) is never captured,
  duplicates are captured once, and an unsorted list reaches ``fc`` in a different order than it was trained in.
- ``tie_word_embeddings: true`` makes SGLang use the embedding as the head; ``num_hidden_layers > 1`` makes both build
  extra decoder layers, which a one-layer checkpoint leaves at random init.
- A shipped ``embed_tokens.weight``: vLLM keeps it when it differs from the verifier's, SGLang replaces it with the
  verifier's, so a different embedding makes the two engines serve different drafts.
- ``target_hidden_size`` without a shipped embedding: the official EAGLE code (``eagle/model/cnets.py``) loads the
  verifier's embedding only when the config has *no* ``target_hidden_size``; with the key it expects the
  checkpoint's own, finds none, and runs with its random initialisation. vLLM and SGLang fall back to
  ``hidden_size`` when the key is absent, so omitting it when the two are equal is safe for all three.
- The speculators format (``speculators_model_type: eagle3``): vLLM defaults ``norm_before_residual`` to *true*
  when the key is absent, which is not the architecture fledge (and the EAGLE-3 reference) trains.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from fledge.models.draft import draft_vocab_problems
from fledge.models.serving import (
    OPTIONAL_TENSORS,
    SAME_TENSOR_RTOL,
    SERVING_ARCHITECTURE,
    VLLM_ONLY_ARCHITECTURES,
    ServingCheckpoint,
    ServingFormatError,
    expected_shapes,
    read_serving_checkpoint,
    relative_difference,
)
from fledge.models.verifier import load_embed_and_head

log = logging.getLogger(__name__)

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    level: Level
    """``error``: an engine would fail to load the checkpoint or would serve a different draft; ``warning``: it
    loads, but something is unusual or cannot be verified."""
    code: str
    """Stable short name of the rule (``tied-head``, ``d2t-holds-indices``, ...)."""
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level.upper()} [{self.code}] {self.message}\n    fix: {self.fix}"


def d2t_offsets_consistent(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """True when the verifier ids ``i + d2t[i]`` are exactly the ids marked in ``t2d`` (as a set, in any order)."""
    return all(p.code == "d2t-unsorted" for p in draft_vocab_problems(d2t, t2d))


def looks_like_indices(d2t: torch.Tensor, vocab_size: int, t2d: torch.Tensor | None) -> tuple[bool, str]:
    """Whether ``d2t`` holds target ids (``d2t[i] = target_id``) instead of offsets (``target_id - i``).

    The rule, in order:
    1. read as offsets, ``d2t`` agrees with ``t2d``: offsets, whatever its values look like;
    2. read as indices, ``d2t`` agrees with ``t2d`` (``t2d``'s marked ids are exactly ``d2t``): indices, certainly;
    3. without a usable ``t2d``: indices when every value lies in ``0..V-1`` and the sequence rises strictly at every
       step (``d2t[i+1] > d2t[i]``, hence ``d2t[i] >= i``). Offsets of a sorted vocabulary are non-decreasing, and
       rise strictly only where two consecutive draft ids skip a verifier id, so a strictly rising offset table
       would mean that *no* two adjacent verifier ids are both in the draft vocabulary, which a frequency-chosen
       vocabulary of more than a handful of tokens never is. When the offsets also point past ``V - 1`` the
       message says so, since it settles the case.
    """
    d2t = d2t.long()
    n = d2t.numel()
    if t2d is not None and t2d.numel() == vocab_size:
        if d2t_offsets_consistent(d2t, t2d):
            return False, ""
        marked = t2d.bool().nonzero().squeeze(1)
        if marked.numel() == n and torch.equal(torch.sort(d2t).values, marked):
            return True, "t2d marks exactly the values of d2t, so d2t lists the verifier ids themselves"
    if n < 8 or int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size:
        return False, ""
    if not bool((d2t[1:] > d2t[:-1]).all()):
        return False, ""
    overflow = int(((torch.arange(n) + d2t) >= vocab_size).sum())
    evidence = f"d2t rises strictly at every step from {int(d2t[0])} to {int(d2t[-1])}"
    if overflow:
        evidence += f", and read as offsets {overflow} of {n} draft ids map past the verifier vocabulary ({vocab_size})"
    return True, evidence


def _verifier_facts(verifier_dir: Path | None) -> tuple[dict | None, torch.Tensor | None]:
    if verifier_dir is None:
        return None, None
    hf = json.loads((verifier_dir / "config.json").read_text())
    text = hf.get("text_config") or hf
    embed, _ = load_embed_and_head(verifier_dir)
    return text, embed


def check_checkpoint(path: Path, verifier_dir: Path | None = None) -> list[Finding]:
    """Every problem vLLM, SGLang or the official EAGLE code would have with the checkpoint at ``path``; errors
    first."""
    path = Path(path)
    findings: list[Finding] = []

    def add(level: Level, code: str, message: str, fix: str) -> None:
        findings.append(Finding(level, code, message, fix))

    if not (path / "config.json").is_file():
        add(
            "error",
            "no-config",
            f"{path} has no config.json: not a serving checkpoint",
            "point at an exported folder; a fledge training run or step folder becomes one with `fledge export "
            "draft=<run or step dir> out_dir=<dir>`",
        )
        return findings
    try:
        ckpt = read_serving_checkpoint(path)
    except (ServingFormatError, json.JSONDecodeError, OSError, RuntimeError) as e:
        add("error", "unreadable", f"cannot read the checkpoint: {e}", "re-export it; the files are missing or damaged")
        return findings
    verifier, verifier_embed = _verifier_facts(verifier_dir)
    cfg = ckpt.config

    _check_architecture(ckpt, add)
    _check_structure_keys(cfg, add)
    try:
        shapes = expected_shapes(cfg)
    except (KeyError, TypeError, ValueError) as e:
        add("error", "config-incomplete", f"config.json lacks {e} needed to size the draft", "re-export the checkpoint")
        return _sorted(findings)
    _check_tensors(ckpt, shapes, add)
    vocab_size = int(cfg["vocab_size"])
    _check_vocab_maps(ckpt, vocab_size, add)
    num_target_layers = None
    if verifier is not None:
        num_target_layers = int(verifier["num_hidden_layers"])
    elif isinstance(ckpt.raw_config.get("fledge"), dict):
        num_target_layers = ckpt.raw_config["fledge"].get("verifier_num_hidden_layers")
    _check_layer_ids(ckpt, num_target_layers, add)
    _check_embedding_and_head(ckpt, verifier_embed, add)
    if verifier is not None:
        _check_against_verifier(cfg, verifier, add)
    return _sorted(findings)


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: f.level != "error")


def _check_architecture(ckpt: ServingCheckpoint, add) -> None:
    archs = ckpt.raw_config.get("architectures") or []
    if ckpt.format == "speculators":
        if ckpt.raw_config.get("speculators_model_type") != "eagle3":
            add(
                "error",
                "architecture",
                f"speculators_model_type is {ckpt.raw_config.get('speculators_model_type')!r}, not 'eagle3'",
                "set speculators_model_type to 'eagle3'",
            )
        if "norm_before_residual" not in ckpt.raw_config:
            add(
                "error",
                "norm-flag-missing",
                "norm_before_residual is absent: vLLM then assumes true (the residual carries the normed hidden "
                "state), a different network from the one trained",
                "write norm_before_residual: false explicitly (fledge export does)",
            )
        elif ckpt.raw_config["norm_before_residual"]:
            add(
                "warning",
                "norm-before-residual",
                "norm_before_residual is true: this head normalises the hidden state before the residual, which "
                "fledge's draft does not do, so fledge cannot import or evaluate it",
                "nothing to fix for serving; evaluate it with the engine instead",
            )
        tl = ckpt.raw_config.get("transformer_layer_config") or {}
        if tl.get("model_type", "llama") != "llama":
            add(
                "warning",
                "model-type",
                f"transformer_layer_config.model_type is {tl.get('model_type')!r}",
                "fledge exports Llama-style heads; set model_type 'llama' unless the engine supports this one",
            )
        return
    if archs == [SERVING_ARCHITECTURE]:
        pass
    elif archs and all(a in VLLM_ONLY_ARCHITECTURES for a in archs):
        add(
            "warning",
            "architecture",
            f"architectures {archs}: vLLM loads it, SGLang does not know this name",
            f'set "architectures": ["{SERVING_ARCHITECTURE}"] (both engines load that)',
        )
    else:
        add(
            "error",
            "architecture",
            f"architectures {archs}: neither vLLM nor SGLang loads this as an EAGLE-3 head "
            "(vLLM would build an ordinary model from it)",
            f'set "architectures": ["{SERVING_ARCHITECTURE}"] in config.json',
        )
    if ckpt.config.get("model_type") != "llama":
        add(
            "warning",
            "model-type",
            f"model_type is {ckpt.config.get('model_type')!r}: the engines build the head's config from it",
            'set "model_type": "llama"',
        )


def _check_structure_keys(cfg: dict, add) -> None:
    layers = cfg.get("num_hidden_layers")
    if layers != 1:
        add(
            "error",
            "num-layers",
            f"num_hidden_layers is {layers}: the engines build that many draft layers, and every layer after the "
            "first would stay at random init because EAGLE-3 heads carry one (midlayer)",
            '"num_hidden_layers": 1',
        )
    if cfg.get("tie_word_embeddings"):
        add(
            "error",
            "tied-config",
            "tie_word_embeddings is true: SGLang then uses the verifier's embedding as the draft's head and ignores "
            "the trained lm_head",
            '"tie_word_embeddings": false',
        )
    if cfg.get("draft_vocab_size") is None:
        add(
            "warning",
            "draft-vocab-size-missing",
            "draft_vocab_size is absent: both engines assume the full verifier vocabulary, and SGLang takes the "
            "head from the verifier",
            '"draft_vocab_size": <rows of lm_head.weight>',
        )
    if cfg.get("rope_theta") is None and not cfg.get("rope_parameters"):
        add(
            "warning",
            "rope-missing",
            "neither rope_theta nor rope_parameters is set: the engines fall back to theta 10000",
            "copy the verifier's rope_theta / rope_scaling into config.json",
        )
    if cfg.get("torch_dtype") is None and cfg.get("dtype") is None:
        add("warning", "dtype-missing", "torch_dtype is absent", '"torch_dtype": "bfloat16" (the weights\' dtype)')


def _check_tensors(ckpt: ServingCheckpoint, shapes: dict[str, tuple[int, ...]], add) -> None:
    tensors = ckpt.tensors
    missing = [k for k in shapes if k not in tensors]
    if missing:
        add(
            "error",
            "missing-tensors",
            f"missing tensors {missing}: the engines would leave them at random init or fail to start",
            "re-export from the trained draft",
        )
    wrong = [f"{k} {tuple(tensors[k].shape)} (expected {s})" for k, s in shapes.items() if k in tensors and tuple(tensors[k].shape) != s]
    if wrong:
        add(
            "error",
            "tensor-shapes",
            "shapes disagree with config.json: " + "; ".join(wrong),
            "make config.json describe the weights (hidden_size, heads, head_dim, intermediate_size, draft_vocab_size, "
            "target_hidden_size), or re-export",
        )
    unknown = [k for k in tensors if k not in shapes and k not in OPTIONAL_TENSORS]
    if unknown:
        add(
            "error",
            "unknown-tensors",
            f"tensors neither engine expects: {sorted(unknown)[:8]}{' ...' if len(unknown) > 8 else ''} "
            "(vLLM fails on unknown names)",
            "drop them from the safetensors file",
        )
    if ckpt.format == "eagle3":
        spelled_layers = [n for n in ckpt.raw_names if n.startswith(("layers.0.", "model.layers.0."))]
        if spelled_layers:
            add(
                "error",
                "layer-names",
                f"{len(spelled_layers)} tensors are named layers.0.*: SGLang's loader looks for midlayer.* and "
                "silently skips these, leaving its draft layer at random init",
                "rename layers.0.* to midlayer.* (vLLM accepts both)",
            )
    float_dtypes = {str(t.dtype) for k, t in tensors.items() if k in shapes}
    declared = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype")
    if len(float_dtypes) > 1:
        add("warning", "mixed-dtypes", f"weights mix dtypes {sorted(float_dtypes)}", "save every weight in one dtype")
    elif declared and float_dtypes and f"torch.{declared}" not in float_dtypes:
        add(
            "warning",
            "dtype-mismatch",
            f"torch_dtype says {declared} but the weights are {float_dtypes.pop()}",
            "make torch_dtype name the weights' dtype",
        )


def _check_vocab_maps(ckpt: ServingCheckpoint, vocab_size: int, add) -> None:
    draft_vocab = int(ckpt.config.get("draft_vocab_size") or vocab_size)
    d2t, t2d = ckpt.tensors.get("d2t"), ckpt.tensors.get("t2d")
    if t2d is not None and tuple(t2d.shape) != (vocab_size,):
        add("error", "t2d-shape", f"t2d is {tuple(t2d.shape)}, expected [{vocab_size}] (vocab_size)", "re-export")
        t2d = None
    if t2d is not None and t2d.dtype != torch.bool:
        add("warning", "t2d-dtype", f"t2d is {t2d.dtype}", "store t2d as a bool mask")
    if d2t is not None and draft_vocab == vocab_size:
        add(
            "error",
            "d2t-full-vocab",
            f"d2t/t2d are shipped although the draft vocabulary is the verifier's whole vocabulary ({vocab_size}): "
            "vLLM then creates no draft_id_to_target_id and refuses the checkpoint (\"There is no module or parameter "
            "named 'draft_id_to_target_id'\", vLLM 0.32.0)",
            "leave d2t and t2d out, with lm_head rows in verifier-id order (fledge export does)",
        )
        return
    if d2t is None:
        if draft_vocab < vocab_size:
            add(
                "error",
                "d2t-missing",
                f"no d2t although the draft vocabulary ({draft_vocab}) is smaller than the verifier's ({vocab_size}): "
                "vLLM keeps a zero mapping and reads draft id i as verifier id i",
                "save the draft vocabulary's d2t (int64 offsets, target_id = i + d2t[i]) in the safetensors file",
            )
        return
    if tuple(d2t.shape) != (draft_vocab,):
        add("error", "d2t-shape", f"d2t is {tuple(d2t.shape)}, expected [{draft_vocab}] (draft_vocab_size)", "re-export")
        return
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        add("error", "d2t-dtype", f"d2t is {d2t.dtype}; the engines add it to integer ids", "store d2t as int64")
        return
    if d2t.dtype != torch.int64:
        add("warning", "d2t-dtype", f"d2t is {d2t.dtype}; vLLM's mapping parameter is int64", "store d2t as int64")
    is_indices, evidence = looks_like_indices(d2t, vocab_size, t2d)
    if is_indices:
        add(
            "error",
            "d2t-holds-indices",
            f"d2t holds verifier token ids instead of offsets ({evidence}); the engines compute i + d2t[i]",
            "store d2t[i] = target_id - i (fledge's and EAGLE-3's convention)",
        )
        return
    fixes = {
        "d2t-out-of-range": "rebuild the draft vocabulary for this verifier",
        "d2t-duplicates": "rebuild the draft vocabulary: each verifier id at most once",
        "d2t-t2d-mismatch": "rebuild t2d from d2t: t2d = zeros(V, bool); t2d[arange(Vd) + d2t] = True",
        "d2t-unsorted": "order the draft vocabulary by verifier id",
    }
    for problem in draft_vocab_problems(d2t, t2d, vocab_size):
        if problem.code == "d2t-unsorted":
            add("warning", problem.code, f"{problem.message} (the engines do not mind; fledge sorts on import)",
                fixes[problem.code])
        else:
            add("error", problem.code, problem.message, fixes[problem.code])
    if t2d is None:
        add("warning", "t2d-missing", "no t2d (the engines do not read it; fledge derives it from d2t)", "save t2d")


def _check_layer_ids(ckpt: ServingCheckpoint, num_target_layers: int | None, add) -> None:
    raw = ckpt.raw_config
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    shifted = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ckpt.format == "speculators":
        # vLLM reads the top-level ids of this format; SGLang reads eagle_config when present.
        if top is None:
            add(
                "warning",
                "layer-ids-missing",
                "eagle_aux_hidden_state_layer_ids is absent: vLLM captures its default [2, L//2, L-3]",
                "write the ids the head was trained on (output_hidden_states indices)",
            )
    elif top is None and shifted is None:
        add(
            "warning",
            "layer-ids-missing",
            "no layer ids: vLLM and SGLang capture their default [2, L//2, L-3], right only if the head was "
            "trained on those",
            "write eagle_aux_hidden_state_layer_ids (output_hidden_states indices) and eagle_config."
            "eagle_aux_hidden_state_layer_ids (the same minus one)",
        )
    elif top is None:
        add(
            "error",
            "layer-ids-top-missing",
            f"only eagle_config.eagle_aux_hidden_state_layer_ids {shifted}: vLLM then uses these ids unshifted, one "
            "layer earlier than SGLang (which adds one)",
            f"add top-level eagle_aux_hidden_state_layer_ids {[int(i) + 1 for i in shifted]}",
        )
    elif shifted is None:
        add(
            "warning",
            "layer-ids-sglang-missing",
            f"eagle_config.eagle_aux_hidden_state_layer_ids is absent: SGLang ignores the top-level {top} and "
            "captures its default layers",
            f'add "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {[int(i) - 1 for i in top]}, '
            '"use_aux_hidden_state": true}',
        )
    elif [int(i) for i in top] != [int(i) + 1 for i in shifted]:
        add(
            "error",
            "layer-ids-shifted",
            f"top-level ids {top} and eagle_config ids {shifted} disagree: the top level must be the eagle_config ids "
            "plus one (SGLang adds one, vLLM does not), so vLLM and SGLang would feed different layers",
            f"keep the top-level (output_hidden_states) ids and set eagle_config ids to {[int(i) - 1 for i in top]}",
        )
    if eagle_config.get("use_aux_hidden_state") is False:
        add(
            "error",
            "aux-disabled",
            "eagle_config.use_aux_hidden_state is false: vLLM then skips fc and feeds one hidden state",
            '"use_aux_hidden_state": true',
        )
    ids = top if top is not None else ([int(i) + 1 for i in shifted] if shifted is not None else None)
    if ids is None:
        return
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        add("error", "layer-ids-count", f"layer ids {ids}: fc reads exactly three states", "write three ids")
    if len(set(ids)) != len(ids):
        add(
            "error",
            "layer-ids-duplicate",
            f"layer ids {ids} repeat: the engines capture each layer once, so fc would get fewer states",
            "train and export with three distinct layers",
        )
    elif ids != sorted(ids):
        add(
            "error",
            "layer-ids-order",
            f"layer ids {ids} are not ascending: the engines concatenate aux states in layer order, not list order",
            "train with ascending aux_layer_ids",
        )
    if num_target_layers is not None:
        bad = [i for i in ids if not 0 <= i <= num_target_layers]
        if bad:
            add(
                "error",
                "layer-ids-range",
                f"layer ids {bad} lie outside 0..{num_target_layers} (output_hidden_states of a "
                f"{num_target_layers}-layer verifier)",
                "export against the verifier the head was trained for",
            )
        elif num_target_layers in ids:
            add(
                "error",
                "layer-id-not-served",
                f"layer id {num_target_layers} is the verifier's final (normed) state: vLLM and SGLang only capture "
                f"the inputs of decoder layers 0..{num_target_layers - 1}",
                f"train on ids below {num_target_layers}",
            )


def _check_embedding_and_head(ckpt: ServingCheckpoint, verifier_embed: torch.Tensor | None, add) -> None:
    cfg = ckpt.config
    shipped = ckpt.tensors.get("embed_tokens.weight")
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    if shipped is not None and tuple(shipped.shape) != (vocab, hidden):
        add("error", "embedding-shape", f"embed_tokens.weight is {tuple(shipped.shape)}, expected {(vocab, hidden)}", "drop it")
        shipped = None
    if shipped is not None:
        if verifier_embed is None:
            add(
                "warning",
                "embedding-unverified",
                "the checkpoint ships embed_tokens.weight; without the verifier it cannot be compared",
                "run the check with --verifier DIR, or drop the tensor (both engines then share the verifier's)",
            )
        elif tuple(verifier_embed.shape) == tuple(shipped.shape):
            diff = relative_difference(shipped, verifier_embed)
            if diff > SAME_TENSOR_RTOL:
                add(
                    "error",
                    "embedding-mismatch",
                    f"the shipped embed_tokens.weight differs from the verifier's (relative difference {diff:.3g}): "
                    "vLLM keeps it, SGLang replaces it with the verifier's, so they serve different drafts",
                    "drop embed_tokens.weight from the checkpoint (the head was trained on the verifier's embedding)",
                )
    if ckpt.format == "eagle3" and shipped is None and "target_hidden_size" in ckpt.raw_config:
        add(
            "error",
            "eagle-random-embedding",
            "config.json sets target_hidden_size but no embed_tokens.weight is shipped: the official EAGLE code "
            "(EaModel) reads target_hidden_size as 'the draft brings its own embedding', skips loading the "
            "verifier's, and then runs with a random one (its non-strict load drops the missing key silently)",
            "drop target_hidden_size when it equals hidden_size (vLLM and SGLang fall back to hidden_size), or ship "
            "the verifier's embedding (fledge export ship_embedding=true)",
        )
    head = ckpt.tensors.get("lm_head.weight")
    reference = shipped if shipped is not None else verifier_embed
    d2t = ckpt.tensors.get("d2t")
    if head is None or reference is None or head.shape[-1] != reference.shape[-1]:
        return
    if d2t is not None and d2t.numel() == head.shape[0] and not d2t.dtype.is_floating_point:
        rows = torch.arange(head.shape[0]) + d2t.long()
    else:
        rows = torch.arange(head.shape[0])
    if int(rows.min()) < 0 or int(rows.max()) >= reference.shape[0]:
        return
    diff = relative_difference(head, reference[rows])
    if diff <= SAME_TENSOR_RTOL:
        add(
            "error",
            "tied-head",
            f"lm_head.weight equals the embedding rows of its draft tokens (relative difference {diff:.3g}): the head "
            "is tied or was never trained",
            "export the trained, untied lm_head",
        )


def _check_against_verifier(cfg: dict, verifier: dict, add) -> None:
    # fc reads three verifier states and t2d spans the verifier's vocabulary: both must be this verifier's.
    # A draft narrower than its verifier is legal (SGLang then keeps the draft's own embedding), hence a warning.
    compared: list[tuple[str, Any, Any, Level]] = [
        ("vocab_size", cfg.get("vocab_size"), verifier.get("vocab_size"), "error"),
        ("target_hidden_size", cfg.get("target_hidden_size") or cfg.get("hidden_size"), verifier.get("hidden_size"), "error"),
        ("hidden_size", cfg.get("hidden_size"), verifier.get("hidden_size"), "warning"),
    ]
    for key, ours, theirs, level in compared:
        if ours is not None and theirs is not None and int(ours) != int(theirs):
            add(
                level,
                f"verifier-{key.replace('_', '-')}",
                f"{key} {ours} differs from the verifier's {'vocab_size' if key == 'vocab_size' else 'hidden_size'} {theirs}",
                "check that this head was trained for this verifier (and pass the verifier it was trained for)",
            )
