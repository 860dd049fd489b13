"""``fledge export`` (a training run -> a serving checkpoint) and ``fledge export check PATH`` (validate any EAGLE-3
checkpoint against what vLLM, SGLang and the official EAGLE code read).

    fledge export draft=runs/train out_dir=runs/train/serving report=runs/eval/report.json speculators=true
    fledge export check runs/train/serving --verifier smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fledge.core.errors import ConfigError
from fledge.export.check import check_checkpoint
from fledge.export.write import export_draft, speculators_dir, tau_from_report
from fledge.models.draft_folder import CHECKPOINTS, FINAL_DRAFT, STEP_DIR, draft_folder, load_draft, read_meta
from fledge.models.verifier import VerifierConfig, VerifierNotFound, resolve_verifier_dir

log = logging.getLogger(__name__)


@dataclass
class ExportJobConfig:
    draft: str = "runs/train"
    """The draft, ``draft=`` as in ``fledge eval`` and ``fledge tune``: a training run dir (its final ``draft/``,
    else its latest checkpoint), its ``checkpoints/`` dir, a ``step-NNNNNN`` folder or a ``draft/`` folder."""
    checkpoint: str | None = None
    """The key's old name; set, it is refused with the new one."""
    out_dir: str | None = None
    """Where the serving checkpoint goes. None: ``<run>/serving`` for a run's ``draft/``, ``<run>/serving-step-NNNNNN``
    for a step folder."""
    dtype: str = "bfloat16"
    """Dtype of the exported weights (bfloat16, float16, float32); d2t stays int64 and t2d bool."""
    speculators: bool = False
    """Also write ``<out_dir>-speculators`` in the vllm-project/speculators format."""
    verifier: str | None = None
    """The verifier (HF directory, ``.gguf`` or embedded name); None uses the one recorded at training time.
    A verifier whose weights differ from the training one is refused."""
    tau: float | None = None
    """Measured acceptance length for the model card (when there is no report)."""
    report: str | None = None
    """An eval report (JSON); every value under a key ``tau`` goes into the model card, labelled by where it sits."""
    training_data: str | None = None
    """Model-card text for the training data; None describes the hidden-state cache the draft was trained on."""
    num_speculative_tokens: int = 3
    """Chain length written into the speculators config (vLLM's default ``num_speculative_tokens`` for it)."""
    ship_embedding: bool = False
    """Also ship the verifier's embedding (and ``target_hidden_size``) in the LlamaForCausalLMEagle3 folder. Off:
    vLLM, SGLang and the official EAGLE code all read the verifier's own, and the folder stays small (the embedding
    is vocabulary x hidden: 1 GB at 8B in bf16). On: the same result, for readers that want the file whole."""

    def __post_init__(self) -> None:
        if self.checkpoint is not None:
            raise ConfigError("export's checkpoint= is now draft=, as in fledge eval and fledge tune",
                              fix=f"pass draft={self.checkpoint}")
        if self.tau is not None and self.report is not None:
            raise ConfigError("export.tau and export.report both set the card's τ; give one of them")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


def default_out_dir(draft_dir: Path) -> Path:
    """Beside the run, never inside a step folder (which ``keep_last`` pruning deletes)."""
    if draft_dir.name == FINAL_DRAFT:
        return draft_dir.parent / "serving"
    if STEP_DIR.match(draft_dir.name):
        run_dir = draft_dir.parent.parent if draft_dir.parent.name == CHECKPOINTS else draft_dir.parent
        return run_dir / f"serving-{draft_dir.name}"
    return draft_dir.with_name(draft_dir.name + "-serving")


def _verifier_dir(cfg: ExportJobConfig, meta: dict) -> Path:
    if cfg.verifier:
        return resolve_verifier_dir(VerifierConfig(name_or_path=cfg.verifier))
    recorded = meta.get("verifier") or {}
    path = recorded.get("path")
    if path and (Path(path) / "config.json").is_file():
        return Path(path)
    if recorded.get("name"):
        # The converted GGUF directory of an embedded verifier may live under another home on this machine.
        return resolve_verifier_dir(VerifierConfig(name_or_path=recorded["name"]))
    raise VerifierNotFound(f"the checkpoint records no usable verifier ({recorded})", fix="pass verifier=<dir>")


def describe_training_data(meta: dict) -> str | None:
    """One line about the cache the draft was trained on, from its manifest (None when it is gone)."""
    cache = meta.get("cache")
    if not cache:
        return None
    manifest_path = Path(cache) / "manifest.json"
    if not manifest_path.is_file():
        return f"hidden-state cache {cache}"
    m = json.loads(manifest_path.read_text())
    source = (m.get("source") or {}).get("config") or {}
    parts = [str(source.get("source", "unknown source"))]
    if m.get("num_conversations") is not None:
        parts.append(f"{m['num_conversations']} conversations")
    if m.get("num_tokens") is not None:
        parts.append(f"{m['num_tokens']} tokens ({m.get('num_loss_tokens', '?')} trained)")
    if m.get("max_length") is not None:
        parts.append(f"max length {m['max_length']}")
    return ", ".join(parts)


def build_card(cfg: ExportJobConfig, meta: dict) -> dict[str, Any]:
    # The card names the verifier as the engines serve it (its Hub id), from the verifier folder itself.
    card: dict[str, Any] = {"num_speculative_tokens": cfg.num_speculative_tokens}
    card["training_data"] = cfg.training_data or describe_training_data(meta)
    if cfg.report:
        taus = tau_from_report(json.loads(Path(cfg.report).read_text()))
        if not taus:
            raise ConfigError(f"report {cfg.report} holds no value under a key 'tau'", fix="give export.tau instead")
        card["tau"] = taus
        card["tau_source"] = str(cfg.report)
    elif cfg.tau is not None:
        card["tau"] = cfg.tau
    for key in ("step", "ttt_steps"):
        if meta.get(key) is not None:
            card[f"training {key.replace('_', ' ')}"] = meta[key]
    return card


def run(cfg: ExportJobConfig) -> Path:
    folder = draft_folder(cfg.draft)
    meta = read_meta(folder)
    verifier_dir = _verifier_dir(cfg, meta)
    draft = load_draft(folder, verifier_dir=verifier_dir)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(folder)
    export_draft(
        draft,
        verifier_dir,
        out_dir,
        dtype=cfg.dtype,
        card=build_card(cfg, meta),
        speculators=cfg.speculators,
        ship_embedding=cfg.ship_embedding,
    )
    written = [out_dir, speculators_dir(out_dir)] if cfg.speculators else [out_dir]
    for path in written:
        # export_draft refuses a result with errors; what is left to show are warnings.
        findings = check_checkpoint(path, verifier_dir)
        print(f"wrote {path} from {folder} ({cfg.dtype}); check: {len(findings)} warning(s)")
        for f in findings:
            print(f"  {f}")
    return out_dir


def check_main(argv: list[str]) -> int:
    """``fledge export check PATH [--verifier DIR]``: print every finding with its fix; 1 when any is an error."""
    parser = argparse.ArgumentParser(
        prog="fledge export check",
        description="Validate an EAGLE-3 checkpoint against what vLLM and SGLang load.",
    )
    parser.add_argument("path", type=Path, help="the checkpoint folder (config.json + weights)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="the verifier (HF directory, .gguf or embedded name): enables the embedding, depth and size checks",
    )
    args = parser.parse_args(argv)
    verifier_dir = resolve_verifier_dir(VerifierConfig(name_or_path=args.verifier)) if args.verifier else None
    findings = check_checkpoint(args.path, verifier_dir)
    for f in findings:
        print(f)
    errors = sum(f.level == "error" for f in findings)
    warnings = len(findings) - errors
    if errors:
        print(f"{args.path}: {errors} error(s), {warnings} warning(s): vLLM or SGLang would not serve it as trained")
        return 1
    scope = "" if verifier_dir is not None else " (pass --verifier for the embedding and depth checks)"
    print(f"{args.path}: OK, {warnings} warning(s){scope}")
    return 0
