"""A tiny random-weight Gemma 4 vision-language model folder (`model_type` "gemma4"), for fast
vision tests.

`build_tiny_gemma4_model(out_dir)` writes the layout of an mlx-vlm conversion of Gemma 4:
config.json (`text_config`, `vision_config`, the image/audio/video token ids), one safetensors
file holding mlx-vlm's parameter names (`language_model.model.*`, `vision_tower.*`,
`embed_vision.*`), a tokenizer with Gemma 4's image, audio and video tokens, and the processor's
processor_config.json. Both loaders read it: mlx-lm's `gemma4` class keeps the language model
(the engine's text path), mlx-vlm's Gemma 4 classes build the tower and embedder
(rewind.vision.gemma4).

Sizes: the language model is 6 layers 64 wide (sliding window 64 with layers 2 and 5 global,
the last 2 layers sharing the KV of the earlier layers of their type, per-layer inputs (PLE) 16
wide, global layers with a wider head and proportional partial rotary); the tower is 2 layers 32
wide over 8 px patches pooled 3x3, so one image token per 24x24 px of the resized image and at
most MAX_SOFT_TOKENS (40) per image: a 320x240 image is resized to 168x120, 7 x 5 = 35 tokens.
Built in about a second; everything is seeded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rewind.testing.tiny_models import (
    BOS,
    EOS,
    PAD,
    SEED,
    SPECIAL_TOKENS,
    TURN_END,
    VOCAB_SIZE,
    WEIGHT_GAIN,
    train_tokenizer,
)
from rewind.testing.tiny_vlm import save_random_vlm

# Gemma 4's multimodal tokens (the real tokenizer's spellings).
BOI, EOI, IMAGE_TOKEN = "<|image>", "<image|>", "<|image|>"
BOA, EOA, AUDIO_TOKEN = "<|audio>", "<audio|>", "<|audio|>"
VIDEO_TOKEN = "<|video|>"
GEMMA4_SPECIAL_TOKENS = [*SPECIAL_TOKENS, BOI, EOI, IMAGE_TOKEN, BOA, EOA, AUDIO_TOKEN,
                         VIDEO_TOKEN]
PATCH_SIZE = 8
POOLING = 3
MAX_SOFT_TOKENS = 40
HIDDEN_SIZE = 64
PER_LAYER_INPUT = 16
SLIDING_WINDOW = 64
EMBEDDING_SHRINK = 0.3  # see _shrink_embeddings


def tiny_gemma4_text_config() -> dict[str, Any]:
    return {
        "model_type": "gemma4_text",
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,  # layers 4 and 5 reuse layer 3's and layer 2's K/V
        "hidden_size_per_layer_input": PER_LAYER_INPUT,
        "vocab_size": VOCAB_SIZE,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0,
                                  "rope_type": "default"},
        },
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        # The small Gemma 4 models leave it unset: causal attention over image tokens too.
        "use_bidirectional_attention": None,
        "tie_word_embeddings": True,
    }


def tiny_gemma4_vision_config() -> dict[str, Any]:
    return {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": PATCH_SIZE,
        "pooling_kernel_size": POOLING,
        "default_output_length": MAX_SOFT_TOKENS,
        "position_embedding_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "use_clipped_linears": False,
        "standardize": False,
    }


def tiny_gemma4_config(special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": tiny_gemma4_text_config(),
        "vision_config": tiny_gemma4_vision_config(),
        "audio_config": None,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "image_token_id": special_ids[IMAGE_TOKEN],
        "boi_token_id": special_ids[BOI],
        "eoi_token_id": special_ids[EOI],
        "audio_token_id": special_ids[AUDIO_TOKEN],
        "boa_token_id": special_ids[BOA],
        "eoa_token_id": special_ids[EOA],
        "video_token_id": special_ids[VIDEO_TOKEN],
        "vision_soft_tokens_per_image": MAX_SOFT_TOKENS,
        "bos_token_id": special_ids[BOS],
        "eos_token_id": [special_ids[TURN_END], special_ids[EOS]],
        "pad_token_id": special_ids[PAD],
        "tie_word_embeddings": True,
    }


def _processor_config() -> dict[str, Any]:
    # Gemma 4's processor: aspect-ratio preserving resize to at most max_soft_tokens x pooling^2
    # patches, sides whole multiples of pooling x patch pixels; rescale to [0, 1], no
    # normalization (the tower maps pixels to [-1, 1] itself).
    return {
        "processor_class": "Gemma4Processor",
        "image_seq_length": MAX_SOFT_TOKENS,
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": False,
            "image_mean": [0.0, 0.0, 0.0],
            "image_std": [1.0, 1.0, 1.0],
            "patch_size": PATCH_SIZE,
            "pooling_kernel_size": POOLING,
            "max_soft_tokens": MAX_SOFT_TOKENS,
        },
    }


def _shrink_embeddings(weights_file: Path) -> None:
    """Scale the (tied) token embedding table by EMBEDDING_SHRINK. Gemma 4 multiplies input
    embeddings by sqrt(hidden) and norms every sublayer's output before adding it, so with the
    gain of the other tiny models the token's own embedding dominates the residual stream and
    greedy decoding repeats one token; smaller embeddings give varied greedy sequences (which
    the equivalence tests compare)."""
    import mlx.core as mx

    weights = mx.load(str(weights_file))
    name = "language_model.model.embed_tokens.weight"
    weights[name] = weights[name] * EMBEDDING_SHRINK
    mx.eval(weights)
    mx.save_safetensors(str(weights_file), weights, metadata={"format": "mlx"})


def build_tiny_gemma4_model(out_dir: Path, seed: int = SEED, gain: float = WEIGHT_GAIN) -> Path:
    """Write the tiny Gemma 4 vision model into `out_dir` and return `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # What Gemma 4's processors read to expand image (and audio, video) placeholders.
    token_names = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN,
                   "boa_token": BOA, "eoa_token": EOA, "audio_token": AUDIO_TOKEN,
                   "video_token": VIDEO_TOKEN}
    special_ids = train_tokenizer(out_dir, GEMMA4_SPECIAL_TOKENS, token_names)
    config = tiny_gemma4_config(special_ids)
    save_random_vlm(config, out_dir, seed, gain)
    _shrink_embeddings(out_dir / "model.safetensors")
    (out_dir / "processor_config.json").write_text(json.dumps(_processor_config(), indent=2))
    return out_dir
