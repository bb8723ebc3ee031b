"""Prefill and decode tokens/s of llama.cpp (llama-cpp-python) on a GGUF, for `rewind bench speed`.

Run by the llama.cpp benchmark venv's own Python (it imports llama_cpp, never rewind):
    python llama_cpp_speed.py GGUF PROMPT_TOKENS GEN_TOKENS THREADS [CONTEXT_TOKENS]
Prints one JSON line. The prompt is the same kind of fixed pseudo-random token list as Rewind's
(speed does not depend on which tokens); decoding is greedy. CONTEXT_TOKENS are evaluated first,
untimed: the prompt then extends a conversation already in llama.cpp's KV cache.
"""

from __future__ import annotations

import json
import random
import sys
import time


def main() -> int:
    from llama_cpp import Llama

    gguf, prompt_tokens, gen_tokens, threads = sys.argv[1], *map(int, sys.argv[2:5])
    context_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    llm = Llama(model_path=gguf, n_ctx=context_tokens + prompt_tokens + gen_tokens + 64,
                n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 32000) for _ in range(prompt_tokens)]
    llm.eval(tokens[:64])  # warm-up, as Rewind's row gets one
    llm.reset()
    if context_tokens:
        llm.eval([rng.randrange(3, 32000) for _ in range(context_tokens)])
    start = time.perf_counter()
    llm.eval(tokens)
    first = time.perf_counter()
    produced = 0
    for _ in llm.generate([], temp=0.0, reset=False):
        produced += 1
        if produced >= gen_tokens:
            break
    end = time.perf_counter()
    print(json.dumps({"prefill_tps": prompt_tokens / (first - start),
                      "decode_tps": (produced - 1) / (end - first) if produced > 1 else None,
                      "generated": produced, "prefill_s": first - start, "decode_s": end - first}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
