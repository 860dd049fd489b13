"""Reports made of JSON sections, with a format number: ``fledge tune``'s ``tune.json`` (``eval/report.py``) and
``fledge plan``'s ``plan.json`` (``plan/job.py``) are dataclasses of this kind.

A report's fields are its sections (plain JSON values); ``format`` says which layout the file has. A file without
one was written before formats were numbered (format 0) and holds format 1's sections, so it reads the same way. A
file of a later format than this fledge knows, or one without the sections a reader needs, is refused with what to
do, rather than misread. Unknown sections of an older file are dropped on reading.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from fledge.core.errors import ConfigError
from fledge.core.files import atomic_write_text

R = TypeVar("R", bound="SectionedReport")


def read_json(path: str | Path, name: str, what: str, command: str) -> tuple[Path, Any]:
    """(the file, its JSON) of a report ``name`` given as the file or the folder that holds it."""
    path = Path(path)
    file = path / name if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no {what} at {path}", fix=f"give a {command} out_dir or its {name}")
    try:
        return file, json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file} is not JSON ({err})", fix=f"rerun the {command} that wrote it") from err


class SectionedReport:
    """Base of a dataclass whose fields are JSON sections plus ``format: int`` (declared last, defaulting to
    ``FORMAT``). Subclasses set the class constants below."""

    FORMAT: ClassVar[int]
    FILE: ClassVar[str]
    """The file's name in the folder it is written to."""
    WHAT: ClassVar[str]
    """What the file is, in words (``"tune report"``)."""
    COMMAND: ClassVar[str]
    """The command that writes it (``"fledge tune"``)."""
    REQUIRED: ClassVar[frozenset[str]]
    """Sections without which a file is not this report."""

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return {"format": getattr(self, "format"), **{f.name: getattr(self, f.name) for f in fields
                                                      if f.name != "format"}}

    @classmethod
    def from_json(cls: type[R], record: Any, where: str | None = None) -> R:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        version = record.get("format", 0) if isinstance(record, dict) else None
        if not isinstance(version, int) or version > cls.FORMAT or not cls.REQUIRED <= set(record):
            raise ConfigError(f"{where or 'the ' + cls.WHAT} is not a {cls.WHAT} this fledge reads (format "
                              f"{version!r}, up to {cls.FORMAT})",
                              fix=f"read it with the fledge that wrote it, or rerun {cls.COMMAND}")
        return cls(**{k: v for k, v in record.items() if k in names and k != "format"})

    @classmethod
    def load(cls: type[R], path: str | Path) -> R:
        """From the file or the folder that holds it."""
        file, record = read_json(path, cls.FILE, cls.WHAT, cls.COMMAND)
        return cls.from_json(record, str(file))

    def save(self, folder: str | Path) -> Path:
        """Write ``FILE`` into ``folder`` (atomically); returns the file."""
        file = Path(folder) / self.FILE
        file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(file, json.dumps(self.to_json(), indent=2))
        return file
