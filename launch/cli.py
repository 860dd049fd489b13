"""The ``fledge`` command: one sub-command per stage, each a Hydra app over a typed dataclass schema.

    fledge cache data.max_conversations=200 cache.dir=runs/c1
    fledge train train.lr=1e-4
    fledge bench cache

Each stage registers its root dataclass in Hydra's ConfigStore as ``<stage>_schema``; ``conf/<stage>.yaml`` lists
that schema first in its defaults and only sets values, so a misspelt override (``train.lrr=1``) fails loudly.
The stage function receives the dataclass instance (``OmegaConf.to_object``), never a DictConfig.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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


# Sub-command -> stage. Two-word commands (``bench cache``) are keyed by their joined name.
STAGES: dict[str, Stage] = {
    "regenerate": Stage(
        "data.regenerate:RegenerateJobConfig", "data.regenerate:run", "answer the training prompts with the verifier"
    ),
    "cache": Stage("data.cache_job:CacheJobConfig", "data.cache_job:run", "cache the verifier's hidden states"),
    "bench_cache": Stage(
        "data.cache_bench:CacheBenchConfig", "data.cache_bench:run", "cache throughput against a bare forward"
    ),
    "train": Stage("train.config:TrainJobConfig", "train.loop:run", "train an EAGLE-3 draft"),
    "bench_train": Stage("train.bench:TrainBenchConfig", "train.bench:run", "training throughput and MFU"),
    "eval": Stage("launch.eval_job:EvalJobConfig", "launch.eval_job:run", "τ, n-α and speed-up through the real loop"),
    "tune": Stage(
        "launch.tune_job:TuneJobConfig", "launch.tune_job:run", "recommend N or a tree from measured α and cost, then measure it"
    ),
    "eval_exactness": Stage(
        "launch.exactness_job:ExactnessJobConfig", "launch.exactness_job:run", "speculative sampling = verifier sampling"
    ),
    "quickstart": Stage(
        "launch.quickstart:QuickstartConfig", "launch.quickstart:main", "cache -> train -> eval -> export", hydra=False
    ),
    "export": Stage("launch.export_job:ExportJobConfig", "launch.export_job:run", "write a serving checkpoint"),
    "export_check": Stage("", "launch.export_job:check_main", "validate any EAGLE-3 checkpoint", hydra=False),
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
    register_schema(name, _load(stage.config))
    # A stage may run another (the quickstart runs them all): start from a clean Hydra each time.
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name=name, overrides=overrides or [])
    return OmegaConf.to_object(cfg)


def run_stage(name: str, overrides: list[str]) -> Any:
    """Compose ``conf/<name>.yaml`` with overrides and run the stage; also what tests call (no sys.argv games)."""
    return _load(STAGES[name].run)(compose_config(name, overrides))


def _hydra_main(name: str, argv: list[str]) -> None:
    import hydra
    from omegaconf import OmegaConf

    stage = STAGES[name]
    register_schema(name, _load(stage.config))

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=name)
    def app(cfg) -> None:
        _load(stage.run)(OmegaConf.to_object(cfg))

    sys.argv = [f"fledge {name.replace('_', ' ')}", *argv]
    app()


def _usage() -> str:
    lines = ["usage: fledge <command> [key=value ...]   (Hydra overrides; --help on a command shows its config)", ""]
    for name, stage in STAGES.items():
        lines.append(f"  {name.replace('_', ' '):<18} {stage.help}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    if not stage.hydra:
        fn: Callable[[list[str]], int | None] = _load(stage.run)
        raise SystemExit(fn(rest) or 0)
    _hydra_main(name, rest)


if __name__ == "__main__":
    main()
