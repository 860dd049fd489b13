"""``fledge quickstart``: [regenerate ->] cache -> train -> eval -> export on the embedded default verifier, on a CPU.

Each stage is the ordinary stage command run with the overrides listed in ``conf/quickstart.yaml``; a stage that
finished with the same overrides is skipped on a rerun (a stage that was interrupted resumes on its own: regeneration
keeps its complete parts, the cache its complete shards, and training restarts from its last checkpoint). With
``regenerate`` among the stages, the cache reads the verifier's answers instead of the source's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.eval.runner import report_table

log = logging.getLogger(__name__)

STAGE_ORDER = ("regenerate", "cache", "train", "eval", "export")


@dataclass
class QuickstartConfig:
    run_dir: str = "runs/quickstart"
    """Everything the quickstart writes goes under this folder."""
    stages: list[str] = field(default_factory=lambda: ["cache", "train", "eval", "export"])
    """Which stages to run, in pipeline order. ``regenerate`` in front trains on the verifier's own answers to the
    same prompts (the cache then reads them instead of ShareGPT's); it costs ~11 min more on a 2-core CPU."""
    regenerate: list[str] = field(default_factory=list)
    """Overrides for ``fledge regenerate``; its output becomes the cache's ``data.source``."""
    cache: list[str] = field(default_factory=list)
    """Overrides for ``fledge cache``."""
    train: list[str] = field(default_factory=list)
    """Overrides for ``fledge train``."""
    eval: list[str] = field(default_factory=list)
    """Overrides for ``fledge eval``."""
    export: list[str] = field(default_factory=list)
    """Overrides for ``fledge export``."""
    force: bool = False
    """Rerun stages even when they finished before with the same overrides."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGE_ORDER]
        if unknown:
            raise ConfigError(f"quickstart.stages: unknown {unknown}; choose from {list(STAGE_ORDER)}")


def _stamp(overrides: list[str]) -> str:
    return hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:16]


def run_pipeline(cfg: QuickstartConfig) -> dict[str, Any]:
    from fledge.launch.cli import compose_config, run_stage

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for stage in STAGE_ORDER:
        if stage not in cfg.stages:
            continue
        overrides = list(getattr(cfg, stage))
        if stage == "cache" and "regenerate" in cfg.stages:
            regen = compose_config("regenerate", cfg.regenerate)
            overrides.append(f"data.source={Path(regen.regenerate.out_dir) / 'conversations.jsonl'}")
        done = run_dir / f".done-{stage}.json"
        if not cfg.force and done.is_file() and json.loads(done.read_text()).get("stamp") == _stamp(overrides):
            record = json.loads(done.read_text())
            log.info("quickstart: %s finished before (%.0f s); skipping", stage, record["seconds"])
            timings[stage] = {"seconds": record["seconds"], "skipped": True}
            continue
        log.info("quickstart: %s %s", stage, " ".join(overrides))
        start = time.perf_counter()
        results[stage] = run_stage(stage, overrides)
        seconds = time.perf_counter() - start
        timings[stage] = {"seconds": seconds, "skipped": False}
        done.write_text(json.dumps({"stamp": _stamp(overrides), "seconds": seconds}))
    (run_dir / "timings.json").write_text(json.dumps(timings, indent=1))
    return {"timings": timings, "results": results}


def summary(run_dir: Path, timings: dict[str, Any]) -> str:
    lines = ["", "fledge quickstart — summary", ""]
    lines.append("stage       seconds")
    for stage, t in timings.items():
        lines.append(f"{stage:<11} {t['seconds']:7.0f}{'  (done before)' if t['skipped'] else ''}")
    report_path = run_dir / "eval" / "report.json"
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        lines += ["", *report_table(report)]
    for label, path in (
        ("acceptance curves", run_dir / "eval" / "acceptance.png"),
        ("wandb offline run", run_dir / "train" / "wandb"),
        ("exported checkpoint", run_dir / "export"),
    ):
        if path.exists():
            lines.append(f"{label + ':':<22}{path}")
    return "\n".join(lines)


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``stage:key=value`` goes to that stage (after the YAML's overrides); the rest configures the quickstart."""
    own: list[str] = []
    extra: dict[str, list[str]] = {s: [] for s in STAGE_ORDER}
    for arg in argv:
        stage, sep, rest = arg.partition(":")
        if sep and stage in extra and "=" in rest:
            extra[stage].append(rest)
        else:
            own.append(arg)
    return own, extra


def main(argv: list[str]) -> int:
    """``fledge quickstart [run_dir=...] [cache:data.max_conversations=200] [train:train.epochs=3] ...``"""
    from fledge.launch.cli import compose_config

    own, extra = split_argv(argv)
    cfg: QuickstartConfig = compose_config("quickstart", own)
    for stage, overrides in extra.items():
        getattr(cfg, stage).extend(overrides)
    out = run_pipeline(cfg)
    print(summary(Path(cfg.run_dir), out["timings"]))
    return 0
