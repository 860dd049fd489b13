"""A verifier's shapes without its weights: from its ``config.json``, from a GGUF file's metadata, or from the table
of the presets' verifiers, for planning a job (``fledge plan``) on a machine that has neither the weights nor a
network.

Where the shapes come from, in order: what the user gives (``shape.hidden_size=...``; any field given wins over
what is read), a local Hugging Face folder's ``config.json``, a ``.gguf`` file's header (read by hand below: only
the key-value section and the tensor names, never a tensor), the embedded default verifier (its converted folder
when there is one, its GGUF otherwise), a Hub id's ``config.json`` in the local Hugging Face cache (never a
download), and last ``KNOWN_SHAPES``.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.models.verifier import EMBEDDED_VERIFIERS, VerifierConfig, embedded_gguf

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass
class VerifierShape:
    """The sizes of a Llama-style verifier, dense or mixture-of-experts, that decide a job's memory, FLOPs and disk;
    None where unknown.

    A mixture-of-experts verifier (Qwen3-MoE, Mixtral) has ``num_experts`` routed experts in each of its MoE layers,
    ``num_experts_per_tok`` of which run for each token: its memory is that of every parameter, its FLOPs those of
    the active ones (``params`` against ``active_params``)."""

    hidden_size: int | None = None
    intermediate_size: int | None = None
    """Width of each decoder layer's MLP (the draft copies it)."""
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    """None: as many as the attention heads (no grouped-query attention)."""
    head_dim: int | None = None
    """None: hidden_size / num_attention_heads."""
    vocab_size: int | None = None
    tie_word_embeddings: bool | None = None
    """Whether the output head is the input embedding (None: false, a separate head)."""
    num_experts: int | None = None
    """Routed experts per MoE layer (``num_experts``, ``num_local_experts``); None or 0: a dense verifier."""
    num_experts_per_tok: int | None = None
    """Experts each token runs through (None: 2, the common choice, where ``num_experts`` is set)."""
    moe_intermediate_size: int | None = None
    """Each expert's MLP width (Qwen3-MoE's ``moe_intermediate_size``); None: ``intermediate_size`` (Mixtral)."""
    num_dense_layers: int | None = None
    """Layers whose MLP is dense (``intermediate_size``) in a MoE verifier (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``); None: 0."""

    def missing(self) -> list[str]:
        return [name for name in REQUIRED if getattr(self, name) is None]

    def complete(self) -> VerifierShape:
        """This shape with its optional fields filled (kv heads = heads, head_dim = hidden / heads, untied)."""
        missing = self.missing()
        if missing:
            raise ConfigError(f"the verifier's shape misses {missing}", fix="give them as shape.<field>=<value>")
        heads = int(self.num_attention_heads)
        experts = int(self.num_experts or 0)
        if experts and not 0 < int(self.num_experts_per_tok or 2) <= experts:
            raise ConfigError(f"the verifier's shape: num_experts_per_tok {self.num_experts_per_tok} is not within "
                              f"1..num_experts ({experts})", fix="give shape.num_experts_per_tok=<k>")
        return VerifierShape(
            hidden_size=int(self.hidden_size),
            intermediate_size=int(self.intermediate_size),
            num_hidden_layers=int(self.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(self.num_key_value_heads or heads),
            head_dim=int(self.head_dim or int(self.hidden_size) // heads),
            vocab_size=int(self.vocab_size),
            tie_word_embeddings=bool(self.tie_word_embeddings),
            # a dense verifier keeps the four None: its complete shape is what it always was
            num_experts=experts or None,
            num_experts_per_tok=int(self.num_experts_per_tok or 2) if experts else None,
            moe_intermediate_size=int(self.moe_intermediate_size or self.intermediate_size) if experts else None,
            num_dense_layers=int(self.num_dense_layers or 0) if experts else None,
        )

    def overlay(self, given: VerifierShape) -> VerifierShape:
        """This shape with every field that ``given`` sets replaced by its value."""
        return replace(self, **{k: v for k, v in asdict(given).items() if v is not None})

    def mlp_params(self, active: bool = False) -> int:
        """Parameters of every decoder layer's MLP together; with ``active``, only those one token runs through (in a
        MoE layer: its router and ``num_experts_per_tok`` experts, each gate/up/down of ``moe_intermediate_size``)."""
        s = self.complete()
        h = s.hidden_size
        if not s.num_experts:
            return s.num_hidden_layers * 3 * h * s.intermediate_size
        dense = s.num_dense_layers * 3 * h * s.intermediate_size
        experts = s.num_experts_per_tok if active else s.num_experts
        per_layer = experts * 3 * h * s.moe_intermediate_size + s.num_experts * h  # the experts and the router
        moe = (s.num_hidden_layers - s.num_dense_layers) * per_layer
        return dense + moe

    def params(self, active: bool = False) -> int:
        """Parameters of the whole verifier: embedding, decoder layers (attention, MLP or experts and router, two
        norms each), final norm and the output head unless it is tied to the embedding; with ``active``, a MoE
        verifier's experts count only as far as one token runs through them."""
        s = self.complete()
        h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        layer = h * q + 2 * h * kv + q * h + 2 * h
        head = 0 if s.tie_word_embeddings else s.vocab_size * h
        return s.vocab_size * h + s.num_hidden_layers * layer + self.mlp_params(active) + h + head

    def active_params(self) -> int:
        return self.params(active=True)

    def widest_mlp(self) -> int:
        """The widest MLP activation one token makes in any layer (a dense layer's, or a MoE layer's experts')."""
        s = self.complete()
        if not s.num_experts:
            return s.intermediate_size
        dense = s.intermediate_size if s.num_dense_layers else 0
        return max(dense, s.num_experts_per_tok * s.moe_intermediate_size)


# The presets' verifiers (and the embedded default), as their config.json on the Hugging Face Hub gives them, so that
# `fledge plan preset=...` works on a machine without their weights or a network.
KNOWN_SHAPES: dict[str, VerifierShape] = {
    "meta-llama/Llama-3.1-8B-Instruct": VerifierShape(4096, 14336, 32, 32, 8, 128, 128256, False),
    "meta-llama/Llama-3.3-70B-Instruct": VerifierShape(8192, 28672, 80, 64, 8, 128, 128256, False),
    "Qwen/Qwen3-8B": VerifierShape(4096, 12288, 36, 32, 8, 128, 151936, False),
    "HuggingFaceTB/SmolLM2-135M-Instruct": VerifierShape(576, 1536, 30, 9, 3, 64, 49152, True),
    # 128 experts of width 768, 8 per token, every layer a MoE layer: 30.5 B parameters, 3.3 B active
    "Qwen/Qwen3-30B-A3B": VerifierShape(2048, 6144, 48, 32, 4, 128, 151936, False, 128, 8, 768, 0),
}


def shape_from_config(config: dict[str, Any]) -> VerifierShape:
    """The shape a Hugging Face ``config.json`` gives (a multimodal config's ``text_config`` when it has one)."""
    text = config.get("text_config") or config
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    dense = None
    if experts:
        layers = int(text.get("num_hidden_layers") or 0)
        only = set(text.get("mlp_only_layers") or [])
        step = int(text.get("decoder_sparse_step") or 1)
        first = int(text.get("first_k_dense_replace") or 0)
        dense = sum(1 for i in range(layers) if i in only or (i + 1) % step != 0 or i < first)
    return VerifierShape(
        hidden_size=text.get("hidden_size"),
        intermediate_size=text.get("intermediate_size"),
        num_hidden_layers=text.get("num_hidden_layers"),
        num_attention_heads=text.get("num_attention_heads"),
        num_key_value_heads=text.get("num_key_value_heads"),
        head_dim=text.get("head_dim"),
        vocab_size=text.get("vocab_size"),
        tie_word_embeddings=tied,
        num_experts=experts,
        num_experts_per_tok=(text.get("num_experts_per_tok") or text.get("experts_per_token")) if experts else None,
        moe_intermediate_size=text.get("moe_intermediate_size") if experts else None,
        num_dense_layers=dense,
    )


# ------------------------------------------------------------------------------------------------------ GGUF header
# GGUF v2/v3 (the GGUF specification in the ggml-org/ggml repository): magic, version u32, tensor count u64,
# key-value count u64, the key-values (key string, value type u32, value), then per tensor its name, dims, type and
# offset.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:  # skipped: only arrays' lengths matter here (the tokenizer's vocabulary)
                self.pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item)
            return _ArrayLength(count)
        raise ValueError(f"unknown GGUF value type {kind}")


@dataclass(frozen=True)
class _ArrayLength:
    length: int


def read_gguf_header(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A GGUF file's metadata (arrays as their lengths) and its tensor names, read from the header only."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        cur = _Cursor(memoryview(mapped))
        try:
            if bytes(cur.buf[:4]) != b"GGUF":
                raise ConfigError(f"{path} is not a GGUF file (no GGUF magic)", fix="check verifier.name_or_path")
            cur.pos = 4
            version = cur.unpack("<I")
            if version < 2:
                raise ConfigError(f"{path}: GGUF version {version} is too old to read", fix="convert it to GGUF v3")
            tensors, kvs = cur.unpack("<Q"), cur.unpack("<Q")
            metadata = {}
            for _ in range(kvs):
                key = cur.string()
                metadata[key] = cur.value(cur.unpack("<I"))
            names = []
            for _ in range(tensors):
                names.append(cur.string())
                dims = cur.unpack("<I")
                cur.pos += 8 * dims + 4 + 8  # dims, type, offset
            return metadata, names
        finally:
            cur.buf.release()


def shape_from_gguf(path: Path) -> VerifierShape:
    metadata, names = read_gguf_header(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{path}: no general.architecture in its metadata", fix="give the shape as shape.<field>=...")

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    vocab = get("vocab_size")
    if vocab is None and isinstance(metadata.get("tokenizer.ggml.tokens"), _ArrayLength):
        vocab = metadata["tokenizer.ggml.tokens"].length
    heads = get("attention.head_count")
    return VerifierShape(
        hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv"),
        head_dim=get("attention.key_length"),
        vocab_size=vocab,
        # llama.cpp writes no output.weight when the head is the embedding
        tie_word_embeddings="output.weight" not in names,
        num_experts=get("expert_count") or None,
        num_experts_per_tok=get("expert_used_count") if get("expert_count") else None,
        moe_intermediate_size=get("expert_feed_forward_length") if get("expert_count") else None,
        num_dense_layers=get("leading_dense_block_count") if get("expert_count") else None,
    )


# ------------------------------------------------------------------------------------------------------- resolving
def _hub_config(repo_id: str) -> dict[str, Any] | None:
    """A Hub model's config.json from the local Hugging Face cache, or None; never downloads."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def read_shape(verifier: VerifierConfig) -> tuple[VerifierShape | None, str]:
    """The verifier's shape as far as it can be read here without its weights, and where it came from."""
    name = verifier.name_or_path
    if name in EMBEDDED_VERIFIERS:
        converted = Path(verifier.home).expanduser() / "verifiers" / name / "config.json"
        if converted.is_file():
            return shape_from_config(json.loads(converted.read_text())), str(converted)
        gguf = embedded_gguf(name)
        return shape_from_gguf(gguf), str(gguf)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return shape_from_gguf(path), str(path)
    if (path / "config.json").is_file():
        return shape_from_config(json.loads((path / "config.json").read_text())), str(path / "config.json")
    config = _hub_config(name) if name.count("/") == 1 and not path.exists() else None
    if config is not None:
        return shape_from_config(config), f"{name} config.json in the Hugging Face cache"
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name], f"fledge's table of known verifiers ({name})"
    return None, "nowhere"


def resolve_shape(verifier: VerifierConfig, given: VerifierShape) -> tuple[VerifierShape, str]:
    """The complete shape: what ``given`` sets, the rest read (``read_shape``); a ConfigError names what is
    missing and how to give it."""
    if not given.missing():
        return given.complete(), "given"
    read, source = read_shape(verifier)
    shape = (read or VerifierShape()).overlay(given)
    missing = shape.missing()
    if missing:
        example = " ".join(f"shape.{k}=..." for k in missing)
        raise ConfigError(
            f"cannot read the shape of verifier {verifier.name_or_path!r} here (no config.json, GGUF or Hugging Face "
            f"cache entry, and not among {sorted(KNOWN_SHAPES)}); missing {missing}",
            fix=f"give it: {example} (from the model's config.json)",
        )
    given_fields = [f.name for f in fields(given) if getattr(given, f.name) is not None]
    return shape.complete(), source + (f", with {given_fields} given" if given_fields else "")
