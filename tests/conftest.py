"""Shared fixtures: tiny random verifiers (with the default verifier's real tokenizer) and small conversation files."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

# Tests never touch the user's cache of converted verifiers, and never reach for a network.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")


@pytest.fixture
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared CPU every OpenMP barrier can wait a scheduler tick.

    Test files of tiny-model unit tests use it for every test: ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_hf_config(arch: str, vocab_size: int, layers: int = 8, hidden: int = 32):
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
           "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[arch]
    if arch in ("qwen3", "qwen3_moe"):
        common["head_dim"] = hidden // 4
    if arch == "qwen3_moe":  # mixtures of experts: 4 experts, 2 per token (Qwen3-MoE's experts narrower)
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    if arch == "mixtral":
        common.update(num_local_experts=4, num_experts_per_tok=2)
    return cls(**common)


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from fledge.models.verifier import VerifierConfig, load_tokenizer

    return load_tokenizer(VerifierConfig())


def make_tiny_verifier(root: Path, arch: str, tokenizer, seed: int = 0, layers: int = 8) -> Path:
    from transformers import AutoModelForCausalLM

    out = root / f"tiny-{arch}-{seed}-{layers}"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    config = tiny_hf_config(arch, vocab_size=len(tokenizer), layers=layers)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    """A tiny random Llama (8 layers, H=32) carrying SmolLM2's tokenizer and ChatML template."""
    return make_tiny_verifier(tmp_path_factory.mktemp("verifiers"), "llama", smollm_tokenizer)


def write_random_draft_run(run_dir: Path, verifier_dir: Path, seed: int):
    """A training run folder holding a random-init EAGLE-3 draft for a tiny verifier, as ``fledge train`` leaves it.

    Returns (verifier, draft); the draft's vocabulary is the verifier's whole vocabulary."""
    from fledge.models.draft import Eagle3Config, Eagle3Draft
    from fledge.models.draft_folder import write_final_draft
    from fledge.models.verifier import VerifierConfig, load_verifier

    verifier = load_verifier(VerifierConfig(name_or_path=str(verifier_dir), dtype="float32"))
    config = Eagle3Config.from_verifier(verifier.model.config, draft_vocab_size=len(verifier.tokenizer),
                                        aux_layer_ids=verifier.aux_layer_ids)
    draft = Eagle3Draft(config, seed=seed)
    draft.load_verifier_embedding(verifier.model.get_input_embeddings().weight.detach())
    meta = {"verifier": {"path": str(verifier_dir), "fingerprint": verifier.fingerprint}}  # as `fledge train` records
    write_final_draft(run_dir, draft.trainable_state_dict(), config, meta)
    return verifier, draft


def own_answers_eval(tmp_path: Path, verifier_dir: Path) -> tuple[Path, list[str]]:
    """A random draft's run for a tiny verifier, the verifier's own greedy answers to two prompts as a .jsonl of
    conversations (for a datastore or a recycle seed), and the ``fledge eval`` overrides that evaluate the draft on
    those prompts (tree rounds, exact checks on). Returns (the answers file, the overrides)."""
    from fledge.eval.runner import encode_prompt
    from reference_decode import generate_plain

    verifier, _ = write_random_draft_run(tmp_path / "run", verifier_dir, seed=0)
    texts = ["Tell me about the sea.", "Write a list of three fruits."]
    answers = []
    for text in texts:
        out = generate_plain(verifier.model, encode_prompt(verifier.tokenizer, {"turns": [text]}),
                             max_new_tokens=24).tokens
        answers.append(verifier.tokenizer.decode(out, skip_special_tokens=True))
    answers_file = tmp_path / "answers.jsonl"
    answers_file.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t},
                                                              {"role": "assistant", "content": a}]}) + "\n"
                                    for t, a in zip(texts, answers)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return answers_file, [
        f"draft={tmp_path / 'run'}", f"verifier.name_or_path={verifier_dir}", "verifier.dtype=float32",
        f"prompts=[{prompts}]", "eval.max_new_tokens=24", "eval.warmup_tokens=0", "eval.hf_baseline=false",
        "eval.round_floor=false", "wandb_mode=disabled", "eval.method=tree", "eval.tree_depth=1",
        "eval.tree_top_k=2", "eval.tree_total_tokens=2", "eval.num_draft_tokens=4"]


def tiny_pipeline(tmp_path: Path, verifier_dir: Path, conversations: int, stages: list[str]):
    """The quickstart's stages at fixed tiny sizes on a tiny verifier (run folder ``tmp_path/qs``): ``conversations``
    random ShareGPT-style conversations, two one-turn prompts to evaluate, a 3-step training run."""
    from fledge.launch.quickstart import QuickstartConfig

    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", conversations, max_words=30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"the a of {i} to and"]}) + "\n" for i in range(2)))
    run = tmp_path / "qs"
    verifier = f"verifier.name_or_path={verifier_dir}"
    return QuickstartConfig(
        run_dir=str(run),
        stages=stages,
        budget_minutes=None,  # fixed sizes (the budget does not size regeneration), overridden below
        regenerate=[verifier, "verifier.dtype=float32", f"data.source={source}", "data.max_length=128",
                    f"regenerate.out_dir={run}/regen", "regenerate.max_new_tokens=24", "regenerate.device=cpu"],
        cache=[f"cache.dir={run}/cache", verifier, "verifier.dtype=float32", f"data.source={source}",
               "data.max_length=128", "cache.draft_vocab_size=128"],
        train=[f"cache_dir={run}/cache", f"output_dir={run}/train", "train.max_steps=3", "validation.holdout=2",
               "validation.every=2", "checkpoint.every=2", "ttt.ttt_steps=2", "log.wandb_mode=offline"],
        eval=[f"draft={run}/train", verifier, "verifier.dtype=float32", f"prompts=[{prompts}]",
              "eval.max_new_tokens=6", f"eval.out_dir={run}/eval", "eval.warmup_tokens=0"],
        export=[f"draft={run}/train", f"out_dir={run}/export", f"report={run}/eval/report.json",
                f"verifier={verifier_dir}"],
    )


def main_exit(argv: list[str]) -> int:
    """The exit status of the ``fledge`` command with these arguments, run in this process."""
    from fledge.launch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from".split()


def write_sharegpt_jsonl(path: Path, n: int, seed: int = 0, max_words: int = 60) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, max_words)))})
                turns.append({"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, max_words)))})
            fh.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path


@pytest.fixture
def conversations_file(tmp_path) -> Path:
    return write_sharegpt_jsonl(tmp_path / "convs.jsonl", 40)
