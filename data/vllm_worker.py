#!/usr/bin/env python
"""One vLLM engine that answers batches of token-id prompts for ``fledge regenerate engine=vllm``.

Runs in vLLM's own environment (``make vllm-env`` -> ``.venv-vllm``), never in fledge's: vLLM pins its own torch and
transformers. Standalone on purpose (stdlib + vllm; nothing from fledge). ``data/vllm_engine.py`` starts it and
speaks to it in JSON lines:

- the first line on stdin holds the engine's settings (``LLM(**settings)``, plus ``"env"``: variables set before vLLM
  is imported); the worker answers ``{"ready": true, "vllm": <version>, "torch": <version>, "load_seconds": s}``;
- each later line is one batch: ``{"prompts": [[ids], ...], "max_tokens": [n, ...], "stop_ids": [...],
  "temperature": t, "top_p": p, "seeds": [s, ...]}``; the answer is ``{"outputs": [{"token_ids": [...],
  "finish_reason": "stop" | "length"}, ...]}`` in the prompts' order;
- or, for an engine started with vLLM's hidden-state capture (``"capture": true`` in the settings; ``fledge cache
  cache.engine=vllm``), ``{"capture": [[ids], ...]}``: each prompt is read (one token generated) and the answer is
  ``{"files": [path, ...]}``, the safetensors file of each prompt's states (``vllm_ext/fledge_hidden_states.py``),
  complete when it is sent;
- end of stdin ends the worker.

Replies go to the file descriptor stdout had when the worker started; everything vLLM prints goes to stderr, so that no
log line can break the protocol. An error becomes ``{"error": "<type>: <message>"}`` and exit status 1.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM's and torch's prints land on stderr
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def say(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        settings = json.loads(sys.stdin.readline())
        os.environ.update({k: str(v) for k, v in settings.pop("env", {}).items()})
        capture = settings.pop("capture", False)
        start = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        if capture:  # vLLM's own processes import the connector from PYTHONPATH (set in "env")
            sys.path.insert(0, os.environ["PYTHONPATH"])
            from fledge_hidden_states import supported

            missing = supported()
            if missing:
                raise RuntimeError(f"vLLM {vllm.__version__}'s hidden-state connector lacks {', '.join(missing)}, "
                                   "which fledge's capture relies on (written against vLLM 0.32.0)")
        llm = LLM(**settings)
        say({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
             "load_seconds": round(time.perf_counter() - start, 2)})
        for line in sys.stdin:
            if not line.strip():
                continue
            batch = json.loads(line)
            if "capture" in batch:
                say({"files": _capture(llm, SamplingParams, batch["capture"])})
                continue
            params = [
                SamplingParams(temperature=batch["temperature"], top_p=batch["top_p"], seed=seed, max_tokens=n,
                               stop_token_ids=batch["stop_ids"], detokenize=False)
                for n, seed in zip(batch["max_tokens"], batch["seeds"])
            ]
            outs = llm.generate([{"prompt_token_ids": ids} for ids in batch["prompts"]], params, use_tqdm=False)
            say({"outputs": [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
                             for o in outs]})
    except Exception as e:  # the client shows it with the tail of stderr
        say({"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


def _capture(llm, sampling_params, prompts: list[list[int]]) -> list[str]:  # noqa: ANN001 (vLLM's types)
    """Read each prompt (one token generated); the file of its states, once its writer has released it."""
    import fcntl

    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        sampling_params(max_tokens=1, detokenize=False), use_tqdm=False)
    files = []
    for out in outs:
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"request {out.request_id} came back without a hidden_states_path")
        if os.path.exists(path + ".lock"):
            with open(path + ".lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)  # the writer holds LOCK_EX until the file is complete
            os.remove(path + ".lock")
        if not os.path.exists(path):
            raise RuntimeError(f"request {out.request_id}: its states were not written to {path}")
        files.append(path)
    return files


if __name__ == "__main__":
    sys.exit(main())
