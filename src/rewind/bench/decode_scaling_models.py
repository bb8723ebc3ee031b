"""The models `rewind bench decode-scaling` measures: random-weight bf16 models of real shapes
(and the tiny ones of --quick), built on disk and loaded with Rewind's loader, and the random
prompts they are fed.

Why random weights: speed does not depend on the values, and the GPU machine has no registry to
fetch real ones.
"""

from __future__ import annotations

import json
import os
import random
import shutil
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


def build_served_model(shape: str, work_dir: Path) -> Path:
    """A random-weight bf16 model folder of this shape for the side-by-side servers (`rewind
    bench agentic --random-model`): every id of its head a token that decodes to text, and for a
    Llama shape llama.cpp's F16 GGUF beside the weights as model.gguf (what
    servers.resolve_model_files takes). Built once: an existing folder is reused.

    The tiny tokenizer (512 ids) and its ChatML template with <think> tags serve both Rewind
    and llama-server (--jinja --chat-template-file).
    """
    from rewind.bench.decode_scaling_llama_cpp import write_f16_gguf
    from rewind.testing.tiny_models import build_tiny_model

    family, overrides = {**SHAPES, **QUICK_SHAPES}[shape]
    folder = work_dir / f"{shape}-bf16-served"
    if folder.is_dir():
        return folder  # renamed into place only once complete
    partial = work_dir / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    build_tiny_model(family, partial, overrides=overrides, dtype="bfloat16")
    pad_vocabulary(partial, int(json.loads((partial / "config.json").read_text())["vocab_size"]))
    if family == "llama":
        write_f16_gguf(partial, partial / "model.gguf")
    os.replace(partial, folder)
    return folder


def pad_vocabulary(folder: Path, size: int) -> None:
    """Gives every id below `size` a token in tokenizer.json: " w<id>", never made by encoding
    (the pre-tokenizer splits letters from digits, and no merge makes it), decoded to text.

    Why: the random head picks ids all over a real vocabulary, and ids without a token decode to
    nothing on Rewind and on llama-server (llama.cpp's padding tokens are UNUSED, which it
    prints as nothing), so nearly every token would stream no text, and the time to the first
    text and the gaps between tokens could not be measured.
    """
    path = folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in tokenizer.get("added_tokens", [])}
    for index in range(size):
        if index not in taken:
            name = f"\u0120w{index}"  # byte-level BPE's spelling of " w<id>"
            if name in vocab:
                raise ValueError(f"{name!r} is already a token of {path}")
            vocab[name] = index
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (a new seed per run, so the prompt cache never shares them)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_FREE_ID, vocab) for _ in range(length)] for _ in range(count)]


def eos_ids(loaded: Any) -> list[int]:
    from rewind.engine.engine import _eos_token_ids

    return sorted(_eos_token_ids(loaded.tokenizer, loaded.config))
