"""``fledge bench regenerate``: regeneration's tokens/s with each engine (hf, vllm) on the same prompts.

Each engine regenerates the same slice (same prompts, template, stop tokens, limits and seeds) into a folder of its
own, one after the other; the figure is new tokens per second of decoding (an engine's start and the verifier's load
are reported apart). The answers are compared conversation by conversation: in float32 greedy they are equal, in
bf16 an answer may leave the other at a near-tie of the verifier's logits. Stable lines, as measured in float32 on
a 2-core AMD EPYC with avx512_bf16 (2026-12-04)::

    regenerate_tokens_per_s hf 21.2
    regenerate_tokens_per_s vllm 89.5
    regenerate_vllm_over_hf 4.22
    regenerate_answers_equal 58/58
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from fledge.core.errors import ConfigError
from fledge.data.regenerate import RegenerateJobConfig, RegenerateOptions
from fledge.data.regenerate import run as regenerate
from fledge.data.sources import DataConfig
from fledge.models.verifier import VerifierConfig

log = logging.getLogger(__name__)


@dataclass
class RegenerateBenchConfig:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(max_conversations=64, require_assistant=False))
    regenerate: RegenerateOptions = field(
        default_factory=lambda: RegenerateOptions(batch_size=32, max_new_tokens=128, turns="first")
    )
    """The slice every engine answers (``engine`` and ``out_dir`` are the bench's to set)."""
    engines: list[str] = field(default_factory=lambda: ["hf", "vllm"])
    keep_dir: str | None = None
    """Keep each engine's folder here (``<keep_dir>/<engine>``) instead of a temporary directory."""
    report: str | None = None
    """Also write the figures as JSON to this path."""

    def __post_init__(self) -> None:
        bad = [e for e in self.engines if e not in ("hf", "vllm")]
        if not self.engines or bad or len(set(self.engines)) != len(self.engines):
            raise ConfigError(f"engines must be distinct names among hf, vllm, got {self.engines}")


def _answers(path: Path) -> dict[int, list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows}


def run(cfg: RegenerateBenchConfig) -> dict:
    root = Path(cfg.keep_dir) if cfg.keep_dir else Path(tempfile.mkdtemp(prefix="fledge-bench-regen-"))
    figures: dict = {"verifier": cfg.verifier.name_or_path, "dtype": cfg.verifier.dtype, "engines": {}}
    answers = {}
    try:
        for engine in cfg.engines:
            out = root / engine
            shutil.rmtree(out, ignore_errors=True)
            job = RegenerateJobConfig(verifier=cfg.verifier, data=cfg.data,
                                      regenerate=replace(cfg.regenerate, engine=engine, out_dir=str(out)))
            start = time.perf_counter()
            answers[engine] = _answers(regenerate(job))
            wall = time.perf_counter() - start
            manifest = json.loads((out / "manifest.json").read_text())
            tokens, seconds = manifest["new_tokens_this_run"], manifest["seconds_this_run"]
            figures["engines"][engine] = {
                "new_tokens": tokens, "decode_seconds": seconds, "wall_seconds": round(wall, 1),
                "tokens_per_s": tokens / max(seconds, 1e-9), **manifest.get("engine_this_run", {}),
            }
            log.info("%s: %d new tokens in %.1f s of decoding (%.1f s in all)", engine, tokens, seconds, wall)
    finally:
        if not cfg.keep_dir:
            shutil.rmtree(root, ignore_errors=True)
    lines = [f"\nfledge bench regenerate — {cfg.verifier.name_or_path} (dtype {cfg.verifier.dtype}), "
             f"{len(next(iter(answers.values())))} conversations, up to {cfg.regenerate.max_new_tokens} new tokens, "
             f"batches of {cfg.regenerate.batch_size}"]
    for engine, f in figures["engines"].items():
        lines.append(f"regenerate_tokens_per_s {engine} {f['tokens_per_s']:.1f}   ({f['new_tokens']} tokens, "
                     f"{f['decode_seconds']:.1f} s decoding, {f['wall_seconds']:.1f} s in all)")
    if {"hf", "vllm"} <= set(answers):
        speed = {e: f["tokens_per_s"] for e, f in figures["engines"].items()}
        figures["vllm_over_hf"] = speed["vllm"] / speed["hf"]
        same = sum(answers["hf"][i] == answers["vllm"].get(i) for i in answers["hf"])
        figures["answers_equal"] = [same, len(answers["hf"])]
        lines += [f"regenerate_vllm_over_hf {figures['vllm_over_hf']:.2f}",
                  f"regenerate_answers_equal {same}/{len(answers['hf'])}"]
    print("\n".join(lines))
    if cfg.report:
        Path(cfg.report).write_text(json.dumps(figures, indent=1))
    return figures
