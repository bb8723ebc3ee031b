"""Build a random-weight Qwen 3.5-like hybrid model (~0.5B parameters) for GPU timing runs:
`python benchmarks/gpu/build_random_hybrid.py OUT_DIR`. Random weights: only timings mean anything."""
import sys, json
from pathlib import Path
from rewind.testing.tiny_models import build_tiny_model
# A Qwen 3.5-like hybrid of ~0.8B parameters (random weights: timings only).
over = {"hidden_size": 1024, "num_hidden_layers": 24, "full_attention_interval": 4,
        "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
p = build_tiny_model("qwen3_5", Path(sys.argv[1]), overrides=over)
size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
print("built", p, f"{size/1e9:.2f} GB float32")
