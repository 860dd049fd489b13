"""The ``fledge`` command: one sub-command per stage, each a Hydra app over a typed dataclass schema.

    fledge cache data.max_conversations=200 cache.dir=runs/c1
    fledge train train.lr=1e-4
    fledge bench cache

Each stage registers its root dataclass in Hydra's ConfigStore as ``<stage>_schema``; ``conf/<stage>.yaml`` lists
that schema first in its defaults and only sets values, so a misspelt override (``train.lrr=1``) fails loudly.
The stage function receives the dataclass instance (``OmegaConf.to_object``), never a DictConfig.

A known user error (``core.errors.FledgeError``: bad data, a cache or checkpoint that does not match, a config
error) prints one line, ``fledge <stage>: error: <reason> (fix: <what to do>)``, and exits with status 2.
``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows the full traceback instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# Large CPU tensors on transparent huge pages (torch's own switch, read at its first large allocation; set before
# anything allocates). A training step allocates and frees hundreds of tensors of megabytes; on 4 KiB pages each one
# is faulted in again page by page: 3.6 M page faults in five steps of `fledge bench train` here, 0.37 M with it, and
# 1.15-1.35x faster steps (docs/experiments/2026-12-05-training-peak.md). THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from fledge.core.errors import ConfigError, FledgeError  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass(frozen=True)
class Stage:
    config: str
    """``module:Class`` of the root dataclass (its YAML is ``conf/<name>.yaml``)."""
    run: str
    """``module:function`` called with the config instance."""
    help: str
    hydra: bool = True
    """False for plain commands that parse their own arguments (``fledge export check PATH``)."""
    out_keys: tuple[str, ...] = ()
    """Config keys of the folders the stage writes. In a sweep (``-m``) each job writes them in its own job folder,
    ``runs/sweeps/<stage>/<time>/<job number>/``, unless the job's overrides set them."""
    renamed: tuple[tuple[str, str], ...] = ()
    """(old, new) keys the stage has renamed; a key ending in ``.`` is a section. An override of an old key is
    refused with the new one (as a misspelt key would be refused, but saying which)."""


# Sub-command -> stage. Two-word commands (``bench cache``) are keyed by their joined name. Each stage's job lives in
# the package of its layer; this table is the only place that knows them all.
STAGES: dict[str, Stage] = {
    "regenerate": Stage(
        "fledge.data.regenerate:RegenerateJobConfig", "fledge.data.regenerate:run",
        "answer the training prompts with the verifier", out_keys=("regenerate.out_dir",),
    ),
    "bench_regenerate": Stage(
        "fledge.data.regenerate_bench:RegenerateBenchConfig", "fledge.data.regenerate_bench:run",
        "regeneration tokens/s with each engine (hf, vllm) on the same prompts",
    ),
    "cache": Stage(
        "fledge.data.cache_job:CacheJobConfig", "fledge.data.cache_job:run", "cache the verifier's hidden states",
        out_keys=("cache.dir",),
    ),
    "bench_cache": Stage(
        "fledge.data.cache_bench:CacheBenchConfig", "fledge.data.cache_bench:run",
        "cache throughput against a bare forward",
    ),
    "train": Stage(
        "fledge.train.loop:TrainJobConfig", "fledge.train.loop:run", "train an EAGLE-3 draft", out_keys=("output_dir",),
        renamed=(("eval.", "validation."),),  # before 2026-12-05: `eval.` meant fledge eval's settings elsewhere
    ),
    "bench_train": Stage(
        "fledge.train.bench:TrainBenchConfig", "fledge.train.bench:run", "training throughput and MFU"
    ),
    "plan": Stage(
        "fledge.plan.job:PlanJobConfig", "fledge.plan.job:run",
        "disk, memory per GPU, FLOPs and hours of a job, from shapes alone", out_keys=("out_dir",),
        renamed=(("eval.", "validation."),),
    ),
    "bench_plan": Stage(
        "fledge.plan.bench:PlanBenchConfig", "fledge.plan.bench:run",
        "the plan's memory prediction against a measured CPU training step",
    ),
    "eval": Stage(
        "fledge.eval.eval_job:EvalJobConfig", "fledge.eval.eval_job:run", "τ, n-α and speed-up through the real loop",
        out_keys=("eval.out_dir",),
    ),
    "tune": Stage(
        "fledge.eval.tune_job:TuneJobConfig", "fledge.eval.tune_job:run",
        "recommend N or a tree from measured α and cost, then measure it", out_keys=("out_dir",),
        renamed=(("lookup_tokens", "num_draft_tokens"),),  # fledge eval's name (eval.num_draft_tokens)
    ),
    "eval_exactness": Stage(
        "fledge.eval.exactness_job:ExactnessJobConfig", "fledge.eval.exactness_job:run",
        "speculative sampling = verifier sampling",
    ),
    "quickstart": Stage(
        "fledge.launch.quickstart:QuickstartConfig", "fledge.launch.quickstart:main",
        "cache -> train -> eval -> export", hydra=False,
    ),
    "export": Stage(
        "fledge.export.job:ExportJobConfig", "fledge.export.job:run", "write a serving checkpoint",
        out_keys=("out_dir",),
    ),
    "sweep_table": Stage(
        "", "fledge.launch.sweep:table_main", "one table (and a PNG) from a sweep's folder", hydra=False
    ),
    "sweep_budget": Stage(
        "", "fledge.launch.sweep:budget_main", "what a larger budget buys: a table and τ against training minutes",
        hydra=False,
    ),
    "sweep_compare": Stage(
        "", "fledge.eval.compare:compare_main", "two evaluations of the same prompts, compared prompt by prompt",
        hydra=False,
    ),
    "export_check": Stage("", "fledge.export.job:check_main", "validate any EAGLE-3 checkpoint", hydra=False),
}


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register_schema(name: str, config_cls: type) -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=f"{name}_schema", node=config_cls)


def compose_config(name: str, overrides: list[str] | None = None) -> Any:
    """The typed config of a stage after overrides, without running it (tests compose every shipped config)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    stage = STAGES[name]
    refuse_renamed(name, overrides or [])
    register_schema(name, _load(stage.config))
    # A stage may run another (the quickstart runs them all): start from a clean Hydra each time.
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name=name, overrides=overrides or [])
    return OmegaConf.to_object(cfg)


def refuse_renamed(name: str, overrides: list[str]) -> None:
    """A ``ConfigError`` naming the new key for an override of a key the stage has renamed."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        for old, new in STAGES[name].renamed:
            if key == old.rstrip(".") or (old.endswith(".") and key.startswith(old)):
                now = new + key[len(old):] if old.endswith(".") else new
                raise ConfigError(f"{command_name(name)}'s {key} is now {now}",
                                  fix=f"pass {now}={override.split('=', 1)[1] if '=' in override else '...'}")


def run_stage(name: str, overrides: list[str]) -> Any:
    """Compose ``conf/<name>.yaml`` with overrides and run the stage; also what tests call (no sys.argv games)."""
    return _load(STAGES[name].run)(compose_config(name, overrides))


def command_name(name: str) -> str:
    return f"fledge {name.replace('_', ' ')}"


def config_error_line(error: BaseException) -> str | None:
    """One line for an error Hydra or OmegaConf raise while composing a config (a misspelt key, a value of the
    wrong type, an unknown preset); None for anything else."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(error, (HydraException, OmegaConfBaseException)):
        return None
    text = str(error).split("Config search path:")[0]  # an unknown option lists the choices, then the paths
    # Hydra adds "To append to your config use +key=value": a misspelt key is the likelier cause.
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("To append")]
    cause = error.__cause__
    if cause is not None:
        lines += [ln.strip() for ln in str(cause).splitlines()[:1] if ln.strip()]
    return "; ".join(ln.rstrip(".;:") for ln in lines).replace("options in 'preset'; ", "options in 'preset': ")


def fail(name: str, reason: str) -> None:
    """Print the one-line error of a stage and exit with status 2."""
    print(f"{command_name(name)}: error: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _debugging() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _overrides_to_check(argv: list[str]) -> list[str] | None:
    """The plain ``key=value`` overrides of a single run, to compose before Hydra does; None when Hydra's own
    flags (``--cfg``, ``--help``, ``-m``, ...) ask for something else than a run."""
    if any(a.startswith("-") for a in argv):
        return None
    return [a for a in argv if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]


def _hydra_main(name: str, argv: list[str]) -> None:
    import hydra
    from omegaconf import OmegaConf

    stage = STAGES[name]
    overrides = _overrides_to_check(argv)
    if overrides is not None and not _debugging():
        # Compose once ourselves: Hydra would report a bad override with a stack summary and exit status 1.
        try:
            compose_config(name, overrides)
        except FledgeError as e:
            fail(name, e.one_line())
        except Exception as e:
            line = config_error_line(e)
            if line is None:
                raise
            fail(name, f"{line} (fix: check the key and its value; `{command_name(name)} --cfg job` prints them all)")
    register_schema(name, _load(stage.config))

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=name)
    def app(cfg) -> None:
        from fledge.launch.sweep import sweep_job

        try:
            with sweep_job(name, cfg, stage.out_keys):
                _load(stage.run)(OmegaConf.to_object(cfg))
        except FledgeError as e:
            if _debugging():
                raise
            fail(name, e.one_line())

    sys.argv = [command_name(name), *argv]
    app()


def _usage() -> str:
    lines = [
        "usage: fledge [--debug] <command> [key=value ...]   (Hydra overrides; --help on a command shows its config)",
        "",
    ]
    for name, stage in STAGES.items():
        lines.append(f"  {name.replace('_', ' '):<18} {stage.help}")
    lines += ["", "A known error prints one line and exits 2; --debug (or HYDRA_FULL_ERROR=1) shows the traceback."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ["HYDRA_FULL_ERROR"] = "1"
    logging.basicConfig(level=os.environ.get("FLEDGE_LOG", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return
    name, rest = argv[0], argv[1:]
    if rest and f"{name}_{rest[0]}" in STAGES:
        name, rest = f"{name}_{rest[0]}", rest[1:]
    if name not in STAGES:
        print(f"fledge: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        raise SystemExit(2)
    stage = STAGES[name]
    if stage.hydra:
        _hydra_main(name, rest)
        return
    fn: Callable[[list[str]], int | None] = _load(stage.run)
    try:
        code = fn(rest)
    except FledgeError as e:
        if _debugging():
            raise
        fail(name, e.one_line())
    except Exception as e:
        line = None if _debugging() else config_error_line(e)
        if line is None:
            raise
        fail(name, line)
    raise SystemExit(code or 0)


if __name__ == "__main__":
    main()
