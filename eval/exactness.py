"""Is speculative sampling really lossless? A statistical check of the real loops against the verifier itself.

The chain or tree loop generates the first few tokens after a fixed prompt ``n_runs`` times; each position's
empirical distribution (and the joint of the first two) is compared with the
verifier's exact probabilities, enumerated over every prefix (a small vocabulary keeps that to a few batched
forwards), with a chi-square test. Bins with small expected counts are pooled; any observation of a token the
verifier gives probability zero fails outright. The critical values come from the Wilson–Hilferty approximation,
so scipy is not needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal

import torch
from torch import nn

from fledge.decode.loop import generate
from fledge.decode.proposals import Drafter, TreeShape
from fledge.models.sampling import SamplingParams, target_probs


def chi2_critical(dof: int, significance: float) -> float:
    """Upper ``significance`` quantile of the chi-square distribution (Wilson–Hilferty; ~1% accurate for dof>=3)."""
    z = NormalDist().inv_cdf(1.0 - significance)
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


@dataclass
class ChiSquareTest:
    name: str
    statistic: float
    dof: int
    critical: float

    @property
    def passed(self) -> bool:
        return self.statistic <= self.critical


def chi_square(name: str, observed: torch.Tensor, probs: torch.Tensor, significance: float) -> ChiSquareTest:
    """Goodness of fit of ``observed`` counts to ``probs``, pooling bins expected below 10 into one.

    The usual rule of thumb is 5; the tail of the statistic is then still heavier than chi-square's, and at a
    1e-3 level that matters, so bins are pooled more eagerly.
    """
    observed = observed.double().flatten()
    n = observed.sum()
    expected = probs.double().flatten() * n
    impossible = (expected == 0) & (observed > 0)
    if impossible.any():
        return ChiSquareTest(name, math.inf, 1, chi2_critical(1, significance))
    small = expected < 10.0
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = max(int(obs.numel()) - 1, 1)
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return ChiSquareTest(name, statistic, dof, chi2_critical(dof, significance))


@torch.inference_mode()
def exact_joint(verifier: nn.Module, prompt_ids: torch.Tensor, sampling: SamplingParams, positions: int
                ) -> torch.Tensor:
    """P(t_1..t_J | prompt) as a [V]*J tensor, by running the verifier on every prefix (one batch per position)."""
    vocab = int(verifier.config.vocab_size)
    if vocab ** (positions - 1) > 70_000:
        raise ValueError(f"{vocab}^{positions - 1} prefixes to enumerate; use a smaller vocabulary or fewer positions")
    device = next(verifier.parameters()).device
    prompt = prompt_ids.to(device).view(1, -1)
    joint = target_probs(verifier(input_ids=prompt).logits[0, -1], sampling).double()  # [V]
    prefixes = torch.arange(vocab, device=device).view(vocab, 1)
    for _ in range(1, positions):
        batch = torch.cat([prompt.expand(prefixes.shape[0], -1), prefixes], dim=1)
        conditional = target_probs(verifier(input_ids=batch).logits[:, -1], sampling).double()  # [V^j, V]
        joint = (joint.reshape(-1, 1) * conditional).reshape(-1)
        # Row-major order over (t_1..t_j), matching the flattened joint.
        last = torch.arange(vocab, device=device).repeat(prefixes.shape[0]).view(-1, 1)
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, dim=0), last], dim=1)
    return joint.reshape([vocab] * positions).cpu()


@dataclass
class ExactnessReport:
    method: str
    n_runs: int
    tests: list[ChiSquareTest] = field(default_factory=list)
    mean_accepted: float = 0.0
    """Mean accepted drafts per verifier call over all runs: shows whether the draft was good or bad."""

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tests)

    def describe(self) -> str:
        lines = [f"exactness {self.method}: {'PASS' if self.passed else 'FAIL'} ({self.n_runs} runs, "
                 f"mean accepted/call {self.mean_accepted:.2f})"]
        lines += [f"  {t.name}: chi2 {t.statistic:.1f} vs {t.critical:.1f} (dof {t.dof})" for t in self.tests]
        return "\n".join(lines)


def exactness_check(
    verifier: nn.Module,
    drafter_factory: Callable[[], Drafter],
    method: Literal["chain", "tree"],
    n_runs: int,
    *,
    prompt_ids: torch.Tensor,
    sampling: SamplingParams = SamplingParams(temperature=1.0),
    positions: int = 3,
    num_draft_tokens: int = 3,
    tree_shape: TreeShape = TreeShape(depth=3, top_k=3, total_tokens=9),
    aux_layer_ids: list[int] | None = None,
    significance: float = 1e-3,
    seed: int = 0,
    batch_size: int = 1,
) -> ExactnessReport:
    """Run the real ``method`` loop ``n_runs`` times from ``prompt_ids`` and test its first ``positions`` tokens.

    Tests: each position's marginal and the joint of positions 1-2, each at
    ``significance`` / (number of tests) so that the whole check fails a correct loop with probability at most
    ``significance``.
    """
    if sampling.greedy:
        raise ValueError("the exactness check is about sampling; use a temperature > 0")
    vocab = int(verifier.config.vocab_size)
    joint = exact_joint(verifier, prompt_ids, sampling, positions)
    generator = torch.Generator(device=next(verifier.parameters()).device).manual_seed(seed)
    if method not in ("chain", "tree"):
        raise ValueError(f"method must be chain or tree, got {method!r}")
    counts = torch.zeros([vocab] * positions, dtype=torch.long)
    accepted = calls = 0
    for first in range(0, n_runs, max(batch_size, 1)):
        rows = min(max(batch_size, 1), n_runs - first)
        # The runs as rows of batches (batch 1: one row a call): each row must be distributed as the verifier alone.
        # Generation stops at the checked positions: the loops then trim the first round to positions - 1 drafts (a
        # round yields one more token than it drafts), which keeps a run at a few verifier calls.
        results, _ = generate(
            verifier, [prompt_ids] * rows, [drafter_factory() for _ in range(rows)], method=method,
            num_draft_tokens=num_draft_tokens, shape=tree_shape, max_new_tokens=positions, sampling=sampling,
            aux_layer_ids=aux_layer_ids, generator=generator,
        )
        for result in results:
            counts[tuple(result.tokens)] += 1
            accepted += sum(result.accepted)
            calls += result.verifier_calls

    names_and_axes: list[tuple[str, tuple[int, ...]]] = [(f"position {j + 1}", (j,)) for j in range(positions)]
    if positions >= 2:
        # The joint catches a loop whose marginals are right but whose tokens depend on each other wrongly.
        names_and_axes.append(("joint 1-2", (0, 1)))
    level = significance / len(names_and_axes)
    report = ExactnessReport(method=method, n_runs=n_runs, mean_accepted=accepted / max(calls, 1))
    for name, axes in names_and_axes:
        others = tuple(a for a in range(positions) if a not in axes)
        observed = counts.sum(dim=others) if others else counts
        probs = joint.sum(dim=others) if others else joint
        report.tests.append(chi_square(name, observed, probs, level))
    return report


def tiny_verifier(
    kind: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama",
    vocab_size: int = 16,
    hidden_size: int = 32,
    num_layers: int = 2,
    peak: float = 1.0,
    seed: int = 0,
    sliding_window: int | None = None,
) -> nn.Module:
    """A random-init causal LM small enough to enumerate; ``peak`` scales the output head, so that its
    distributions are far from uniform and a biased sampler is easy to catch."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    kinds = {"llama": ("Llama", {}), "qwen2": ("Qwen2", {}), "qwen3": ("Qwen3", {"head_dim": hidden_size // 4}),
             "mistral": ("Mistral", {"sliding_window": sliding_window})}
    if kind not in kinds:
        raise ValueError(f"unknown tiny verifier kind {kind!r}")
    prefix, extra = kinds[kind]
    model = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**common, **extra))
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    return model.eval().requires_grad_(False)


def random_eagle_factory(verifier: nn.Module, aux_layer_ids: list[int], seed: int = 0, peak: float = 50.0):
    """Drafter factory over a random-init EAGLE-3 draft whose vocabulary is half the verifier's (odd ids, mapped
    through d2t): a deliberately poor draft that still exercises fc, the KV cache and the vocabulary mapping."""
    from fledge.decode.drafters import EagleDrafter
    from fledge.models.draft import Eagle3Config, Eagle3Draft

    vocab = int(verifier.config.vocab_size)
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=vocab // 2, aux_layer_ids=aux_layer_ids)
    draft = Eagle3Draft(config, seed=seed)
    draft.load_verifier_embedding(verifier.get_input_embeddings().weight.detach())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[1::2] = True
    draft.set_draft_vocab(torch.arange(1, vocab, 2)[: vocab // 2] - torch.arange(vocab // 2), t2d)
    with torch.no_grad():
        draft.lm_head.weight.mul_(peak)  # confident and wrong, so that rejections and residuals happen often
    draft = draft.to(verifier.get_input_embeddings().weight.device)
    return lambda: EagleDrafter(draft)
