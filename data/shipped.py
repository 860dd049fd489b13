"""The shipped training data: ShareGPT prompts answered by the default verifier (``data.source=sharegpt-smollm2``).

EAGLE-3 trains its draft on the verifier's own answers, but regenerating them costs more than a small CPU budget has:
batched greedy decoding runs at ~70 tokens/s on 2 cores. So the answers are generated once, with the command below,
and shipped in the repository as ``data/shipped/sharegpt-smollm2.jsonl.gz`` (one OpenAI-form record per line,
the ``conversations.jsonl`` that ``fledge regenerate`` writes) beside a manifest that holds its sha256, the exact
overrides, and the box and library versions it was made on. The source reads it through
``data.sources.shipped_path``, which checks the sha256 first and names the rebuild command when it fails.

    python -m fledge.data.shipped build   # runs the regenerate command below, then packs and fingerprints the file
    python -m fledge.data.shipped check   # regenerates a slice (part 0, 16 tokens of each answer): identical?

The answers are greedy and in float32 on the CPU, so a slice regenerates to the same text on another CPU: a greedy
token changes only where two logits tie to within float32 rounding. ``check`` relies on a property of
``fledge regenerate``: with the same prompts and batch, an answer cut at 16 tokens is the first 16 tokens of the full
one (rows leave a batch only when they stop or reach their limit, so the first 16 steps see the same batches).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fledge.data import sources
from fledge.data.sources import SHIPPED_BUILD_COMMAND as BUILD_COMMAND
from fledge.data.sources import SHIPPED_DATA_FILE as DATA_FILE
from fledge.data.sources import SHIPPED_MANIFEST_FILE as MANIFEST_FILE
from fledge.data.sources import SHIPPED_SOURCE as SOURCE
from fledge.data.sources import DataError, file_sha256, shipped_path

log = logging.getLogger(__name__)

REGENERATE_OVERRIDES = [
    "data.source=sharegpt",
    "data.max_conversations=1000",
    "data.max_length=640",
    "regenerate.turns=first",
    "regenerate.batch_size=32",
    "regenerate.max_new_tokens=256",
    "verifier.dtype=float32",
    "regenerate.device=cpu",
]
"""The exact ``fledge regenerate`` overrides that made the shipped file (with the default verifier)."""

CHECK_TOKENS = 16


def regenerate_command(out_dir: str = "runs/shipped_regen") -> str:
    return " ".join(["fledge regenerate", *REGENERATE_OVERRIDES, f"regenerate.out_dir={out_dir}"])


def warn_if_other_verifier(fingerprint: str, directory: Path | None = None) -> bool:
    """Log a warning, and return True, when the shipped answers were written by another verifier than this one:
    they then train the draft on another model's text, as ShareGPT's own answers would."""
    manifest = json.loads((Path(directory or sources.SHIPPED_DIR) / MANIFEST_FILE).read_text())
    if manifest["verifier_fingerprint"] == fingerprint:
        return False
    log.warning("data.source=%s holds the answers of %s (fingerprint %s), not of this verifier (%s): the draft "
                "learns another model's text; regenerate with this verifier (fledge regenerate) for its own answers",
                SOURCE, manifest["verifier"], manifest["verifier_fingerprint"][:12], fingerprint[:12])
    return True


def read_records(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _box() -> dict[str, Any]:
    import torch
    import transformers

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_flags": sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()),
    }


def pack(regen_dir: Path, directory: Path | None = None) -> Path:
    """Compress ``<regen_dir>/conversations.jsonl`` reproducibly (no timestamp in the gzip header) into the shipped
    folder and write its manifest."""
    regen_dir, directory = Path(regen_dir), Path(directory or sources.SHIPPED_DIR)
    source = regen_dir / "conversations.jsonl"
    regen_manifest = json.loads((regen_dir / "manifest.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / DATA_FILE
    tmp = out.with_suffix(".tmp")
    with open(source, "rb") as src, open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            shutil.copyfileobj(src, gz)
    tmp.replace(out)
    manifest = {
        "source": SOURCE,
        "file": DATA_FILE,
        "sha256": file_sha256(out),
        "bytes": out.stat().st_size,
        "command": BUILD_COMMAND,
        "regenerate_command": regenerate_command(),
        "regenerate_overrides": REGENERATE_OVERRIDES,
        "conversations": regen_manifest["conversations_written"],
        "conversations_without_answer": regen_manifest["conversations_without_answer"],
        "finish": regen_manifest["finish"],
        "verifier": regen_manifest["verifier"],
        "verifier_fingerprint": regen_manifest["verifier_fingerprint"],
        "regenerate_seconds": regen_manifest["seconds_this_run"],
        "made_with": _box(),
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    log.info("packed %d conversations into %s (%.1f MB)", manifest["conversations"], out, manifest["bytes"] / 1e6)
    return out


def _regenerate(overrides: list[str]) -> Path:
    """``fledge regenerate <overrides>``: conf/regenerate.yaml holds no value of its own (every value is a
    ``RegenerateJobConfig`` default), so the overrides on the dataclass are the command's config."""
    from omegaconf import OmegaConf

    from fledge.data.regenerate import RegenerateJobConfig, run

    cfg = OmegaConf.merge(OmegaConf.structured(RegenerateJobConfig), OmegaConf.from_dotlist(overrides))
    return run(OmegaConf.to_object(cfg))


def build(out_dir: str = "runs/shipped_regen", directory: Path | None = None) -> Path:
    _regenerate([*REGENERATE_OVERRIDES, f"regenerate.out_dir={out_dir}"])
    return pack(Path(out_dir), directory)


def _answer(record: dict[str, Any]) -> str:
    return next(m["content"] for m in record["messages"] if m["role"] == "assistant")


def compare_slice(slice_records: list[dict[str, Any]], shipped: dict[int, dict[str, Any]]) -> list[str]:
    """Differences between a slice regenerated with few tokens and the shipped answers: an answer that stopped
    within the slice must equal the shipped one, a cut one must be its beginning (a character cut in the middle of
    its bytes decodes to U+FFFD and is left out)."""
    problems = []
    for rec in slice_records:
        full = shipped.get(rec["id"])
        if full is None:
            problems.append(f"conversation {rec['id']}: answered in the slice, absent from the shipped file")
            continue
        short, answer = _answer(rec), _answer(full)
        if rec["finish"] == ["stop"]:
            ok = short == answer and full["finish"] == ["stop"]
        else:
            ok = answer.startswith(short.rstrip("\ufffd").rstrip())
        if not ok:
            problems.append(f"conversation {rec['id']}: regenerated {short[:80]!r}, shipped {answer[:80]!r}")
    return problems


def check(parts: list[int] | None = None, tokens: int = CHECK_TOKENS, out_dir: str | None = None,
          directory: Path | None = None) -> tuple[int, list[str]]:
    """Regenerate ``parts`` of the shipped command's plan, cut at ``tokens`` per answer, and compare them with the
    shipped file. Returns the number of conversations compared and the differences."""
    shipped = {r["id"]: r for r in read_records(shipped_path(directory))}
    with tempfile.TemporaryDirectory(prefix="fledge-shipped-check-") as tmp:
        target = out_dir or str(Path(tmp) / "slice")
        overrides = [*REGENERATE_OVERRIDES, f"regenerate.max_new_tokens={tokens}",
                     f"regenerate.parts=[{','.join(str(p) for p in (parts or [0]))}]", f"regenerate.out_dir={target}",
                     "regenerate.overwrite=true"]
        out = _regenerate(overrides)
        with open(out) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    return len(rows), compare_slice(rows, shipped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fledge.data.shipped", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="regenerate the answers with the default verifier and pack them")
    b.add_argument("--out-dir", default="runs/shipped_regen", help="the regenerate folder (resumable)")
    c = sub.add_parser("check", help="regenerate a slice and compare it with the shipped file")
    c.add_argument("--parts", type=int, nargs="+", default=[0])
    c.add_argument("--tokens", type=int, default=CHECK_TOKENS)
    sub.add_parser("info", help="print the shipped file's manifest after checking its sha256")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "build":
            start = time.perf_counter()
            out = build(args.out_dir)
            print(f"built {out} in {time.perf_counter() - start:.0f} s")
        elif args.cmd == "check":
            n, problems = check(args.parts, args.tokens)
            for p in problems:
                print(p)
            print(f"shipped_check {n} conversations, {len(problems)} differ")
            return 1 if problems else 0
        else:
            shipped_path()
            print((sources.SHIPPED_DIR / MANIFEST_FILE).read_text())
    except DataError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
