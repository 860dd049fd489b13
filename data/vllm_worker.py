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
        start = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(**settings)
        say({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
             "load_seconds": round(time.perf_counter() - start, 2)})
        for line in sys.stdin:
            if not line.strip():
                continue
            batch = json.loads(line)
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


if __name__ == "__main__":
    sys.exit(main())
