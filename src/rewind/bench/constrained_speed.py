"""Decode speed with and without a JSON-schema constraint, through the engine the server runs
(`rewind bench speed --json-schema FILE|array`): the same prompt, the same number of tokens, the
only difference the grammar's token mask (llguidance) applied to each step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

# A schema any number of tokens can follow (an array of integers, never forced to close), so
# both rows decode the same count of tokens.
ENDLESS_ARRAY: dict[str, Any] = {"type": "array", "items": {"type": "integer"}}


def load_schema(spec: str) -> dict[str, Any]:
    return ENDLESS_ARRAY if spec == "array" else json.loads(Path(spec).read_text())


def measure_engine_decode(model_name: str, tokens: list[int], gen_tokens: int,
                          schema: dict[str, Any] | None) -> dict[str, Any]:
    """Decode tokens/s of one greedy request through Engine (EOS banned so it runs to
    `gen_tokens`), constrained by `schema` or free; the mask's share of a step is the
    difference of the two rows. The first request of the engine is a warm-up, and a
    constrained row's first token includes llguidance reading the vocabulary (its prefill
    figure is not the model's)."""
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine, GenerationRequest, SamplingParams
    from rewind.models.loader import load_model
    from rewind.server.structured import json_grammar

    import mlx.core as mx

    from rewind.kernels.fast_head import fast_head
    from rewind.kernels.native_forward import native_forward

    loaded = load_model(model_name)
    config = EngineConfig(parallel=1, cache=CacheConfig(enabled=False))
    grammar = json_grammar(schema, "json_schema") if schema is not None else None
    with Engine(loaded, config) as engine:
        no_eos = {token: -100.0 for token in engine.eos_token_ids}
        params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, logit_bias=no_eos)
        engine.generate(GenerationRequest(tokens[:64], SamplingParams(temperature=0.0,
                                                                      max_tokens=4)), 600)
        started, cpu_started = time.perf_counter(), time.process_time()
        first = cpu_first = None
        count = 0
        for event in engine.submit(GenerationRequest(tokens, params, grammar=grammar)).events(600):
            if hasattr(event, "token"):
                count += 1
                if first is None:
                    first, cpu_first = time.perf_counter(), time.process_time()
        end, cpu_end = time.perf_counter(), time.process_time()
    head, forward = fast_head(loaded.model), native_forward(loaded.model)
    return {
        "compute_dtype": "float32 in C kernels" if forward is not None else "mlx",
        "decode_layers": forward.form if forward is not None else "mlx",
        "decode_head": head.form if head is not None else "mlx",
        "prefill_cpu_s": (cpu_first or cpu_end) - cpu_started,
        "decode_cpu_s": cpu_end - (cpu_first or cpu_end),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "path": "rewind engine" + (" (JSON schema)" if schema is not None else " (free)"),
        "prefill_tps": len(tokens) / ((first or end) - started),
        "decode_tps": (count - 1) / (end - first) if first is not None and count > 1 else None,
        "generated": count,
        "decode_ms_per_token": 1000 * (end - first) / (count - 1)
        if first is not None and count > 1 else None,
    }
