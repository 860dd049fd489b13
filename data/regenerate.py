"""``fledge regenerate``: answer the training prompts with the verifier itself, as EAGLE-3 trains.

A draft is judged on how often it predicts what the *verifier* would write, but ShareGPT's answers were written by
another model. Regeneration keeps the user turns of each conversation and replaces every assistant turn with the
verifier's own answer, turn by turn (turn t is generated with the verifier's answers to turns < t in its context).
The result is a JSONL file of OpenAI-form records that ``fledge cache data.source=<out_dir>/conversations.jsonl``
reads like any other source.

Conversations are length-sorted and split into parts of ``batch_size``; each part is generated as one left-padded
batch per turn and written atomically to ``parts/part-XXXXX.jsonl``. A rerun skips complete parts, so a killed run
resumes, and under ``torchrun`` rank r generates the parts ``p % world_size == r``. Rank 0 then merges the parts, in
the source's order, into ``conversations.jsonl`` and writes ``manifest.json``. ``regenerate_plan.json`` binds the
folder to its inputs (verifier weights, prompts, sampling settings, engine): a different input is refused, or
replaced with ``overwrite=true``.

Two engines decode: ``engine=hf`` (default), fledge's own batched loop over the Hugging Face model in this process, and
``engine=vllm``, vLLM's offline batch API in vLLM's own environment (``data/vllm_engine.py``; ``make vllm-env``). Both
get the same token ids: fledge applies the chat template, tokenizes, and sets the stop tokens, the limits and the
seeds either way, so the two differ only in the verifier's arithmetic (identical greedy answers in float32).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from fledge.core.dist import DistInfo, barrier, process_group
from fledge.core.errors import ConfigError, FledgeError
from fledge.core.files import atomic_write_text, renamed_file, retire_old_name
from fledge.data.sources import Conversation, DataConfig, load_conversations
from fledge.data.template import render, stop_token_ids
from fledge.decode.loop import generate
from fledge.models.sampling import SamplingParams
from fledge.models.verifier import (
    Verifier,
    VerifierConfig,
    load_tokenizer,
    load_verifier,
    parse_dtype,
    resolve_verifier_dir,
    weight_fingerprint,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PART_DIR = "parts"
REGENERATE_PLAN = "regenerate_plan.json"
OLD_REGENERATE_PLAN = "plan.json"
"""What binds the folder to its inputs; ``plan.json`` in folders of fledge before 2026-12-05 (still read)."""


class RegenerateError(FledgeError, RuntimeError):
    """The output folder belongs to other inputs, or the inputs cannot be regenerated."""


@dataclass
class RegenerateOptions:
    out_dir: str = "runs/regen"
    """Holds regenerate_plan.json, parts/, and at the end conversations.jsonl and manifest.json."""
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
    engine: str = "hf"
    """What decodes: ``hf`` (fledge's batched loop over the Hugging Face model, in this process; torchrun spreads the
    parts over ranks) or ``vllm`` (vLLM's offline batch API in its own environment, one process; under several GPUs,
    vLLM's tensor parallelism). The same prompts, stop tokens, limits and seeds either way."""
    vllm_python: str | None = None
    """engine=vllm: the Python of vLLM's environment; None: ``$FLEDGE_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
    in the checkout (``make vllm-env`` builds it)."""
    vllm_tensor_parallel_size: int = 1
    """engine=vllm: GPUs one verifier is split over (vLLM's ``tensor_parallel_size``)."""
    vllm_data_parallel_size: int = 1
    """engine=vllm: verifier replicas, each a vLLM engine of its own on ``vllm_tensor_parallel_size`` GPUs of its own
    (``CUDA_VISIBLE_DEVICES``), answering parts in turn (vLLM's data parallelism offline is one engine per replica);
    on a CPU they share its cores."""
    vllm_max_num_seqs: int = 256
    """engine=vllm: sequences vLLM decodes at once (its ``max_num_seqs``); a part holds ``batch_size``."""
    vllm_enforce_eager: bool = False
    """engine=vllm: no compiled graphs (vLLM's ``enforce_eager``): a faster start, a slower decode."""
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
        if self.engine not in ("hf", "vllm"):
            raise ConfigError(f"regenerate.engine must be 'hf' or 'vllm', got {self.engine!r}")
        for name in ("vllm_tensor_parallel_size", "vllm_data_parallel_size", "vllm_max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"regenerate.{name} must be >= 1, got {getattr(self, name)}")
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


Answer = Callable[[list[list[int]], list[int]], list[tuple[list[int], bool]]]
"""One turn of a part: (contexts, limits) -> per context (new tokens without the stop token, stopped)."""


class HFAnswers:
    """engine=hf: fledge's decoding loop over the verifier in this process (:func:`answer_batch`)."""

    def __init__(self, verifier: Verifier, opts: RegenerateOptions, stop_ids: list[int]):
        self.verifier, self.opts, self.stop_ids = verifier, opts, stop_ids

    def part(self, seed: int) -> Answer:
        generator = torch.Generator().manual_seed(seed)  # one stream per part, drawn turn after turn
        return lambda contexts, limits: answer_batch(self.verifier, contexts, limits, self.opts, self.stop_ids,
                                                     generator)


class VllmAnswers:
    """engine=vllm: vLLM's batch API (``data/vllm_engine.py``). Each request of a sampled run has its own seed, drawn
    from the part's seed, the turn and the row, so a resumed part samples what an uninterrupted run would."""

    def __init__(self, engine, opts: RegenerateOptions, stop_ids: list[int]):
        self.engine, self.opts, self.stop_ids = engine, opts, stop_ids

    def part(self, seed: int) -> Answer:
        turn = itertools.count()

        def answer(contexts: list[list[int]], limits: list[int]) -> list[tuple[list[int], bool]]:
            t = next(turn)
            seeds = [None if self.opts.temperature == 0 else
                     int(hashlib.sha256(f"{seed}/{t}/{i}".encode()).hexdigest()[:8], 16) for i in range(len(contexts))]
            outs = self.engine.generate(contexts, limits, self.stop_ids, self.opts.temperature, self.opts.top_p, seeds)
            answered = []
            for o in outs:
                toks = o["token_ids"]
                stopped = o["finish_reason"] == "stop"
                if stopped and toks and toks[-1] in self.stop_ids:
                    toks = toks[:-1]  # as answer_batch: the stop token itself is the chat template's to write
                answered.append((toks, stopped))
            return answered

        return answer


def regenerate_part(
    answer: Answer,
    tok,
    prompts: list[Prompted],
    cfg: RegenerateJobConfig,
    on_tokens=None,
) -> list[dict[str, Any]]:
    """Answer every user turn of these conversations, turn by turn, through ``answer`` (an engine's
    ``part(seed)``); one record per conversation."""
    opts, kwargs = cfg.regenerate, cfg.data.chat_template_kwargs
    answers: list[list[str]] = [[] for _ in prompts]
    finish: list[list[str]] = [[] for _ in prompts]
    open_ = [True] * len(prompts)
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
        answered = answer(contexts, limits)
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


def plan_parts(tok, prompts: list[Prompted], batch_size: int, kwargs: dict[str, Any]) -> list[list[int]]:
    """Length-sorted groups of ``batch_size`` conversations (by their first prompt), so a batch pads little."""

    def first_len(p: Prompted) -> int:
        conv = ([{"role": "system", "content": p.system}] if p.system is not None else []) + [
            {"role": "user", "content": p.questions[0]}
        ]
        return len(render(tok, conv, True, kwargs))  # characters: a cheap, deterministic proxy for tokens

    order = sorted(range(len(prompts)), key=lambda i: (first_len(prompts[i]), i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _plan_record(cfg: RegenerateJobConfig, name: str, fingerprint: str, prompts: list[Prompted]) -> dict[str, Any]:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.index, p.system, p.questions]).encode())
    where = ("out_dir", "device", "overwrite", "vllm_python", "vllm_tensor_parallel_size", "vllm_data_parallel_size",
             "vllm_max_num_seqs", "vllm_enforce_eager")
    opts = {k: v for k, v in asdict(cfg.regenerate).items() if k not in where}
    if opts["parts"] is None:
        del opts["parts"]  # a whole run's record reads as it did before slices existed
    if opts["engine"] == "hf":
        del opts["engine"]  # ... and as it did before there was a choice of engine
    return {
        "format_version": FORMAT_VERSION,
        "verifier": name,
        "verifier_fingerprint": fingerprint,
        "data": asdict(cfg.data),
        "options": opts,
        "prompts_sha256": h.hexdigest(),
        "num_conversations": len(prompts),
    }


def claim(out_dir: Path, record: dict[str, Any], overwrite: bool) -> None:
    plan = renamed_file(out_dir, REGENERATE_PLAN, OLD_REGENERATE_PLAN)
    if plan.is_file():
        old = json.loads(plan.read_text())
        if old == record:
            plan.replace(out_dir / REGENERATE_PLAN)  # a folder of an earlier fledge takes the current name
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
    atomic_write_text(out_dir / REGENERATE_PLAN, json.dumps(record, indent=1))
    retire_old_name(out_dir, OLD_REGENERATE_PLAN)


def merge(out_dir: Path, part_ids: list[int], record: dict[str, Any], seconds: float, new_tokens: int = 0,
          engine: dict[str, Any] | None = None) -> dict[str, Any]:
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
        "new_tokens_this_run": new_tokens,
    }
    if engine:
        manifest["engine_this_run"] = engine
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=1))
    return manifest


def run(cfg: RegenerateJobConfig) -> Path:
    with process_group(cfg.regenerate.device) as (info, device):
        return _run(cfg, info, device)


@dataclass
class _Weights:
    """What engine=vllm needs of the verifier in this process: its tokenizer, name, fingerprint and folder (vLLM
    loads the weights itself)."""

    tokenizer: Any
    name: str
    fingerprint: str
    path: Path
    generation_config: Any


def _vllm_weights(cfg: VerifierConfig) -> _Weights:
    from transformers import AutoConfig, GenerationConfig

    path = resolve_verifier_dir(cfg)
    if (path / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(path)
    else:  # what a loaded model's generation_config would be: the one its config implies
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        gen = GenerationConfig.from_model_config(config)
    return _Weights(load_tokenizer(cfg, path), cfg.name_or_path, weight_fingerprint(path), path, gen)


def replica_devices(opts: RegenerateOptions, replicas: int, device: torch.device) -> list[str | None]:
    """Each replica's ``CUDA_VISIBLE_DEVICES``: ``vllm_tensor_parallel_size`` of the GPUs this process sees, in
    turn (None on a CPU). Refused before any engine starts when there are too few."""
    if device.type != "cuda":
        return [None] * replicas
    tp = opts.vllm_tensor_parallel_size
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = seen.split(",") if seen else [str(i) for i in range(torch.cuda.device_count())]
    if replicas * tp > len(ids):
        raise ConfigError(f"{replicas} replica(s) of {tp} GPU(s) need {replicas * tp} GPUs; this process sees "
                          f"{len(ids)}", fix="lower regenerate.vllm_data_parallel_size or vllm_tensor_parallel_size")
    return [",".join(ids[r * tp: (r + 1) * tp]) for r in range(replicas)]


def _start_vllm(cfg: RegenerateJobConfig, weights: _Weights, python: Path, log_path: Path, device: torch.device,
                gpus: str | None = None):
    """An engine; ``gpus``: its ``CUDA_VISIBLE_DEVICES`` (``replica_devices``)."""
    from fledge.data.vllm_engine import VllmEngine, cpu_env, vllm_dtype

    opts = cfg.regenerate
    settings = {
        "model": str(weights.path),
        "tokenizer": str(weights.path),
        "skip_tokenizer_init": True,  # fledge tokenizes and detokenizes; vLLM sees token ids only
        "dtype": vllm_dtype(parse_dtype(cfg.verifier.dtype, device)),  # auto: as engine=hf would run here
        "seed": opts.seed,
        "max_model_len": cfg.data.max_length,
        "max_num_seqs": opts.vllm_max_num_seqs,
        "tensor_parallel_size": opts.vllm_tensor_parallel_size,
        "trust_remote_code": cfg.verifier.trust_remote_code,
        "enforce_eager": opts.vllm_enforce_eager,
    }
    env = cpu_env() if gpus is None else {**cpu_env(), "CUDA_VISIBLE_DEVICES": gpus}
    return VllmEngine(python, settings, log_path, env=env)


def _run(cfg: RegenerateJobConfig, info: DistInfo, device: torch.device) -> Path:
    opts = cfg.regenerate
    out_dir = Path(opts.out_dir)
    python = None
    if opts.engine == "vllm":
        from fledge.data.vllm_engine import find_vllm_python

        if info.world_size > 1:
            raise ConfigError(f"regenerate.engine=vllm runs in one process (got {info.world_size} ranks): vLLM spreads "
                              "one verifier over GPUs itself", fix="run fledge regenerate without torchrun, with "
                              "regenerate.vllm_tensor_parallel_size=<GPUs>")
        python = find_vllm_python(opts.vllm_python)  # before anything loads: a missing engine fails at once
    if info.is_main:
        resolve_verifier_dir(cfg.verifier)  # convert a GGUF once, before the other ranks look for it
    barrier()
    # The data first: a source that does not exist or yields nothing is refused before the verifier loads.
    conversations, _ = load_conversations(cfg.data)  # logs its own report
    weights = _vllm_weights(cfg.verifier) if python else load_verifier(cfg.verifier, device)
    prompts = to_prompts(conversations, opts.turns)
    if not prompts:
        raise RegenerateError(f"no user turns to answer in {cfg.data.describe()}", fix="check data.source")
    record = _plan_record(cfg, weights.name, weights.fingerprint, prompts)
    kwargs = cfg.data.chat_template_kwargs
    parts = plan_parts(weights.tokenizer, prompts, opts.batch_size, kwargs)
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

    gen_config = weights.generation_config if python else getattr(weights.model, "generation_config", None)
    stop_ids = stop_token_ids(weights.tokenizer, gen_config, kwargs)
    mine = [p for p in selected if p % info.world_size == info.rank]
    todo = [p for p in mine if not (out_dir / PART_DIR / part_name(p)).is_file()]
    if len(todo) < len(mine):
        log.info("rank %d: %d of %d parts already generated", info.rank, len(mine) - len(todo), len(mine))
    start = time.perf_counter()
    produced = 0
    bar = tqdm(total=sum(len(parts[p]) for p in todo), unit="conv", desc=f"regenerate[{info.rank}]", disable=not info.is_main)
    counting = threading.Lock()

    def count(n: int) -> None:
        nonlocal produced
        with counting:  # (replicas answer on threads of their own)
            produced += n
            bar.set_postfix_str(f"{produced:,} tokens, {produced / max(1e-9, time.perf_counter() - start):.0f} tok/s")

    def answer_parts(answers: HFAnswers | VllmAnswers, mine: list[int]) -> None:
        for p in mine:
            records = regenerate_part(answers.part(opts.seed + p), weights.tokenizer, [prompts[i] for i in parts[p]],
                                      cfg, count)
            atomic_write_text(
                out_dir / PART_DIR / part_name(p), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            )
            bar.update(len(parts[p]))
            if os.environ.get("FLEDGE_FAULT") == f"regenerate_after_part_{p}":
                os._exit(137)  # fault injection for the resume test: die like kill -9 right after this part

    engines, engine_info = [], {}
    try:
        if python is None:
            answer_parts(HFAnswers(weights, opts, stop_ids), todo)
        elif todo:
            replicas = min(opts.vllm_data_parallel_size, len(todo))
            gpus = replica_devices(opts, replicas, device)
            logs = [out_dir / "vllm.log"] if replicas == 1 else [out_dir / f"vllm-{r}.log" for r in range(replicas)]
            with ThreadPoolExecutor(replicas) as pool:  # the replicas start side by side
                started = [pool.submit(_start_vllm, cfg, weights, python, logs[r], device, gpus[r])
                           for r in range(replicas)]
            engines = [f.result() for f in started if f.exception() is None]
            failed = [f.exception() for f in started if f.exception() is not None]
            if failed:
                raise failed[0]  # (the engines that did start are closed below)
            first = engines[0].info
            engine_info = {"engine": "vllm", "vllm": first["vllm"], "torch": first["torch"],
                           "load_seconds": max(e.info["load_seconds"] for e in engines)}
            if replicas > 1:
                engine_info["replicas"] = replicas
            start = time.perf_counter()  # tokens/s of decoding, as for hf (whose load came before the data)
            with ThreadPoolExecutor(replicas) as pool:  # parts dealt in turn; each replica answers its own
                done = [pool.submit(answer_parts, VllmAnswers(e, opts, stop_ids), todo[r::replicas])
                        for r, e in enumerate(engines)]
                for future in done:
                    future.result()
    finally:
        bar.close()
        for engine in engines:
            engine.close()
    seconds = time.perf_counter() - start
    barrier()
    out = out_dir / "conversations.jsonl"
    if info.is_main:
        manifest = merge(out_dir, selected, record, seconds, produced, engine_info)
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
