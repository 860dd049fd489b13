"""``data.source=python-code``: code conversations from the Python standard library that every machine carries.

No code data set can be downloaded here, and the draft's other sources are English chat; yet code is where drafts
earn most (answers repeat identifiers, indentation and idioms). Each documented function or method of the standard
library (tests, demos and private helpers left out) becomes one conversation: the user asks for it by module,
name, signature and docstring, the assistant answers with its source in a code block. The functions come in a fixed
pseudo-random order (by a hash of their qualified name), so that any first N mix modules and lengths.

The text is the library's, not the verifier's own answers: as with ShareGPT, the cache scores the draft against
the verifier's distribution at every position of it, so the draft learns how the verifier reads and continues
code; ``fledge regenerate`` on these prompts gives the verifier's own answers instead.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

MIN_LINES = 4
"""Functions shorter than this (lines of source) are left out: a one-line accessor teaches little."""
MAX_LINES = 80
"""Longer ones are left out too, so that a conversation stays well within a training sequence."""
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo",
               "lib2to3", "ensurepip", "venv", "pydoc_data", "__phello__", "config-3"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not (_SKIP_PARTS & set(p.relative_to(root).parts))
                  and not any(part.startswith(("test_", "config-")) for part in p.relative_to(root).parts))


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of module-level functions and of methods of module-level classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item


def _conversation(module: str, qualname: str, node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]
                  ) -> dict | None:
    name = qualname.rsplit(".", 1)[-1]
    if name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    if not doc or node.end_lineno is None:
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    body = lines[first - 1 : node.end_lineno]
    if not MIN_LINES <= len(body) <= MAX_LINES:
        return None
    source = textwrap.dedent("".join(body)).rstrip()
    signature = f"{name}({ast.unparse(node.args)})"
    where = f"method `{signature}` of the class `{qualname.rsplit('.', 1)[0]}`" if "." in qualname else (
        f"function `{signature}`")
    summary = doc.strip().split("\n\n")[0].strip()
    prompt = f"Write the {where} in Python's `{module}` module. What it does:\n\n{summary}"
    return {"id": f"{module}:{qualname}",
            "messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": f"```python\n{source}\n```"}]}


def python_code_records(root: Path | None = None) -> Iterator[dict]:
    """The source's OpenAI-form records, in its fixed order (see the module docstring)."""
    root = Path(root or stdlib_dir())
    records: dict[str, dict] = {}
    for path in _files(root):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file this Python cannot parse (another version's syntax, an odd encoding)
        module = _module_name(path, root)
        lines = text.splitlines(keepends=True)
        for qualname, node in _functions(tree):
            record = _conversation(module, qualname, node, lines)
            if record is not None:
                records[record["id"]] = record  # a name defined twice: the later definition, as Python keeps
    yield from sorted(records.values(), key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
