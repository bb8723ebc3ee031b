# The Gemma 4 split (backbone, head, soft-capping) on this CPU: a random Gemma 4 E2B-width model (10 layers,
# 262k vocabulary, per-layer inputs), bf16. Run from the repository root with OpenBLAS preloaded:
#   LD_PRELOAD=$(.venv/bin/python -m rewind.blas --preload-value) PYTHONPATH=src .venv/bin/python benchmarks/results/gemma4-split.py
import time
from pathlib import Path
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from rewind.testing.tiny_models import build_tiny_model
from rewind.models.conversion import convert, QuantSpec
from rewind.models.loader import load_model, describe_compute
from rewind.engine.forward import last_logits, prefill
ov = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "hidden_size": 1536,
      "num_hidden_layers": 10, "sliding_window": 512, "sliding_window_pattern": 5, "num_kv_shared_layers": 4,
      "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
      "global_head_dim": 512, "hidden_size_per_layer_input": 256, "vocab_size": 262144,
      "vocab_size_per_layer_input": 262144, "tie_word_embeddings": True}
src, bf = Path("/tmp/g4e2b-f32"), Path("/tmp/g4e2b-bf16")
if not (bf / "config.json").exists():
    build_tiny_model("gemma3", src, overrides=ov); convert(src, bf, QuantSpec(16), show_progress=False)
loaded = load_model(str(bf)); m = loaded.model
print(describe_compute(m))
toks = mx.array([[3 + (i * 7919) % 200000 for i in range(256)]])
def timed(label, fn, n=3):
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    print(f"{label}: {min(ts)*1000:.0f} ms"); return min(ts)
def full_last():
    c = make_prompt_cache(m); mx.eval(m(toks, cache=c)[:, -1, :])
def split_last():
    c = make_prompt_cache(m); mx.eval(last_logits(m, toks, c))
a = timed("256-token chunk, full model call then last position (before)", full_last)
b = timed("256-token chunk, last_logits (split)", split_last)
c = make_prompt_cache(m); prefill(m, toks, c)
def full_step(): mx.eval(m(mx.array([[5]]), cache=c)[:, -1, :])
def split_step(): mx.eval(last_logits(m, mx.array([[5]]), c))
d = timed("decode step, full model call (before)", full_step, 5)
e = timed("decode step, last_logits (split, fast head)", split_step, 5)
print(f"chunk x{a/b:.2f}  decode x{d/e:.2f}")
