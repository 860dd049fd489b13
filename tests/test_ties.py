"""Greedy losslessness that survives bf16: a first difference is a numerical tie or a mismatch, and a mismatch fails."""

from __future__ import annotations

import pytest
import torch

from fledge.core.errors import ConfigError
from fledge.decode.drafters import PromptLookupDrafter
from fledge.eval import batch_eval, runner
from fledge.eval.exactness import tiny_verifier
from fledge.eval.report import EvalReport
from fledge.eval.runner import EvalConfig, evaluate
from fledge.eval.summary import mismatch_lines, report_table
from fledge.eval.ties import TieJudge
from fledge.models.verifier import VerifierConfig, load_verifier

from reference_decode import generate_plain

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


@pytest.fixture
def model():
    return tiny_verifier("llama", vocab_size=48, num_layers=2, peak=3.0, seed=1)


def test_a_near_equal_runner_up_is_a_tie_and_a_clear_loser_a_mismatch(model):
    plain = generate_plain(model, PROMPT, max_new_tokens=6).tokens
    position, winner = 3, plain[3]
    prefix = torch.cat([PROMPT, torch.tensor(plain[:position])])
    logits = model(input_ids=prefix.view(1, -1)).logits[0, -1]
    loser = int(torch.argmin(logits))
    twin = (winner + 1) % 48 if (winner + 1) % 48 != loser else (winner + 2) % 48
    with torch.no_grad():  # a token whose output row is the winner's, one part in 1e9 apart: a tie in any dtype
        model.lm_head.weight[twin] = model.lm_head.weight[winner] * (1 + 1e-9)
    judge = TieJudge(model)
    tie = judge.judge("p", PROMPT, plain, plain[:position] + [twin, 0])
    assert (tie.kind, tie.position, tie.plain_token, tie.loop_token) == ("tie", position, winner, twin)
    assert tie.gap <= tie.threshold and tie.rounding == 0.0  # float32: the reference is the model itself
    wrong = judge.judge("p", PROMPT, plain, plain[:position] + [loser])
    assert wrong.kind == "mismatch" and wrong.gap > 1.0 and wrong.gap > wrong.threshold
    # Equal tokens, but one output ended early: the stop and length rules are exact, so this is a bug too.
    short = judge.judge("p", PROMPT, plain, plain[:2])
    assert (short.kind, short.position, short.loop_token) == ("mismatch", 2, None)


def test_in_bf16_the_rounding_is_measured_against_a_float32_copy(model):
    plain = generate_plain(model, PROMPT, max_new_tokens=4).tokens
    bf16 = model.to(torch.bfloat16)
    judge = TieJudge(bf16)
    d = judge.judge("p", PROMPT, plain, plain[:1] + [(plain[1] + 1) % 48])
    assert d.rounding > 0.0 and d.threshold >= 2 * d.rounding
    assert next(bf16.parameters()).dtype == torch.bfloat16  # the verifier itself is untouched
    assert next(judge.reference.parameters()).dtype == torch.float32
    judge.close()
    assert judge._reference is None


def test_a_kernel_that_rounds_one_token_steps_apart_is_a_tie_not_a_mismatch(model):
    """Plain decoding checks one token at a time; some CPU kernels round one-row products differently from the
    blocks the two draws use. Simulated: every one-token forward of the bf16 verifier lifts one token's logit by 0.6.
    Plain decoding then emits it where the float32 argmax leads it by less: the third draw (one-token steps) sees the
    shift and calls those ties, where the two block-shaped draws alone called some of them mismatches; a token far
    below the argmax stays a mismatch."""
    bf16 = model.to(torch.bfloat16)
    lifted, state = 7, {"length": 0}
    bf16.model.embed_tokens.register_forward_pre_hook(lambda m, args: state.update(length=args[0].shape[-1]))

    def lift(module, args, out):
        if state["length"] == 1:
            out = out.clone()
            out[..., lifted] += 0.6
        return out

    bf16.lm_head.register_forward_hook(lift)
    plain = generate_plain(bf16, PROMPT, max_new_tokens=24).tokens
    judge = TieJudge(bf16)
    check = judge.recheck("p", PROMPT, plain)
    shifted = [t["position"] for t in check.ties if t["token"] == lifted and t["gap"] > 0.1]
    assert len(shifted) >= 3 and not check.mismatches, check
    assert all(check.bands[t["position"]] == t["threshold"] for t in check.ties)  # the band each was judged by
    # Without the third draw the same positions fall outside the two draws' band.
    judge._third_draw = lambda *args: {}
    assert [m["position"] for m in TieJudge.recheck(judge, "p", PROMPT, plain).mismatches] == shifted
    del judge._third_draw
    # A loop token far below the argmax is still a mismatch with the third draw.
    prefix = torch.cat([PROMPT, torch.tensor(plain[:2])])
    worst = int(judge.reference(input_ids=prefix.view(1, -1)).logits[0, -1].argmin())
    assert judge.judge("p", PROMPT, plain, plain[:2] + [worst]).kind == "mismatch"


def test_evaluate_reports_ties_and_mismatches_and_the_job_fails_on_a_mismatch(tiny_verifier_dir, monkeypatch):
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    real_decode = batch_eval.decode_rows

    def broken_decode(verifier_, prompts, drafters, *args, **kwargs):  # a loop that is not exact: its third token
        results, extra = real_decode(verifier_, prompts, drafters, *args, **kwargs)  # is off by one
        if drafters is not None:
            for result in results:
                result.tokens[2] = (result.tokens[2] + 1) % len(verifier.tokenizer)
        return results, extra

    monkeypatch.setattr(batch_eval, "decode_rows", broken_decode)
    prompts = [{"id": "a", "turns": ["Say hello."]}, {"id": "b", "turns": ["Count to three."]}]
    cfg = EvalConfig(max_new_tokens=6, warmup_tokens=0, hf_baseline=False, round_floor=False, out_dir=None)
    report = evaluate(verifier, {"toy": prompts}, {"lookup": PromptLookupDrafter()}, cfg)
    entry = report["sets"]["toy"]["drafters"]["lookup"]
    assert (entry["greedy_exact"], entry["greedy_tie_count"], entry["greedy_mismatch_count"]) == (0, 0, 2)
    assert entry["greedy_mismatches"][0]["position"] == 2
    # Every position rechecked: the broken token itself is off the argmax in both prompts (and so may be the next,
    # which continues plain's prefix, not the broken one); plain decoding is on the argmax everywhere.
    recheck = entry["recheck"]
    assert recheck["positions"] == 12 and report["sets"]["toy"]["baseline"]["recheck"]["mismatches"] == 0
    assert {(m["id"], m["position"]) for m in recheck["off_argmax"] if m["kind"] == "mismatch"} >= {("a", 2), ("b", 2)}
    lines = mismatch_lines(report)
    assert len(lines) == 2 + recheck["mismatches"] and "plain greedy decoding gave" in lines[0]
    assert any("float32 argmax there is" in line for line in lines)
    assert f"{2 + recheck['mismatches']} MISMATCHED" in report_table(report)[1]

    from fledge.eval import eval_job

    monkeypatch.setattr(eval_job, "evaluate", lambda *a, **k: report)
    monkeypatch.setattr(eval_job, "load_verifier", lambda *a, **k: verifier)
    cfg_job = eval_job.EvalJobConfig(draft=None, wandb_mode="disabled", eval=EvalConfig(out_dir=None))
    with pytest.raises(SystemExit) as exc:
        eval_job.run(cfg_job)
    assert exc.value.code == 1


def test_evaluate_writes_its_report_once_and_keeps_it_when_a_plot_fails(tiny_verifier_dir, tmp_path, monkeypatch):
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    prompts = [{"id": "a", "turns": ["Say hello."]}]
    cfg = EvalConfig(max_new_tokens=4, warmup_tokens=0, hf_baseline=False, round_floor=False,
                     out_dir=str(tmp_path / "eval"))
    saves = []
    real_save = EvalReport.save
    monkeypatch.setattr(EvalReport, "save", lambda self, path: saves.append(path) or real_save(self, path))

    def broken_plot(report, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(runner, "plot_acceptance", broken_plot)
    with pytest.raises(RuntimeError, match="no display"):
        evaluate(verifier, {"toy": prompts}, {"lookup": PromptLookupDrafter()}, cfg,
                 lambda: {"draft": {"path": "none"}})
    assert len(saves) == 1
    kept = EvalReport.load(tmp_path / "eval")
    assert kept.format == 1 and kept.draft == {"path": "none"}
    assert kept.files == {"json": str(tmp_path / "eval" / "report.json")}  # the plot that failed is not listed
    assert kept.sets["toy"].drafters["lookup"].tau >= 1.0


def test_eval_time_limit_stops_starting_prompts_and_counts_the_ones_left_out(tiny_verifier_dir):
    verifier = load_verifier(VerifierConfig(name_or_path=str(tiny_verifier_dir), dtype="float32"))
    prompts = [{"id": str(i), "turns": [f"Say {word}."]} for i, word in enumerate(["hello", "yes", "no"])]
    settings = dict(max_new_tokens=4, warmup_tokens=0, hf_baseline=False, round_floor=False, first_token=False,
                    recheck=False, out_dir=None)
    drafters = {"lookup": PromptLookupDrafter()}
    # a limit already spent: every set still runs its first prompt, and only it
    spent = evaluate(verifier, {"a": prompts, "b": prompts}, drafters, EvalConfig(**settings, time_limit_minutes=1e-9))
    for entry in spent["sets"].values():
        assert (entry["num_prompts"], entry["prompts_skipped"]) == (1, 2)
        assert [p["id"] for p in entry["drafters"]["lookup"]["per_prompt"]] == ["0"]
    assert "(a: 1 of 3 prompts, the rest left out by eval.time_limit_minutes)" in report_table(spent)
    roomy = evaluate(verifier, {"a": prompts}, drafters, EvalConfig(**settings, time_limit_minutes=60))
    assert roomy["sets"]["a"]["num_prompts"] == 3 and "prompts_skipped" not in roomy["sets"]["a"]
    assert not any("left out" in row for row in report_table(roomy))
    with pytest.raises(ConfigError, match="time_limit_minutes must be > 0"):
        EvalConfig(time_limit_minutes=0)
    with pytest.raises(ConfigError, match="prompt-by-prompt"):
        EvalConfig(time_limit_minutes=5, batch_size=[1, 2])
