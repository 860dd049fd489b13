"""Evaluation prompt sets: MT-bench, HumanEval, held-out ShareGPT prompts by kind of task, and prompt files.

Training reads conversations (``data/sources.py``); evaluation reads prompts, the user turns a drafter is measured on.
A drafter tuned on MT-bench and HumanEval alone can fit them and lose elsewhere, so ``tasks:<kind>`` gives prompts of
the kinds of task where copying and drafting differ most (Spec-Bench's categories: translation, summarization,
questions over a long passage, math, plain chat), picked by fixed rules from ShareGPT conversations past the first
``TASKS_OFFSET`` usable ones: no quickstart or test trains that far into ShareGPT, so they are prompts the draft never
saw (a run with ``data.offset + data.max_conversations`` beyond it should evaluate on other sets).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.data.json_stream import DataError, iter_jsonl
from fledge.data.sources import (
    DataConfig, Reading, humaneval_path, load_conversations, mtbench_dir, normalise_record, source_records,
    usable_conversations,
)

log = logging.getLogger(__name__)

TASKS_PREFIX = "tasks:"
TASKS_OFFSET = 6000
"""``tasks:<kind>`` reads ShareGPT after this many usable conversations."""
TASKS_READ = 12000
"""... and at most this many after them (of the file's ~17,000)."""
TASKS = ("translation", "summarization", "passage_qa", "math", "chat")
"""The kinds ``tasks:<kind>`` gives, in the order a conversation is tested for them (the first that fits)."""
TRANSLATE = "Translate the following text into English:\n\n"


def task_of(turn: str) -> tuple[str, str] | None:
    """(kind, the prompt) for a first user turn that fits one of ``TASKS``, else None.

    translation: a turn of 40-1,500 characters in a Latin script with accents (2 % of its characters or more:
    French, Spanish, German, Vietnamese, ...) or mostly in another script (Chinese, Korean, Russian, ...), which the
    prompt asks to translate into English; summarization: a turn over 800 characters that asks for a summary or
    TL;DR; passage_qa: a turn over 1,500 characters with a question in its last 400 (a long text, then a question
    on it); math: a turn under 800 characters with a digit and a word of calculation; chat: any other turn of 40-600
    characters without accents."""
    if not turn or len(turn) > 6000:
        return None
    low = turn.lower()
    accents = sum(1 for ch in turn if 0xC0 <= ord(ch) <= 0x17F)
    accented = accents / len(turn)
    latin = accents >= 2 and accented > 0.02 and not any(ord(ch) > 0x2000 for ch in turn)
    other_script = sum(1 for ch in turn if ch.isalpha() and ord(ch) > 0x2FF) / len(turn) > 0.3
    if (latin or other_script) and 40 < len(turn) < 1500:
        return "translation", TRANSLATE + turn
    if re.search(r"\bsummari[sz]e\b|\bsummary\b|\btl;?dr\b", low) and len(turn) > 800:
        return "summarization", turn
    if len(turn) > 1500 and "?" in turn[-400:]:
        return "passage_qa", turn
    if (len(turn) < 800 and re.search(r"\d", turn)
            and re.search(r"\b(calculate|solve|how many|how much|probability|equation|percent)\b", low)):
        return "math", turn
    if 40 < len(turn) < 600 and accented == 0:
        return "chat", turn
    return None


def task_prompts(kind: str, max_prompts: int | None = None) -> list[dict]:
    """The held-out prompts of one kind of task (``task_of``), in ShareGPT's order, each first turn once; up to
    ``max_prompts`` (None: every one in the range read)."""
    if kind not in TASKS:
        raise ConfigError(f"prompt set 'tasks:{kind}': no such kind of task", fix=f"one of {', '.join(TASKS)}")
    cfg = DataConfig(source="sharegpt", require_assistant=False)
    conversations = usable_conversations(cfg.source, cfg, TASKS_OFFSET, Reading(cfg.source))
    prompts: list[dict] = []
    seen: set[str] = set()
    for i, conversation in enumerate(itertools.islice(conversations, TASKS_READ)):
        turn = next((m["content"] for m in conversation if m["role"] == "user"), "").strip()
        found = task_of(turn)
        if found is None or found[0] != kind or turn in seen:
            continue
        seen.add(turn)
        prompts.append({"id": f"{kind}-{TASKS_OFFSET + i}", "category": kind, "turns": [found[1]]})
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
    if not prompts:
        raise DataError(f"prompt set 'tasks:{kind}': no prompt of this kind in ShareGPT's conversations "
                        f"{TASKS_OFFSET:,}-{TASKS_OFFSET + TASKS_READ:,}")
    return prompts


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"
"""How a HumanEval problem becomes a chat turn: the function's signature and docstring follow, in a code block."""


def _humaneval_prompts() -> list[dict]:
    import gzip

    prompts = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            turn = f"{HUMANEVAL_INSTRUCTION}```python\n{rec['prompt']}```"
            prompts.append({"id": rec["task_id"], "category": "code", "turns": [turn]})
    return prompts



def load_prompts(source: str = "mtbench", max_prompts: int | None = None) -> list[dict]:
    """Evaluation prompts: ``[{"id": str, "category": str | None, "turns": [user turn, ...]}]``.

    'mtbench' gives the 80 two-turn MT-bench questions, 'humaneval' the 164 HumanEval functions to complete (a code
    set, where the answer repeats much of the prompt), 'tasks:<kind>' held-out ShareGPT prompts of one kind of task
    (``TASKS``). A .jsonl / .json file may hold ``{"prompt": str}``,
    ``{"turns": [str, ...]}`` or ShareGPT / OpenAI conversations (their user turns become the turns); 'sharegpt'
    and 'hf:' sources give the user turns of their conversations.
    """
    if max_prompts is not None and max_prompts < 0:
        raise ConfigError(f"max_prompts must be >= 0 or None, got {max_prompts}")
    prompts: list[dict] = []
    if source == "mtbench":
        for rec in iter_jsonl(mtbench_dir() / "question.jsonl", Counter(), progress=False):
            turns = list(rec["turns"])
            prompts.append({"id": str(rec["question_id"]), "category": rec.get("category"), "turns": turns})
    elif source == "humaneval":
        prompts = _humaneval_prompts()
    elif source.startswith(TASKS_PREFIX):
        prompts = task_prompts(source[len(TASKS_PREFIX):], max_prompts)
    elif source in ("sharegpt",) or source.startswith("hf:"):
        cfg = DataConfig(source=source, max_conversations=max_prompts, require_assistant=False)
        conversations, _ = load_conversations(cfg)
        for i, conv in enumerate(conversations):
            turns = [m["content"] for m in conv if m["role"] == "user"]
            prompts.append({"id": str(i), "category": None, "turns": turns})
    else:
        path = Path(source).expanduser()
        skipped: Counter = Counter()
        records, _ = source_records(source, skipped)
        for i, rec in enumerate(records):
            if max_prompts is not None and len(prompts) >= max_prompts:
                break
            turns = _prompt_turns(rec)
            if not turns:
                skipped["not a prompt"] += 1
                continue
            rid = rec.get("id", rec.get("question_id", f"{path.stem}-{i}"))
            prompts.append({"id": str(rid), "category": rec.get("category"), "turns": turns})
        if not prompts:
            raise DataError(f"{path}: no prompts ({dict(skipped)}); expected prompt, turns, conversations or messages")
        if skipped:
            log.warning("%s: skipped %s", path, dict(skipped))
    return prompts[:max_prompts] if max_prompts is not None else prompts


def _prompt_turns(record: Any) -> list[str] | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return [record["prompt"]]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return list(turns)
    messages, _, _ = normalise_record(record, require_assistant=False)
    if messages is None:
        return None
    return [m["content"] for m in messages if m["role"] == "user"]
