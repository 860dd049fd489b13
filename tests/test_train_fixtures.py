"""Shared builders of the training tests (imported by the other test_train_* files), and checks of them.

The training caches come from a tiny random Llama whose head is *peaked*: only the tokens of the test corpus can
be its top-1. A random 49k-vocabulary head would put almost every top-1 outside a small draft vocabulary, and the
TTT loss drops those positions, so there would be nothing to learn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from conftest import make_tiny_verifier, write_sharegpt_jsonl

REPO = Path(__file__).resolve().parent.parent


def peaked_verifier(root: Path, tokenizer, corpus: Path) -> Path:
    """A tiny random Llama (H=32, 8 layers) whose lm_head rows are zero except for the corpus's trained tokens
    (those under the assistant loss mask, from which the draft vocabulary is chosen), scaled up 200x so that its
    next-token distribution is peaked: near-ties of a flat teacher would cap the draft's top-1 agreement."""
    from transformers import AutoModelForCausalLM

    from fledge.data.template import tokenize_conversation

    out = root / "peaked-llama"
    if (out / "config.json").is_file():
        return out
    base = make_tiny_verifier(root, "llama", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    used: set[int] = set()
    for line in corpus.read_text().splitlines():
        conv = json.loads(line)["conversations"]
        messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
        tok = tokenize_conversation(tokenizer, messages, 256)
        used.update(i for i, m in zip(tok.input_ids, tok.loss_mask) if m)
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[sorted(used)] = True
    with torch.no_grad():
        head = model.lm_head.weight
        head.mul_(keep[:, None].float() * 200.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_cache(root: Path, tokenizer, conversations: int = 24, max_words: int = 30, draft_vocab: int = 64) -> Path:
    """A complete hidden-state cache of the peaked verifier (built once per directory)."""
    from fledge.launch.cli import run_stage

    cache = root / f"cache-{conversations}-{max_words}-{draft_vocab}"
    if (cache / "manifest.json").is_file():
        return cache
    root.mkdir(parents=True, exist_ok=True)
    source = write_sharegpt_jsonl(root / f"convs-{conversations}-{max_words}.jsonl", conversations, max_words=max_words)
    verifier = peaked_verifier(root, tokenizer, source)
    run_stage(
        "cache",
        [
            f"verifier.name_or_path={verifier}",
            "verifier.dtype=float32",
            f"data.source={source}",
            "data.max_conversations=null",
            "data.max_length=256",
            f"cache.dir={cache}",
            f"cache.draft_vocab_size={draft_vocab}",
            "cache.device=cpu",
        ],
    )
    return cache


def shared_root(tmp_path_factory) -> Path:
    """One directory per test session for caches, shared by every training test module."""
    return tmp_path_factory.getbasetemp() / "train-caches"


def train_overrides(cache: Path, out: Path, **extra: object) -> list[str]:
    args: dict[str, object] = {
        "cache_dir": cache,
        "output_dir": out,
        "train.max_steps": 4,
        "train.micro_batch_size": 4,
        "train.warmup_steps": 0,
        "train.dtype": "fp32",  # the numbers these tests compare are fp32's, whatever this machine runs fastest
        "ttt.ttt_steps": 3,
        "checkpoint.every": 2,
        "validation.every": 0,
        "validation.holdout": 0,
        "log.progress": "false",
        "log.wandb_mode": "disabled",
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def cli_command(args: list[str], nproc: int = 1, launcher: str = "torchrun", port: int = 29561) -> list[str]:
    """``fledge train`` as a subprocess command: plain, ``torchrun --nproc_per_node``, or the ``deepspeed`` launcher."""
    if launcher == "deepspeed":
        return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc), "--no_local_rank",
                "--master_port", str(port), "--module", "fledge.launch.cli", "train", *args]
    if nproc == 1:
        return [sys.executable, "-m", "fledge.launch.cli", "train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "fledge.launch.cli", "train", *args]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One thread per process: the same arithmetic in every run (bitwise comparisons) and no oversubscription.
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **(extra or {})}


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until ``path`` exists (the checkpoint a test signals or kills the run after), ``proc`` ends or ``timeout``
    seconds pass."""
    deadline = time.time() + timeout
    while not path.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)


def run_cli(
    args: list[str], nproc: int = 1, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True,
    launcher: str = "torchrun",
) -> subprocess.CompletedProcess:
    cmd = cli_command(args, nproc, launcher)
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def test_peaked_verifier_predicts_inside_the_draft_vocab(tmp_path_factory, smollm_tokenizer):
    from fledge.data.cache import CacheReader
    from fledge.models.verifier import load_embed_and_head
    from fledge.train.ttt import teacher_targets

    cache = build_cache(shared_root(tmp_path_factory), smollm_tokenizer)
    reader = CacheReader(cache)
    _, head = load_embed_and_head(reader.verifier_dir)
    _, t2d = reader.draft_vocab()
    sample = reader[0]
    _, in_vocab = teacher_targets(sample["final"].float()[None], head.float(), t2d, 1024)
    # Without the peaked head almost no top-1 would fall in a 64-token draft vocabulary.
    assert in_vocab.float().mean() > 0.9
