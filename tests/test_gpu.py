"""Code that must be right on a GPU: the sampled loops' randomness on the device, and the whole pipeline on CUDA.

The tests marked ``gpu`` skip where CUDA is absent; ``launch/gpu_smoke.sh`` runs them, then the default verifier in
bf16. The static check below runs everywhere: it catches the kind of bug that only a GPU would show otherwise.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from fledge.decode.drafters import RandomDrafter
from fledge.decode.loop import decode_one
from fledge.decode.proposals import TreeShape
from fledge.eval.exactness import exactness_check, random_eagle_factory, tiny_verifier
from fledge.launch.cli import run_stage
from fledge.launch.quickstart import QuickstartConfig, run_pipeline
from fledge.models.sampling import SamplingParams

from conftest import write_sharegpt_jsonl
from reference_decode import generate_plain

ROOT = Path(__file__).resolve().parents[1]
RANDOM_FILLERS = {"rand", "randn", "randint", "randperm", "bernoulli", "normal"}
DEVICE_CODE = ("eval", "models", "data")
"""Packages whose tensors live on the model's device (decoding, capture, regeneration)."""

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def unplaced_random_calls(source: str) -> list[int]:
    """Lines of ``torch.rand*(..., generator=g)`` calls that do not say ``device=``: such a call makes a CPU tensor
    and fails once ``g`` is a CUDA generator (``Expected a 'cpu' device type for generator``)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        keywords = {k.arg for k in node.keywords}
        if node.func.attr in RANDOM_FILLERS and "generator" in keywords and "device" not in keywords:
            bad.append(node.lineno)
    return bad


def test_the_static_check_catches_a_random_call_without_a_device():
    assert unplaced_random_calls("import torch\nu = torch.rand(3, generator=g)\n") == [2]
    assert unplaced_random_calls("import torch\nu = torch.rand(3, generator=g, device=p.device)\n") == []


def test_random_draws_with_a_generator_say_their_device():
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for package in DEVICE_CODE
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in unplaced_random_calls(path.read_text())
    }
    assert not found, f"random draws that would land on the CPU beside a CUDA generator: {sorted(found)}"


# ---------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method", ["chain", "tree"])
@pytest.mark.parametrize("draft", ["eagle", "random"])
def test_sampled_loops_are_exact_on_cuda(method, draft):
    device = torch.device("cuda")
    verifier = tiny_verifier("llama", vocab_size=16, num_layers=1, peak=12.0).to(device)
    if draft == "eagle":
        factory, aux = random_eagle_factory(verifier, [0, 1, 1]), [0, 1, 1]
    else:
        seeds = iter(range(10**9))
        factory, aux = (lambda: RandomDrafter(16, seed=next(seeds), device=device)), None
    report = exactness_check(
        verifier, factory, method, 400, prompt_ids=torch.tensor([1, 5, 7, 2]),
        sampling=SamplingParams(temperature=1.0, top_p=0.9), num_draft_tokens=3,
        tree_shape=TreeShape(depth=3, top_k=3, total_tokens=8, sampled_children=True), aux_layer_ids=aux,
    )
    assert report.passed, report.describe()


@pytest.mark.gpu
@cuda
def test_greedy_loops_equal_plain_decoding_on_cuda():
    device = torch.device("cuda")
    verifier = tiny_verifier("llama", vocab_size=64, num_layers=2, peak=4.0).to(device)
    prompt = torch.tensor([1, 5, 7, 2, 9, 3])
    plain = generate_plain(verifier, prompt, max_new_tokens=24).tokens
    drafter = random_eagle_factory(verifier, [0, 1, 2])()
    chain = decode_one(verifier, prompt, drafter, method="chain", num_draft_tokens=4, max_new_tokens=24,
                       aux_layer_ids=[0, 1, 2])
    tree = decode_one(verifier, prompt, drafter, method="tree", shape=TreeShape(4, 4, 12), max_new_tokens=24,
                      aux_layer_ids=[0, 1, 2])
    assert chain.tokens == plain and tree.tokens == plain


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ttt_flash_attention_on_cuda_is_the_explicit_scores(dtype):
    """The TTT attention's CUDA kernel (memory-efficient attention, the diagonal keys merged by log-sum-exp) passes
    its own check and gives the explicit scores' output and gradients at every step of a 7-step unroll."""
    from fledge.models.ttt_attention import flash_available, ttt_attention

    device = torch.device("cuda")
    assert flash_available(device), "the CUDA kernel failed its check (see the warning): the unroll would fall back"
    g = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 8, 2, 96, 64
    q = torch.randn(b, h, t, d, generator=g, device="cpu").to(device, dtype).requires_grad_()
    keys = [torch.randn(b, hkv, t, d, generator=g, device="cpu").to(device, dtype).requires_grad_() for _ in range(7)]
    values = [torch.randn(b, hkv, t, d, generator=g, device="cpu").to(device, dtype).requires_grad_() for _ in range(7)]
    weights = torch.randn(b, h, t, d, generator=g, device="cpu").to(device, dtype)
    tol = dict(rtol=1e-3, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for steps in range(1, 8):
        inputs = [q, *keys[:steps], *values[:steps]]
        got = ttt_attention(q, keys[:steps], values[:steps], 0, "flash")
        want = ttt_attention(q, keys[:steps], values[:steps], 0, "blocks")
        torch.testing.assert_close(got.float(), want.float(), **tol)
        got_grads = torch.autograd.grad((got.float() * weights.float()).sum(), inputs)
        want_grads = torch.autograd.grad((want.float() * weights.float()).sum(), inputs)
        for a, e in zip(got_grads, want_grads):
            torch.testing.assert_close(a.float(), e.float(), **tol)


@pytest.mark.gpu
@cuda
def test_pipeline_on_cuda(tmp_path, tiny_verifier_dir):
    """cache -> train -> eval (greedy and sampled, chain and tree) -> export, every stage on the GPU."""
    source = write_sharegpt_jsonl(tmp_path / "convs.jsonl", 24, max_words=30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"the a of {i} to and"]}) + "\n" for i in range(3)))
    run = tmp_path / "qs"
    verifier = f"verifier.name_or_path={tiny_verifier_dir}"
    eval_common = [f"draft={run}/train", verifier, "verifier.dtype=float32", f"prompts=[{prompts}]",
                   "eval.max_new_tokens=12", "eval.warmup_tokens=0", "wandb_mode=disabled"]
    cfg = QuickstartConfig(
        run_dir=str(run),
        stages=["cache", "train", "eval", "export"],
        budget_minutes=None,
        cache=[f"cache.dir={run}/cache", verifier, "verifier.dtype=float32", f"data.source={source}",
               "data.max_length=128", "cache.draft_vocab_size=128", "cache.device=cuda"],
        train=[f"cache_dir={run}/cache", f"output_dir={run}/train", "train.max_steps=4", "validation.holdout=2",
               "validation.every=2", "checkpoint.every=2", "ttt.ttt_steps=2", "log.wandb_mode=disabled",
               "engine.device=cuda"],
        eval=[*eval_common, f"eval.out_dir={run}/eval"],
        export=[f"draft={run}/train", f"out_dir={run}/export", f"verifier={tiny_verifier_dir}"],
    )
    run_pipeline(cfg)
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["verifier"]["device"].startswith("cuda")
    assert report["sets"]["prompts"]["drafters"]["eagle3"]["greedy_match_rate"] == 1.0
    for method in ("chain", "tree"):
        for temperature in (0.0, 0.7):
            out = tmp_path / f"eval-{method}-{temperature}"
            sampled = run_stage("eval", [*eval_common, f"eval.out_dir={out}", f"eval.method={method}",
                                         f"eval.temperature={temperature}"])
            entry = sampled["sets"]["prompts"]["drafters"]["eagle3"]
            assert entry["method"] == method and entry["tokens"] > 0
            if temperature == 0.0:
                assert entry["greedy_match_rate"] == 1.0
    assert (run / "export" / "model.safetensors").is_file()
