"""``fledge eval exactness``: the real sampling loops, run many times on a tiny verifier, against direct sampling.

Generated tokens at the first positions are counted over ``n_runs`` runs and compared with the verifier's exact
distribution by chi-square tests (per position and the joint of positions 1-2). Speculative sampling is lossless
by construction, so this passes whatever the draft: a random-init EAGLE-3 draft and a random drafter are the
deliberately bad drafts it runs with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fledge.core.dist import pick_device
from fledge.core.errors import ConfigError
from fledge.decode.drafters import RandomDrafter
from fledge.decode.proposals import TreeShape
from fledge.eval.exactness import exactness_check, random_eagle_factory, tiny_verifier
from fledge.models.sampling import SamplingParams

DRAFTS = ("eagle", "random")


@dataclass
class ExactnessJobConfig:
    methods: list[str] = field(default_factory=lambda: ["chain", "tree"])
    """Loops to check: chain (Leviathan) and tree (multi-candidate)."""
    drafts: list[str] = field(default_factory=lambda: list(DRAFTS))
    """eagle: a random-init EAGLE-3 draft over half the vocabulary; random: random tokens with a random q."""
    n_runs: int = 600
    """Generations per (method, draft); more runs make the test sharper and slower."""
    arch: str = "llama"
    """Tiny verifier architecture: llama, qwen2, qwen3 or mistral."""
    vocab_size: int = 16
    """Small enough to enumerate the exact joint distribution of the first positions."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    tree_sampled_children: bool = True
    """Draw tree children from q (verified with q renormalisation) instead of EAGLE-2's deterministic top-k."""
    significance: float = 1e-3
    """Probability that the whole check fails a correct loop."""
    seed: int = 0
    batch_size: int = 1
    """Runs decoded together as the rows of one batch (``decode/loop.py``); > 1 checks the batched loops, whose
    every row must be distributed as the verifier."""
    device: str = "cpu"
    """Where the loops run: ``cpu``, ``cuda``, ``cuda:1`` or ``auto`` (CUDA when there is one). The counts and the
    exact distribution are the same on every device; a GPU run checks that the loops' randomness and tensors stay
    on it."""

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in ("chain", "tree")] + [d for d in self.drafts if d not in DRAFTS]
        if bad:
            raise ConfigError(f"unknown methods/drafts {bad}: methods are chain|tree, drafts are {'|'.join(DRAFTS)}")
        if self.temperature <= 0:
            raise ConfigError("exactness is about sampling: temperature must be > 0")


def run(cfg: ExactnessJobConfig) -> bool:
    torch.manual_seed(cfg.seed)
    # A peaked head (as in the tests) concentrates the first positions on few tokens, so the joint test has power.
    device = pick_device(cfg.device)
    verifier = tiny_verifier(cfg.arch, vocab_size=cfg.vocab_size, num_layers=1, peak=12.0, seed=cfg.seed).to(device)
    aux = [0, 1, 1]
    prompt = torch.tensor([1, 5, 7, 2]) % cfg.vocab_size
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    shape = TreeShape(depth=3, top_k=3, total_tokens=8, sampled_children=cfg.tree_sampled_children)
    passed = True
    for draft in cfg.drafts:
        if draft == "eagle":
            factory, aux_ids = random_eagle_factory(verifier, aux, seed=cfg.seed), aux
        else:
            seeds = iter(range(cfg.seed, cfg.seed + 10**9))
            factory, aux_ids = (lambda: RandomDrafter(cfg.vocab_size, seed=next(seeds), sharpness=3.0,
                                                     device=device)), None
        for method in cfg.methods:
            report = exactness_check(verifier, factory, method, cfg.n_runs, prompt_ids=prompt, sampling=sampling,
                                     tree_shape=shape, aux_layer_ids=aux_ids, significance=cfg.significance,
                                     seed=cfg.seed, batch_size=cfg.batch_size)
            print(f"[{draft} draft] {report.describe()}", flush=True)
            passed &= report.passed
    print("exactness: " + ("PASS — sampled output is distributed as the verifier's" if passed else "FAIL"))
    if not passed:
        raise SystemExit(1)
    return passed
