"""``report.json``, the evaluation's report, as types: what ``fledge eval`` writes and every reader of a report on disk
goes through (``fledge sweep compare``, ``fledge sweep table|budget``, the quickstart's summary); and ``tune.json``,
``fledge tune``'s (``TuneReport``, at the end).

A report holds, per prompt set, plain decoding's figures (``baseline``) and one entry per drafter. The entry's
fields below are the ones readers across fledge rely on; the rest of what the runner measured (round costs, the
tree's accounting, the greedy check's ties, ...) is kept in ``figures`` as written and written back unchanged.

Format: ``format`` says which layout a file has. 1 is the current one. A file without it was written before
formats were numbered (format 0): its keys are those of format 1, so it is read the same way. A file of a later
format than this fledge knows is refused with the upgrade to make, rather than misread; fields a reader does not
know are kept and written back as they were.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.core.files import atomic_write_text
from fledge.core.record import SectionedReport, read_json

REPORT_FORMAT = 1
REPORT_FILE = "report.json"


@dataclass
class DrafterEntry:
    """One decoding method (a drafter, or plain decoding under a drafter's name) on one prompt set."""

    method: str
    """``plain``, ``chain`` or ``tree``."""
    tau: float | None = None
    """Acceptance length: tokens committed per verifier call, pooled over the set's prompts."""
    tau_interval: list[float] | None = None
    alpha: float | None = None
    """Pooled per-token α: accepted draft tokens over the draft tokens decided on."""
    n_alpha: list[float | None] | None = None
    """n-α per depth: the share of rounds that accepted the k-th draft token given they reached it (None: never
    reached)."""
    cumulative_acceptance: list[float] | None = None
    """The share of rounds whose accepted path reached each depth."""
    speedup: float | None = None
    """Median over prompts of tokens/s against plain decoding timed beside it."""
    speedup_interval: list[float] | None = None
    tokens_per_s: float | None = None
    predicted_speedup: float | None = None
    per_prompt: list[dict[str, Any]] | None = None
    """``{id, tokens, seconds, rounds, committed, speedup, ...}`` per prompt (what ``fledge sweep compare`` pairs)."""
    vs_prompt_lookup: dict[str, Any] | None = None
    """``{throughput_ratio, interval}``: throughput over prompt lookup's on the same prompts, paired."""
    greedy_exact: int | None = None
    """Greedy only: prompts whose output equals plain decoding's token for token; the others are ties (within the
    dtype's rounding, ``eval/ties.py``) or mismatches (a bug)."""
    greedy_tie_count: int | None = None
    greedy_mismatch_count: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    """Everything else the runner measured, as written."""

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> DrafterEntry:
        if not isinstance(record, dict) or not isinstance(record.get("method"), str):
            raise ConfigError("a drafter's entry in the report names no method",
                              fix="give a report.json written by fledge eval")
        return cls(**_split(cls, record, "figures"))

    def to_json(self) -> dict[str, Any]:
        return _join(self, "figures")


@dataclass
class SetReport:
    """One prompt set: plain decoding's figures and every drafter's entry."""

    num_prompts: int = 0
    baseline: dict[str, Any] = field(default_factory=dict)
    """Plain decoding: tokens, seconds, tokens/s, the step's seconds (every cost's unit), the HF comparison."""
    drafters: dict[str, DrafterEntry] = field(default_factory=dict)
    prompts_skipped: int | None = None
    """Prompts ``eval.time_limit_minutes`` left out (after the ``num_prompts`` that ran)."""
    draft_vocab_coverage: float | None = None
    first_token: dict[str, Any] | None = None
    """Where the draft's first token fails (``eval/breakdown.py``)."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Anything else a set's report held, as written (an older report's fields)."""

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> SetReport:
        if not isinstance(record, dict) or not isinstance(record.get("drafters", {}), dict):
            raise ConfigError("a prompt set's entry in the report is not a set report",
                              fix="give a report.json written by fledge eval")
        fields = _split(cls, record, "figures")
        fields["drafters"] = {name: DrafterEntry.from_json(d) for name, d in (fields.get("drafters") or {}).items()}
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        out = _join(self, "figures")
        out["drafters"] = {name: d.to_json() for name, d in self.drafters.items()}
        return out


@dataclass
class EvalReport:
    """What one ``fledge eval`` (or the runner inside ``fledge tune`` and the quickstart) measured."""

    config: dict[str, Any] = field(default_factory=dict)
    """The evaluation's settings (``EvalConfig`` as a dict)."""
    verifier: dict[str, Any] = field(default_factory=dict)
    stop_ids: list[int] = field(default_factory=list)
    sets: dict[str, SetReport] = field(default_factory=dict)
    draft: dict[str, Any] | None = None
    """The draft evaluated: its folder and vocabulary size (and a sweep's jobs)."""
    datastore: dict[str, Any] | None = None
    batch_sweep: dict[str, Any] | None = None
    """Per prompt set and batch size, plain decoding and every drafter (an evaluation of several batch sizes)."""
    files: dict[str, str] | None = None
    """The report's own file and its plots."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Anything else the report held, as written (an older report's fields)."""
    format: int = REPORT_FORMAT

    @classmethod
    def from_json(cls, record: Any, where: str = "the report") -> EvalReport:
        if not isinstance(record, dict) or not isinstance(record.get("sets"), dict):
            raise ConfigError(f"{where} is not a fledge eval report (no 'sets')", fix="give a fledge eval report.json")
        version = record.get("format", 0)
        if not isinstance(version, int) or version > REPORT_FORMAT:
            raise ConfigError(f"{where} has report format {version!r}; this fledge reads formats up to "
                              f"{REPORT_FORMAT}", fix="read it with the fledge that wrote it, or upgrade fledge")
        fields = _split(cls, {k: v for k, v in record.items() if k != "format"}, "figures")
        fields["sets"] = {name: SetReport.from_json(s) for name, s in record["sets"].items()}
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        out = {"format": self.format, **_join(self, "figures")}
        out["sets"] = {name: s.to_json() for name, s in self.sets.items()}
        return out

    @classmethod
    def load(cls, path: str | Path) -> EvalReport:
        """From a ``report.json`` or the folder that holds it."""
        file, record = read_json(path, REPORT_FILE, "evaluation report", "fledge eval")
        return cls.from_json(record, str(file))

    def save(self, path: str | Path) -> Path:
        """Write the report (atomically) to ``path``, a file or a folder; returns the file."""
        path = Path(path)
        file = path / REPORT_FILE if path.suffix != ".json" else path
        file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(file, json.dumps(self.to_json(), indent=2))
        return file

    def drafter_rows(self) -> list[tuple[str, str, DrafterEntry]]:
        """(set, drafter, entry) for every drafter that drafts (plain decoding's rows left out), in report order."""
        return [(set_name, name, d) for set_name, s in self.sets.items() for name, d in s.drafters.items()
                if d.method != "plain"]


def _split(cls: type, record: dict[str, Any], rest: str) -> dict[str, Any]:
    """``record``'s keys that are ``cls``'s fields, and the others under the field ``rest``."""
    names = {f.name for f in dataclasses.fields(cls)} - {rest, "format"}
    fields = {k: v for k, v in record.items() if k in names}
    fields[rest] = {k: v for k, v in record.items() if k not in names}
    return fields


def _join(obj: Any, rest: str) -> dict[str, Any]:
    """``obj``'s fields as a dict (None and ``format`` left out), with the field ``rest`` merged in."""
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
           if f.name not in (rest, "format") and getattr(obj, f.name) is not None}
    out.update(getattr(obj, rest))
    return out


@dataclass
class TuneReport(SectionedReport):
    """What ``fledge tune`` measured and recommends (``tune.json``; ``eval/tune_job.py``)."""

    FORMAT = 1
    FILE = "tune.json"
    WHAT = "fledge tune report"
    COMMAND = "fledge tune"
    REQUIRED = frozenset({"candidates", "recommended"})

    config: dict[str, Any]
    dtype: str
    draft: str
    measurement: dict[str, Any]
    """The chain run at N max: n-α, τ, speed-up, the draft's cost c, the top-k acceptance, the step's seconds."""
    cost_model: dict[str, Any]
    """v(k), c, the round overhead and c_tree per shape: what every candidate's prediction is made of."""
    candidates: list[dict[str, Any]]
    recommended: dict[str, Any]
    verification: dict[str, Any] | None = None
    """The recommendation (or the best speculative shape) measured: predicted against measured."""
    format: int = FORMAT
