"""A tiny random-weight Qwen2.5-VL (or Qwen2-VL, Qwen 3.5, Qwen3-VL) model folder, for vision
tests.

`build_tiny_qwen_vl_model(out_dir)` writes the layout of an mlx-vlm conversion of Qwen2.5-VL:
config.json in HF's flat form (the text fields at the top, `vision_config` nested, rope_scaling
with an `mrope_section`, the image token ids), one safetensors file holding
`language_model.model.*`, `language_model.lm_head.*` and `vision_tower.*`, a tokenizer with
Qwen's vision tokens, and preprocessor_config.json with the min/max pixels. Both loaders read
it: mlx-lm's `qwen2_vl` class (a qwen2 model) keeps the language model, mlx-vlm's classes build
the ViT (rewind.vision.qwen_vl).

Sizes: the language model is 4 qwen2 layers, 64 wide, 4 heads of 16 (mrope_section [2, 3, 3]
over the 8 frequency pairs); the ViT is 2 blocks 32 wide in 14 px patches merged 2x2, with at
most MAX_IMAGE_TOKENS image tokens per image (max_pixels), so a 320x240 image becomes a 6x9 grid
of 54 tokens. `model_type="qwen3_5"` nests the hybrid text model of tiny_models (linear, full,
linear, full; 16 rotary pairs, mrope_section [6, 5, 5] interleaved) under `text_config`, with
Qwen3-VL's ViT. `model_type="qwen3_vl"` (or "qwen3_vl_moe", 4 experts, 2 per token) nests a
qwen3 text model (4 layers of 4 heads of 16, interleaved mrope_section [2, 3, 3]) and that ViT
3 blocks deep with deepstack features from each block (DEEPSTACK_INDEXES), added after the
language model's layers 0-2. Built in about a second; everything is seeded.
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
    _family_config,
    train_tokenizer,
)
from rewind.testing.tiny_vlm import save_random_vlm

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
QWEN_VL_SPECIAL_TOKENS = [*SPECIAL_TOKENS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
PATCH_SIZE = 14
MERGE_SIZE = 2
MAX_IMAGE_TOKENS = 64
MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_5", "qwen3_vl", "qwen3_vl_moe")
# Qwen3-VL: the ViT blocks whose outputs become deepstack features, added after the language
# model's first len(...) layers (3 of 4 here, as the real models add 3).
DEEPSTACK_INDEXES = [0, 1, 2]


def _vision_config(model_type: str, hidden_size: int) -> dict[str, Any]:
    common = {"model_type": model_type, "depth": 2, "num_heads": 2, "patch_size": PATCH_SIZE,
              "spatial_patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
              "temporal_patch_size": 2, "in_channels": 3, "in_chans": 3}
    if model_type == "qwen3_5":
        # Qwen3-VL's ViT (learned position embeddings, no window attention, no deepstack).
        return {**common, "hidden_size": 32, "intermediate_size": 64,
                "out_hidden_size": hidden_size, "num_position_embeddings": 64,
                "deepstack_visual_indexes": []}
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        # The same ViT, one block deeper, with a deepstack merger after each block.
        return {**common, "depth": 3, "hidden_size": 32, "intermediate_size": 64,
                "out_hidden_size": hidden_size, "num_position_embeddings": 64,
                "deepstack_visual_indexes": DEEPSTACK_INDEXES}
    if model_type == "qwen2_5_vl":
        # Window attention over 4x4 merged tokens in block 0, full attention in block 1.
        return {**common, "hidden_size": 32, "intermediate_size": 64,
                "out_hidden_size": hidden_size, "window_size": 112,
                "fullatt_block_indexes": [1], "tokens_per_second": 2}
    # Qwen2-VL names them differently: embed_dim is the ViT's width, hidden_size the output.
    return {**common, "embed_dim": 32, "hidden_size": hidden_size, "mlp_ratio": 2}


def _qwen3_vl_text_config(model_type: str, hidden_size: int, ids: dict[str, Any]
                          ) -> dict[str, Any]:
    """Qwen3-VL's text model as its checkpoints nest it: a qwen3 (q/k norms), 4 layers of 4
    heads of 16, interleaved mrope over the 8 rotary pairs; the MoE form routes each token to
    2 of 4 experts in every layer."""
    text = {
        "model_type": f"{model_type}_text", "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
    }
    if model_type == "qwen3_vl_moe":
        text.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True})
    return text


def tiny_qwen_vl_config(special_ids: dict[str, int], model_type: str = "qwen2_5_vl"
                        ) -> dict[str, Any]:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}")
    hidden_size = 64
    ids = {
        "image_token_id": special_ids[IMAGE_PAD],
        "video_token_id": special_ids[VIDEO_PAD],
        "vision_start_token_id": special_ids[VISION_START],
        "vision_end_token_id": special_ids[VISION_END],
        "bos_token_id": special_ids[BOS],
        "eos_token_id": [special_ids[TURN_END], special_ids[EOS]],
        "pad_token_id": special_ids[PAD],
    }
    if model_type == "qwen3_5":
        # The hybrid text model of tiny_models (linear, full, linear, full), nested as Qwen 3.5
        # vision checkpoints nest it, with interleaved mrope over its 16 rotary pairs.
        text = _family_config("qwen3_5")
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [6, 5, 5],
                                   "mrope_interleaved": True}
        text["eos_token_id"] = ids["eos_token_id"]
        return {"model_type": "qwen3_5",
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": text, "vision_config": _vision_config(model_type, hidden_size),
                "tie_word_embeddings": False, **ids}
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        return {"model_type": model_type,
                "architectures": ["Qwen3VLForConditionalGeneration" if model_type == "qwen3_vl"
                                  else "Qwen3VLMoeForConditionalGeneration"],
                "text_config": _qwen3_vl_text_config(model_type, hidden_size, ids),
                "vision_config": _vision_config(model_type, hidden_size),
                "tie_word_embeddings": False, **ids}
    architecture = ("Qwen2_5_VLForConditionalGeneration" if model_type == "qwen2_5_vl"
                    else "Qwen2VLForConditionalGeneration")
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "vision_config": _vision_config(model_type, hidden_size),
        **ids,
    }


def _preprocessor_config() -> dict[str, Any]:
    # Qwen2-VL's processor: CLIP's mean/std, sizes in multiples of patch * merge = 28 px.
    unit = PATCH_SIZE * MERGE_SIZE
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "min_pixels": unit * unit * 4,
        "max_pixels": unit * unit * MAX_IMAGE_TOKENS,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }


def build_tiny_qwen_vl_model(out_dir: Path, model_type: str = "qwen2_5_vl", seed: int = SEED,
                             gain: float = WEIGHT_GAIN) -> Path:
    """Write the tiny `model_type` (MODEL_TYPES) model into `out_dir` and return `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special_ids = train_tokenizer(out_dir, QWEN_VL_SPECIAL_TOKENS)
    config = tiny_qwen_vl_config(special_ids, model_type)
    save_random_vlm(config, out_dir, seed, gain)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(), indent=2))
    return out_dir
