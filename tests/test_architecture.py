"""The shape of the house: one installed package, imports that run one way, defaults written once, citations
that resolve (docs/design.md, "Layout")."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from fledge.core.config import fields_of
from fledge.launch.cli import CONF_DIR, STAGES
from fledge.train.loop import RESUME_INVARIANTS, CacheBinding, RunBinding, RuntimeBinding, TrainJobConfig

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "models", "decode", "data", "train", "eval", "export", "plan", "launch")
# What each layer may import (besides itself): the pipeline's order, with export reading only what models own.
ALLOWED = {
    "core": set(),
    "models": {"core"},
    "decode": {"core", "models"},
    "data": {"core", "models", "decode"},
    "train": {"core", "models", "decode", "data"},
    "eval": {"core", "models", "decode", "data"},
    "export": {"core", "models"},
    "plan": {"core", "models", "decode", "data", "train", "eval"},
    "launch": {"core", "models", "decode", "data", "train", "eval", "export", "plan"},
}


def module_imports() -> dict[str, set[str]]:
    """fledge module -> the fledge modules it imports, anywhere in its body (lazy imports count too)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).glob("*.py")):
            name = f"{package}.{path.stem}"
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fledge."):
                    target = node.module.removeprefix("fledge.")
                    # `from fledge.train import sampler` imports the module fledge.train.sampler
                    for alias in node.names:
                        sub = f"{target}.{alias.name}"
                        found.add(sub if (REPO / sub.replace(".", "/")).with_suffix(".py").is_file() else target)
                elif isinstance(node, ast.Import):
                    found.update(a.name.removeprefix("fledge.") for a in node.names if a.name.startswith("fledge."))
            graph[name] = {m for m in found if m != name}
    return graph


def test_imports_run_one_way_between_layers():
    wrong = [
        f"{module} imports {target}"
        for module, targets in module_imports().items()
        for target in targets
        if target.split(".")[0] != module.split(".")[0] and target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle a depth-first walk meets, as module paths (first module repeated at the end)."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [node])
    return cycles


def test_no_import_circle_between_modules():
    cycles = find_cycles(module_imports())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)
    # The walk does find one when there is one (the checkpoint <-> config <-> engine circle this layout removed).
    circle = {
        "train.config": {"train.checkpoint"}, "train.checkpoint": {"train.engine"}, "train.engine": {"train.config"}
    }
    assert find_cycles(circle) == [["train.checkpoint", "train.engine", "train.config", "train.checkpoint"]]


def test_the_checker_sees_a_wrong_import(tmp_path, monkeypatch):
    """The layering test itself can fail: a models module importing train is reported."""
    graph = module_imports()
    graph["models.bad"] = {"train.loop"}
    monkeypatch.setattr(sys.modules[__name__], "module_imports", lambda: graph)
    with pytest.raises(AssertionError, match="models.bad imports train.loop"):
        test_imports_run_one_way_between_layers()


def test_only_fledge_lands_at_the_top_of_site_packages(tmp_path):
    """Outside the checkout, `import data` (or any other folder name) fails; `import fledge.data` works."""
    probe = "try:\n    importlib.import_module({0!r})\n    print('found', {0!r})\nexcept ModuleNotFoundError:\n    pass"
    code = "import importlib\n" + "\n".join(probe.format(name) for name in (*PACKAGES, "conf", "tests"))
    code += "\nimport fledge.data, fledge.launch.cli\nprint('fledge', fledge.__file__)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "found" not in out.stdout, out.stdout
    assert "fledge " in out.stdout
    from importlib.metadata import distribution

    top_level = (distribution("fledge").read_text("top_level.txt") or "fledge").split()
    assert top_level == ["fledge"]


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF_DIR.glob("*.yaml")))
def test_stage_yaml_sets_only_what_differs_from_the_dataclass(name):
    raw = yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text()) or {}
    assert "hydra" not in raw, f"conf/{name}.yaml: the Hydra settings live once, in conf/shared/hydra.yaml"
    raw.pop("defaults", None)
    module, _, cls = STAGES[name].config.partition(":")
    defaults = OmegaConf.to_container(OmegaConf.structured(getattr(importlib.import_module(module), cls)))
    restated = []
    for key, value in _leaves(raw):
        node = defaults
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node == value:
            restated.append(key)
    assert not restated, f"conf/{name}.yaml restates dataclass defaults: {restated}"


def test_every_stage_uses_the_shared_hydra_block():
    for path in CONF_DIR.glob("*.yaml"):
        defaults = yaml.safe_load(path.read_text())["defaults"]
        if STAGES[path.stem].hydra:
            assert "shared/hydra" in defaults, path.name
    assert yaml.safe_load((CONF_DIR / "shared" / "hydra.yaml").read_text())["hydra"]["job"]["chdir"] is False


def test_resume_invariants_name_fields_that_exist():
    resolved = {
        **OmegaConf.to_container(OmegaConf.structured(TrainJobConfig)),
        **dataclasses.asdict(RunBinding(world_size=2, cache=CacheBinding("c", 10, 100, "abc"),
                                        runtime=RuntimeBinding("ddp", "float32", "cpu", {"torch": "2.13.0"}))),
    }
    missing = object()
    assert all(ref.get(resolved, missing) is not missing for ref in RESUME_INVARIANTS)
    assert {str(ref) for ref in RESUME_INVARIANTS} >= {"train.seed", "ttt.ttt_steps", "world_size",
                                                       "cache.verifier_fingerprint"}
    # A renamed or misspelt field fails where it is written, naming it.
    with pytest.raises(AttributeError, match="TrainConfig .* has no field 'sed'"):
        fields_of(TrainJobConfig).train.sed  # noqa: B018
    with pytest.raises(AttributeError, match="is a value"):
        fields_of(TrainJobConfig).train.seed.value  # noqa: B018


CITATION = re.compile(r"docs/[\w./-]+\.md")


def test_the_code_cites_documents_that_exist():
    """Every docs/... path a source file, config or the README names is in the repository; nothing outside docs/
    cites a design file users do not have."""
    files = [p for package in (*PACKAGES, "conf", "tests") for p in (REPO / package).rglob("*") if p.is_file()]
    files += [REPO / "README.md", REPO / "__init__.py", REPO / "pyproject.toml", REPO / "Makefile"]
    shared_design = "DESIGN" + ".md"  # the team's working notes, outside the repository
    cited: dict[str, list[str]] = {}
    for path in files:
        if path.suffix not in {".py", ".md", ".yaml", ".toml", ".sh", ".sbatch"} and path.name != "Makefile":
            continue
        text = path.read_text(errors="replace")
        assert shared_design not in text, f"{path.relative_to(REPO)} cites {shared_design}, which users do not have"
        for doc in CITATION.findall(text):
            cited.setdefault(doc.rstrip("."), []).append(str(path.relative_to(REPO)))
    assert cited, "nothing cites docs/ at all"
    missing = {doc: where for doc, where in cited.items() if not (REPO / doc).is_file()}
    assert not missing, f"cited but missing: {missing}"
