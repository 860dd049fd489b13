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
from fledge.eval.breakdown import breakdown_lines
from fledge.eval.report import REPORT_FILE, EvalReport
from fledge.eval.summary import report_table
from fledge.plan.budget import (
    FIXED_SHAPES,
    FIXED_SIZES,
    SHAPE_KEYS,
    SIZE_KEYS,
    BudgetPlan,
    check_budget,
    eval_time_limit,
    fit_budget,
    fit_shapes,
    plan_lines,
    plan_vs_actual,
    probe_box,
    revise_epochs,
    revise_prompts,
    step0_gain,
    train_overrides,
)

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
    budget_minutes: float | None = 20.0
    """Size the run to end within this many minutes on this box (``plan/budget.py``: it measures the box, then
    chooses the conversations to cache, the epochs and the eval prompts). A size given as a stage override is kept;
    None uses the fixed sizes (``budget.FIXED_SIZES``)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.stages if s not in STAGE_ORDER]
        if unknown:
            raise ConfigError(f"quickstart.stages: unknown {unknown}; choose from {list(STAGE_ORDER)}")
        check_budget(self.budget_minutes)
        if self.budget_minutes is not None and "regenerate" in self.stages:
            raise ConfigError("the time budget does not size regeneration",
                              fix="pass budget_minutes=null with the regenerate stage, and sizes as overrides")


def _stamp(overrides: list[str]) -> str:
    return hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:16]


def _given(cfg: QuickstartConfig, stage: str, key: str) -> float | None:
    """A value the user set for ``key`` as a stage override (the last one wins), else None."""
    values = [o.split("=", 1)[1] for o in getattr(cfg, stage) if o.split("=", 1)[0] == key]
    return float(values[-1]) if values and values[-1] not in ("null", "None") else None


def _given_vocab(cfg: QuickstartConfig) -> int | None:
    """The draft vocabulary the user fixed (the cache's, or the training's own choice from the cache's counts)."""
    value = _given(cfg, "train", "train.draft_vocab_size") or _given(cfg, *SHAPE_KEYS["draft_vocab_size"])
    return int(value) if value else None  # train.draft_vocab_size=0 is the cache's


def budget_plan(cfg: QuickstartConfig) -> BudgetPlan:
    """The run's plan: the one in ``budget.json`` when it was made for the same budget and overrides (a rerun), else
    a new one from a probe of this box."""
    from fledge.launch.cli import compose_config

    path = BudgetPlan.file_in(cfg.run_dir)
    key = _stamp([cfg.budget_minutes, *[getattr(cfg, s) for s in STAGE_ORDER]])
    if not cfg.force and path.is_file():
        plan = BudgetPlan.load(path)
        if plan.key == key:
            log.info("quickstart: reusing the plan in %s", path)
            plan.started = time.time() - sum(plan.actual_s.values())  # the clock of this invocation
            plan.save_in(Path(cfg.run_dir))  # under its current name (a folder of an older fledge has plan.json)
            return plan
    fixed = {s: v for s in SIZE_KEYS if (v := _given(cfg, s, SIZE_KEYS[s])) is not None}
    given_vocab = _given_vocab(cfg)
    vocab = given_vocab or FIXED_SHAPES["draft_vocab_size"]  # the probe's, and where the choice starts
    cache_job = compose_config("cache", [*cfg.cache, f"{SHAPE_KEYS['draft_vocab_size'][1]}={vocab}"])
    train_job, eval_job = compose_config("train", cfg.train), compose_config("eval", cfg.eval)
    probe = probe_box(cache_job, train_job, eval_job, None if "cache" not in fixed else int(fixed["cache"]))
    drafters = 1 + int(eval_job.hybrid) + int(eval_job.prompt_lookup)  # eagle3, eagle3+lookup, prompt lookup
    rows = (1 + int(eval_job.eval.hf_baseline) + drafters) * len(eval_job.prompts)  # decodings per prompt index

    def fit(box: Any) -> BudgetPlan:
        return fit_budget(cfg.budget_minutes, box, probe.lengths, rows, eval_job.eval.max_new_tokens, fixed)

    gain = step0_gain(train_job.ttt.step0_share, train_job.ttt.ttt_steps)  # the passes the vocabulary's rule counts
    plan = fit_shapes(fit(probe.rates), fit, probe.counts_for, probe.rate_at, vocab, fixed=given_vocab is not None,
                      passes_gain=gain)
    plan.started = time.time() - plan.rates.probe_seconds  # with any measurement the vocabulary's choice added
    plan.key = key
    plan.actual_s["probe"] = plan.rates.probe_seconds
    plan.save_in(Path(cfg.run_dir))
    return plan


def _sized(stage: str, overrides: list[str], size: float | None, shapes: dict[str, int]) -> list[str]:
    """The stage's overrides with its planned (or fixed) size and shapes in front, where the user set none."""
    planned = {key: shapes[shape] for shape, (where, key) in SHAPE_KEYS.items() if where == stage}
    if stage in SIZE_KEYS and size is not None:
        planned[SIZE_KEYS[stage]] = int(size) if stage != "train" else size
    given = {o.split("=", 1)[0] for o in overrides}
    return [f"{key}={value}" for key, value in planned.items() if key not in given] + overrides


def run_pipeline(cfg: QuickstartConfig) -> dict[str, Any]:
    from fledge.launch.cli import compose_config, run_stage

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = budget_plan(cfg) if cfg.budget_minutes is not None else None
    if plan is not None:
        print("\n".join(plan_lines(plan)), flush=True)
    timings: dict[str, Any] = {}
    results: dict[str, Any] = {}
    ran: set[str] = set()
    for stage in STAGE_ORDER:
        if stage not in cfg.stages:
            continue
        overrides = list(getattr(cfg, stage))
        if stage == "cache" and "regenerate" in cfg.stages:
            regen = compose_config("regenerate", cfg.regenerate)
            overrides.append(f"data.source={Path(regen.regenerate.out_dir) / 'conversations.jsonl'}")
        size = FIXED_SIZES.get(stage)
        if plan is not None and stage in SIZE_KEYS:
            if stage == "train":
                train_cfg = compose_config("train", overrides)
                if "cache" in ran:
                    cached = json.loads((Path(train_cfg.cache_dir) / "manifest.json").read_text())
                    revise_epochs(plan, int(cached["num_tokens"]), timings["cache"]["seconds"])
                # its share of the budget (or a safety net), where the user set neither
                given = {o.split("=", 1)[0] for o in overrides}
                overrides += [o for o in train_overrides(plan, train_cfg.ttt.step0_share, train_cfg.ttt.ttt_steps)
                              if o.split("=", 1)[0] not in given]
            if stage == "eval" and "train" in ran:
                revise_prompts(plan, timings["train"]["seconds"])
            size = plan.sizes[stage]
        overrides = _sized(stage, overrides, size, plan.shapes if plan is not None else FIXED_SHAPES)
        stamp = _stamp(overrides)  # what the stage's outputs depend on: a rerun with the same skips it
        if (plan is not None and stage == "eval" and not plan.fixed.get("eval")
                and not any(o.startswith("eval.time_limit_minutes=") for o in overrides)):
            # a box that slows down after the probe shortens the evaluation instead of overrunning the budget
            overrides.append(f"eval.time_limit_minutes={eval_time_limit(plan):.2f}")
        done = run_dir / f".done-{stage}.json"
        if not cfg.force and done.is_file() and json.loads(done.read_text()).get("stamp") == stamp:
            record = json.loads(done.read_text())
            log.info("quickstart: %s finished before (%.0f s); skipping", stage, record["seconds"])
            timings[stage] = {"seconds": record["seconds"], "skipped": True}
            continue
        log.info("quickstart: %s %s", stage, " ".join(overrides))
        start = time.perf_counter()
        results[stage] = run_stage(stage, overrides)
        seconds = time.perf_counter() - start
        timings[stage] = {"seconds": seconds, "skipped": False}
        ran.add(stage)
        done.write_text(json.dumps({"stamp": stamp, "seconds": seconds}))
        if plan is not None:
            plan.actual_s[stage] = seconds
            plan.save_in(run_dir)
    (run_dir / "timings.json").write_text(json.dumps(timings, indent=1))
    return {"timings": timings, "results": results, "plan": plan}


def summary(run_dir: Path, timings: dict[str, Any], plan: BudgetPlan | None = None) -> str:
    lines = ["", "fledge quickstart — summary", ""]
    if plan is not None:
        lines += [*plan_vs_actual(plan), ""]
    lines.append("stage       seconds")
    for stage, t in timings.items():
        lines.append(f"{stage:<11} {t['seconds']:7.0f}{'  (done before)' if t['skipped'] else ''}")
    report_path = run_dir / "eval" / REPORT_FILE
    if report_path.is_file():
        report = EvalReport.load(report_path).to_json()
        lines += ["", *report_table(report)]
        first = breakdown_lines(report)
        if first:
            lines += ["", *first]
    for label, path in (
        ("acceptance curves", run_dir / "eval" / "acceptance.png"),
        ("first-token failures", run_dir / "eval" / "first_token.png"),
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
    print(summary(Path(cfg.run_dir), out["timings"], out["plan"]))
    return 0
