"""References to config fields that a rename cannot silently skip.

Settings that must not change across a resume, or that a cache is bound to, are named in code. As dotted strings
("train.seed") they would go on matching nothing after a field is renamed, and the check would pass vacuously.
``fields_of(TrainJobConfig).train.seed`` is checked against the dataclasses when the module that writes it is
imported: a missing field raises ``AttributeError`` there, naming it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class FieldRef:
    """A path of field names through nested config dataclasses; ``str(ref)`` is the dotted path."""

    __slots__ = ("_cls", "_path")

    def __init__(self, cls: type | None, path: tuple[str, ...] = ()) -> None:
        self._cls = cls
        self._path = path

    def __getattr__(self, name: str) -> FieldRef:
        if name.startswith("_"):
            raise AttributeError(name)
        where = ".".join(self._path) or "the root"
        if self._cls is None or not dataclasses.is_dataclass(self._cls):
            raise AttributeError(f"{where} is a value, not a config dataclass: it has no field {name!r}")
        fields = {f.name for f in dataclasses.fields(self._cls)}
        if name not in fields:
            raise AttributeError(f"{self._cls.__name__} (at {where}) has no field {name!r}; it has {sorted(fields)}")
        return FieldRef(_dataclass_of(typing.get_type_hints(self._cls)[name]), (*self._path, name))

    def __str__(self) -> str:
        return ".".join(self._path)

    def __repr__(self) -> str:
        return f"FieldRef({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FieldRef) and other._path == self._path

    def __hash__(self) -> int:
        return hash(self._path)

    def get(self, tree: dict[str, Any], default: Any = None) -> Any:
        """This field's value in a plain nested dict (a saved config), or ``default`` when the path is absent."""
        for part in self._path:
            if not isinstance(tree, dict) or part not in tree:
                return default
            tree = tree[part]
        return tree


def fields_of(cls: type) -> FieldRef:
    """The root of field references into the config dataclass ``cls``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    return FieldRef(cls)


def _dataclass_of(annotation: Any) -> type | None:
    """The dataclass an annotation names (``X``, ``X | None``, ``Optional[X]``), or None for a plain value."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(annotation) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None
