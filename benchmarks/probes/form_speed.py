"""Speed of each stored form (bf16, 8-bit, 4-bit g32/g64) of a Gemma 3 270M-shaped model, on this backend.

Speed does not depend on the weights' values, so this uses random weights of the default model's
exact shape (tests/data/gemma3_270m_config.json): it runs where the real model is not at hand
(a GPU machine with MLX but without the GGUF). Quality per form is in `rewind bench model-forms`.
Runs with mlx and mlx-lm alone (`python benchmarks/probes/form_speed.py`): no transformers, no gguf.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import types
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "data" / "gemma3_270m_config.json"
FORMS = ("bf16", "q8", "q4g32", "q4")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--forms", nargs="+", default=list(FORMS))
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="best of N (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="write JSON here")


def _mlx_lm_module(name: str):
    """Import an mlx_lm submodule without mlx_lm/__init__.py, which pulls in transformers."""
    if "mlx_lm" not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")
        package = types.ModuleType("mlx_lm")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = package
    return importlib.import_module(f"mlx_lm.{name}")


def build(form: str):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    config = json.loads(CONFIG.read_text())
    module = _mlx_lm_module(f"models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.sanitize({})  # no lm_head in the weights: tied, as in the real model
    mx.random.seed(0)
    model.update(tree_map(lambda v: (mx.random.normal(v.shape) * 0.02).astype(mx.bfloat16), model.parameters()))
    if form != "bf16":
        bits, _, group = form[1:].partition("g")
        group_size = int(group or 64)
        nn.quantize(model, group_size=group_size, bits=int(bits),
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(model.parameters())
    return model


def measure(model, prefill_tokens: int, decode_tokens: int, repeats: int) -> tuple[float, float]:
    import mlx.core as mx

    from rewind.engine.forward import last_logits

    make_prompt_cache = _mlx_lm_module("models.cache").make_prompt_cache
    prompt = mx.array([[(13 * i) % 200000 + 10 for i in range(prefill_tokens)]])
    best_prefill, best_decode = 0.0, 0.0
    for counted in range(repeats + 1):  # round 0 warms up kernels and is not counted
        cache = make_prompt_cache(model)
        started = time.perf_counter()
        logits = last_logits(model, prompt, cache)
        mx.eval(logits)
        prefill = prefill_tokens / (time.perf_counter() - started)
        token = mx.argmax(logits, axis=-1).reshape(1, 1)
        mx.eval(token)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            token = mx.argmax(last_logits(model, token, cache), axis=-1).reshape(1, 1)
            mx.async_eval(token)
        mx.eval(token)
        decode = decode_tokens / (time.perf_counter() - started)
        if counted or repeats == 0:
            best_prefill, best_decode = max(best_prefill, prefill), max(best_decode, decode)
    return best_prefill, best_decode


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    device = str(mx.default_device())
    rows = []
    for form in args.forms:
        model = build(form)
        prefill, decode = measure(model, args.prefill_tokens, args.decode_tokens, args.repeats)
        weight_mb = sum(value.nbytes for _, value in tree_flatten(model.parameters())) / 1e6
        rows.append({"form": form, "weights_mb": round(weight_mb, 1), "prefill_tok_s": round(prefill, 1),
                     "decode_tok_s": round(decode, 1)})
        print(json.dumps(rows[-1]), flush=True)
        del model
        mx.clear_cache()
    result = {"command": "python benchmarks/probes/form_speed.py " + " ".join(sys.argv[1:]), "device": device,
              "machine": platform.platform(), "prefill_tokens": args.prefill_tokens,
              "decode_tokens": args.decode_tokens, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/form_speed.py",
                                     description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv)) or 0


if __name__ == "__main__":
    sys.exit(main())
