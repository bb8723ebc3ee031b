"""The models `rewind bench decode-scaling` measures: random-weight bf16 models of real shapes
(and the tiny ones of --quick), built on disk and loaded with Rewind's loader, and the random
prompts they are fed.

Why random weights: speed does not depend on the values, and the GPU machine has no registry to
fetch real ones.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

# Real shapes. Llama-3.2-1B's config (rope scaling left out: it changes a constant, not the work).
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
            "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
            "max_position_embeddings": 131072}
# Qwen 3.5 0.8B: benchmarks/probes/gated_delta.py's MODEL_SIZES["0.8b"] with the real 248,320-word
# tied vocabulary (that probe cut it to 32k; here the head is a third of the bytes read per step).
QWEN35_08B = {"hidden_size": 1024, "num_hidden_layers": 24, "full_attention_interval": 4,
              "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 256, "linear_num_value_heads": 16, "linear_num_key_heads": 16,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "vocab_size": 248320, "tie_word_embeddings": True,
              "max_position_embeddings": 262144}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("llama", LLAMA_1B),
    "qwen3.5-0.8b": ("qwen3_5", QWEN35_08B),
}
# --quick: the tiny test shapes (vocabulary widened so random ids are not all special tokens).
QUICK_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("llama", {"vocab_size": 4096, "tie_word_embeddings": True}),
    "qwen3.5-tiny": ("qwen3_5", {"vocab_size": 4096, "tie_word_embeddings": True}),
}
FIRST_FREE_ID = 16  # prompt ids above the tiny tokenizer's special tokens


def build_model(name: str, family: str, overrides: dict[str, Any], work_dir: Path) -> Any:
    """A random-weight model folder of this shape, loaded by Rewind's loader (bf16 on a GPU)."""
    from rewind.models.loader import load_model
    from rewind.testing.tiny_models import build_tiny_model

    folder = work_dir / name
    if not (folder / "config.json").exists():
        build_tiny_model(family, folder, overrides=overrides)
    return load_model(str(folder))


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (a new seed per run, so the prompt cache never shares them)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_FREE_ID, vocab) for _ in range(length)] for _ in range(count)]


def eos_ids(loaded: Any) -> list[int]:
    from rewind.engine.engine import _eos_token_ids

    return sorted(_eos_token_ids(loaded.tokenizer, loaded.config))
