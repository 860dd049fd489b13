"""``fledge regenerate``: answer the training prompts with the verifier itself, as EAGLE-3 trains.

A draft is judged on how often it predicts what the *verifier* would write, but ShareGPT's answers were written by
another model. Regeneration keeps the user turns of each conversation and replaces every assistant turn with the
verifier's own answer, turn by turn (turn t is generated with the verifier's answers to turns < t in its context).
The result is a JSONL file of OpenAI-form records that ``fledge cache data.source=<out_dir>/conversations.jsonl``
reads like any other source.

Conversations are length-sorted and split into parts of ``batch_size``; each part is generated as one left-padded
batch per turn and written atomically to ``parts/part-XXXXX.jsonl``. A rerun skips complete parts, so a killed run
resumes, and under ``torchrun`` rank r generates the parts ``p % world_size == r``. Rank 0 then merges the parts, in
the source's order, into ``conversations.jsonl`` and writes ``manifest.json``. ``plan.json`` binds the folder to its
inputs (verifier weights, prompts, sampling settings): a different input is refused, or replaced with
``overwrite=true``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fledge.core.dist import DistInfo, barrier, process_group
from fledge.core.errors import ConfigError, FledgeError
from fledge.core.files import atomic_write_text
from fledge.data.sources import Conversation, DataConfig, load_conversations
from fledge.data.template import render, stop_token_ids
from fledge.decode.loop import generate
from fledge.models.sampling import SamplingParams
from fledge.models.verifier import Verifier, VerifierConfig, load_verifier, resolve_verifier_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PART_DIR = "parts"


class RegenerateError(FledgeError, RuntimeError):
    """The output folder belongs to other inputs, or the inputs cannot be regenerated."""


@dataclass
class RegenerateOptions:
    out_dir: str = "runs/regen"
    """Holds plan.json, parts/, and at the end conversations.jsonl and manifest.json."""
    batch_size: int = 32
    """Conversations generated together (one left-padded batch per turn); also the unit of resumption."""
    max_new_tokens: int = 512
    """Per assistant turn. An answer cut at this length ends its conversation (later turns would follow a cut
    answer); it is kept and counted as 'length'."""
    turns: str = "all"
    """'all' answers every user turn in order; 'first' keeps only the first exchange."""
    temperature: float = 0.0
    """0 is greedy (what greedy speculative decoding accepts); > 0 samples, with top_p."""
    top_p: float = 1.0
    seed: int = 0
    """Sampling seed; part p uses seed + p, so a resumed run draws what an uninterrupted one would."""
    device: str = "auto"
    overwrite: bool = False
    """Replace an output folder that was made for other inputs (otherwise that is refused)."""
    parts: list[int] | None = None
    """Only these parts of the plan (the length-sorted groups of ``batch_size``; part 0 holds the shortest prompts):
    a slice to check a regenerated file against, as ``python -m fledge.data.shipped check`` does. None: all."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"regenerate.batch_size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"regenerate.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.turns not in ("all", "first"):
            raise ConfigError(f"regenerate.turns must be 'all' or 'first', got {self.turns!r}")
        if self.temperature < 0:
            raise ConfigError(f"regenerate.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"regenerate.top_p must be in (0, 1], got {self.top_p}")
        if self.parts is not None and (not self.parts or min(self.parts) < 0):
            raise ConfigError(f"regenerate.parts must be null or a non-empty list of indices >= 0, got {self.parts}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)


@dataclass
class RegenerateJobConfig:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(max_conversations=1000, require_assistant=False))
    """The prompts. ``data.max_length`` caps a conversation's tokens, prompts and answers together, as in the cache:
    an answer stops there (finish 'length'), and a user turn whose prompt already reaches it is not answered."""
    regenerate: RegenerateOptions = field(default_factory=RegenerateOptions)


@dataclass
class Prompted:
    """One conversation to answer: its index in the source, optional system turn and user turns."""

    index: int
    system: str | None
    questions: list[str]


def to_prompts(conversations: list[Conversation], turns: str) -> list[Prompted]:
    out = []
    for i, conv in enumerate(conversations):
        system = conv[0]["content"] if conv and conv[0]["role"] == "system" else None
        questions = [m["content"] for m in conv if m["role"] == "user"]
        if turns == "first":
            questions = questions[:1]
        if questions:
            out.append(Prompted(i, system, questions))
    return out


def _history(p: Prompted, answers: list[str]) -> Conversation:
    conv: Conversation = [{"role": "system", "content": p.system}] if p.system is not None else []
    for q, a in zip(p.questions, answers):
        conv += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return conv


def answer_batch(
    verifier: Verifier,
    contexts: list[list[int]],
    limits: list[int],
    opts: RegenerateOptions,
    stop_ids: list[int],
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], bool]]:
    """Continue each context (token ids) until a stop token or its limit of new tokens, as one batch of fledge's
    decoding loop (``decode/loop.py``: plain decoding, finished rows leave the batch).

    Returns, per context, the new tokens (without the stop token) and whether a stop token ended it. The part's own
    seeded generator (on the CPU) draws every sampled token, so that a resumed part samples exactly what an
    uninterrupted run would have, on any device.
    """
    results, _ = generate(verifier.model, [torch.tensor(c, dtype=torch.long) for c in contexts], None,
                          method="plain", max_new_tokens=limits, sampling=opts.sampling(),
                          stop_ids=frozenset(stop_ids), generator=generator)
    answered = []
    for r in results:
        stopped = bool(r.tokens) and r.tokens[-1] in stop_ids  # the stop token itself is the chat template's to write
        answered.append((r.tokens[:-1] if stopped else r.tokens, stopped))
    return answered


def regenerate_part(
    verifier: Verifier,
    prompts: list[Prompted],
    cfg: RegenerateJobConfig,
    stop_ids: list[int],
    seed: int,
    on_tokens=None,
) -> list[dict[str, Any]]:
    """Answer every user turn of these conversations, turn by turn; one record per conversation."""
    opts, kwargs = cfg.regenerate, cfg.data.chat_template_kwargs
    tok = verifier.tokenizer
    answers: list[list[str]] = [[] for _ in prompts]
    finish: list[list[str]] = [[] for _ in prompts]
    open_ = [True] * len(prompts)
    generator = torch.Generator().manual_seed(seed)
    for t in range(max(len(p.questions) for p in prompts)):
        rows, contexts, limits = [], [], []
        for r, p in enumerate(prompts):
            if not open_[r] or t >= len(p.questions):
                continue
            conv = _history(p, answers[r]) + [{"role": "user", "content": p.questions[t]}]
            ids = tok(render(tok, conv, True, kwargs), add_special_tokens=False)["input_ids"]
            if len(ids) >= cfg.data.max_length - 1:
                open_[r] = False
                finish[r].append("prompt too long")
                continue
            rows.append(r)
            contexts.append(ids)
            # No answer runs past data.max_length: the cache would cut it there anyway.
            limits.append(min(opts.max_new_tokens, cfg.data.max_length - len(ids)))
        if not rows:
            break
        answered = answer_batch(verifier, contexts, limits, opts, stop_ids, generator)
        for r, (toks, stopped) in zip(rows, answered):
            answers[r].append(tok.decode(toks, skip_special_tokens=True).strip())
            finish[r].append("stop" if stopped else "length")
            if not stopped:
                open_[r] = False
            if on_tokens is not None:
                on_tokens(len(toks))
    records = []
    for p, a, f in zip(prompts, answers, finish):
        records.append({"id": p.index, "messages": _history(p, a), "finish": f, "unanswered": len(p.questions) - len(a)})
    return records


def part_name(p: int) -> str:
    return f"part-{p:05d}.jsonl"


def plan_parts(verifier: Verifier, prompts: list[Prompted], batch_size: int, kwargs: dict[str, Any]) -> list[list[int]]:
    """Length-sorted groups of ``batch_size`` conversations (by their first prompt), so a batch pads little."""
    tok = verifier.tokenizer

    def first_len(p: Prompted) -> int:
        conv = ([{"role": "system", "content": p.system}] if p.system is not None else []) + [
            {"role": "user", "content": p.questions[0]}
        ]
        return len(render(tok, conv, True, kwargs))  # characters: a cheap, deterministic proxy for tokens

    order = sorted(range(len(prompts)), key=lambda i: (first_len(prompts[i]), i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _plan_record(cfg: RegenerateJobConfig, verifier: Verifier, prompts: list[Prompted]) -> dict[str, Any]:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.index, p.system, p.questions]).encode())
    opts = {k: v for k, v in asdict(cfg.regenerate).items() if k not in ("out_dir", "device", "overwrite")}
    if opts["parts"] is None:
        del opts["parts"]  # a whole run's record reads as it did before slices existed
    return {
        "format_version": FORMAT_VERSION,
        "verifier": verifier.name,
        "verifier_fingerprint": verifier.fingerprint,
        "data": asdict(cfg.data),
        "options": opts,
        "prompts_sha256": h.hexdigest(),
        "num_conversations": len(prompts),
    }


def claim(out_dir: Path, record: dict[str, Any], overwrite: bool) -> None:
    plan = out_dir / "plan.json"
    if plan.is_file():
        old = json.loads(plan.read_text())
        if old == record:
            return
        if not overwrite:
            diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
            raise RegenerateError(
                f"{out_dir} holds answers for other inputs (differs in {', '.join(diff)})",
                fix="use another regenerate.out_dir or regenerate.overwrite=true",
            )
        log.warning("%s was made for other inputs; overwriting", out_dir)
        shutil.rmtree(out_dir)
    (out_dir / PART_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan, json.dumps(record, indent=1))


def merge(out_dir: Path, part_ids: list[int], record: dict[str, Any], seconds: float) -> dict[str, Any]:
    rows = []
    for p in part_ids:
        with open(out_dir / PART_DIR / part_name(p)) as fh:
            rows += [json.loads(line) for line in fh]
    rows.sort(key=lambda r: r["id"])
    finish = Counter(f for r in rows for f in r["finish"])
    kept = [r for r in rows if any(m["role"] == "assistant" for m in r["messages"])]
    atomic_write_text(out_dir / "conversations.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    manifest = {
        **record,
        "conversations_written": len(kept),
        "conversations_without_answer": len(rows) - len(kept),
        "answers": sum(finish[k] for k in ("stop", "length")),
        "finish": dict(finish),
        "seconds_this_run": round(seconds, 1),
    }
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=1))
    return manifest


def run(cfg: RegenerateJobConfig) -> Path:
    with process_group(cfg.regenerate.device) as (info, device):
        return _run(cfg, info, device)


def _run(cfg: RegenerateJobConfig, info: DistInfo, device: torch.device) -> Path:
    opts = cfg.regenerate
    out_dir = Path(opts.out_dir)
    if info.is_main:
        resolve_verifier_dir(cfg.verifier)  # convert a GGUF once, before the other ranks look for it
    barrier()
    verifier = load_verifier(cfg.verifier, device)
    conversations, _ = load_conversations(cfg.data)  # logs its own report
    prompts = to_prompts(conversations, opts.turns)
    if not prompts:
        raise RegenerateError(f"no user turns to answer in {cfg.data.describe()}", fix="check data.source")
    record = _plan_record(cfg, verifier, prompts)
    kwargs = cfg.data.chat_template_kwargs
    parts = plan_parts(verifier, prompts, opts.batch_size, kwargs)
    selected = list(range(len(parts))) if opts.parts is None else sorted(set(opts.parts))
    if selected[-1] >= len(parts):
        raise ConfigError(f"regenerate.parts: the plan has parts 0..{len(parts) - 1} "
                          f"({len(prompts)} conversations in groups of {opts.batch_size}), got {opts.parts}")
    manifest_path = out_dir / "manifest.json"
    if manifest_path.is_file() and (out_dir / "conversations.jsonl").is_file():
        manifest = json.loads(manifest_path.read_text())
        if all(manifest.get(k) == v for k, v in record.items()):
            if info.is_main:
                log.info("%s is complete for these inputs; nothing to do", out_dir)
            return out_dir / "conversations.jsonl"
    if info.is_main:
        claim(out_dir, record, opts.overwrite)
        for stale in (out_dir / PART_DIR).glob("*.tmp-*"):
            stale.unlink()
    barrier()

    stop_ids = stop_token_ids(verifier.tokenizer, getattr(verifier.model, "generation_config", None), kwargs)
    mine = [p for p in selected if p % info.world_size == info.rank]
    todo = [p for p in mine if not (out_dir / PART_DIR / part_name(p)).is_file()]
    if len(todo) < len(mine):
        log.info("rank %d: %d of %d parts already generated", info.rank, len(mine) - len(todo), len(mine))
    start = time.perf_counter()
    produced = 0
    bar = tqdm(total=sum(len(parts[p]) for p in todo), unit="conv", desc=f"regenerate[{info.rank}]", disable=not info.is_main)

    def count(n: int) -> None:
        nonlocal produced
        produced += n
        bar.set_postfix_str(f"{produced:,} tokens, {produced / max(1e-9, time.perf_counter() - start):.0f} tok/s")

    try:
        for p in todo:
            records = regenerate_part(verifier, [prompts[i] for i in parts[p]], cfg, stop_ids, opts.seed + p, count)
            atomic_write_text(
                out_dir / PART_DIR / part_name(p), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            )
            bar.update(len(parts[p]))
            if os.environ.get("FLEDGE_FAULT") == f"regenerate_after_part_{p}":
                os._exit(137)  # fault injection for the resume test: die like kill -9 right after this part
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    barrier()
    out = out_dir / "conversations.jsonl"
    if info.is_main:
        manifest = merge(out_dir, selected, record, seconds)
        log.info(
            "regenerated %d conversations (%d answers: %s) into %s; %d new tokens in %.0f s on this rank (%.0f tok/s)",
            manifest["conversations_written"],
            manifest["answers"],
            ", ".join(f"{k} {v}" for k, v in sorted(manifest["finish"].items())),
            out,
            produced,
            seconds,
            produced / max(seconds, 1e-9),
        )
    barrier()
    return out
