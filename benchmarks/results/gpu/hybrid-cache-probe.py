# Where the cached path of the prompt-cache bench spends its time on a fast GPU: the same 10 agent turns twice
# (a fresh PromptCache each pass), timing PromptCache.checkpoint and .restore, with two no-cache runs at turns
# 1, 5 and 10. Run on the H200 from the repository root: PYTHONPATH=src python3 benchmarks/results/gpu/hybrid-cache-probe.py
import sys, tempfile, time
from pathlib import Path
import mlx.core as mx
from rewind.bench.prompt_cache_bench import session_prompts, _timed_prefill
from rewind.cache import PromptCache
from rewind.cache import prompt_cache as pc_module
from rewind.config import CacheConfig
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model
folder = Path("/tmp/q35-2b")
if sys.argv[1:] == ["tiny"]:
    folder = Path("/tmp/q35-tiny-probe")
    if not (folder / "config.json").exists():
        build_tiny_model("qwen3_5", folder)
elif not (folder / "config.json").exists():
    build_tiny_model("qwen3_5", folder, overrides={"hidden_size": 2048, "num_hidden_layers": 24, "full_attention_interval": 4, "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 32000})
loaded = load_model(str(folder))
prompts = session_prompts(loaded.tokenizer, 10, 1000, 700)
spent = {"checkpoint": 0.0, "restore": 0.0}
orig_cp, orig_rs = PromptCache.checkpoint, PromptCache.restore
def cp(self, *a, **k):
    t = time.perf_counter(); r = orig_cp(self, *a, **k); spent["checkpoint"] += time.perf_counter() - t; return r
def rs(self, *a, **k):
    t = time.perf_counter(); r = orig_rs(self, *a, **k); spent["restore"] += time.perf_counter() - t; return r
PromptCache.checkpoint, PromptCache.restore = cp, rs
for rep in range(2):
    cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(cache_dir=Path(tempfile.mkdtemp()), disk_bytes=8 << 30))
    for n, (tokens, boundary) in enumerate(prompts, 1):
        spent.update(checkpoint=0.0, restore=0.0)
        s, r = _timed_prefill(loaded.model, tokens, boundary, cache)
        line = f"pass {rep+1} turn {n}: {len(tokens)} tok, restored {r.restored.tokens}, cached {s:.3f}s (checkpoint {spent['checkpoint']:.3f}, restore {spent['restore']:.3f})"
        if n in (1, 5, 10):
            s2, _ = _timed_prefill(loaded.model, tokens, boundary, None)
            s3, _ = _timed_prefill(loaded.model, tokens, boundary, None)
            line += f"  no cache {s2:.3f}s then {s3:.3f}s"
        print(line, flush=True)
    cache.close()
