"""Model folders that leave config fields to transformers' defaults load through Rewind's loader:
llava-hf's LLaVA 1.5 and LLaVA-NeXT leave their language model's sizes out of `text_config`,
which mlx-lm requires."""

from __future__ import annotations

import json

import pytest

from rewind.models.folder_quirks import model_config_overrides

# llava-hf/llava-1.5-7b-hf's config.json as published (the text model's sizes are absent).
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                      "vocab_size": 32000},
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}


def test_llava_15_gets_llamaconfig_defaults_for_what_it_leaves_out():
    text = model_config_overrides(LLAVA_15_7B)["text_config"]
    assert text == {**LLAVA_15_7B["text_config"], "hidden_size": 4096, "num_hidden_layers": 32,
                    "intermediate_size": 11008, "num_attention_heads": 32,
                    "rope_theta": 10000.0}
    assert text["rms_norm_eps"] == 1e-5  # what the folder states is kept


def test_vocabulary_from_the_top_level_and_other_folders_untouched():
    bare = {"model_type": "llava", "vocab_size": 32064, "text_config": {"model_type": "llama"}}
    text = model_config_overrides(bare)["text_config"]
    assert (text["vocab_size"], text["max_position_embeddings"], text["rms_norm_eps"]) == (
        32064, 4096, 1e-6)
    assert model_config_overrides({"model_type": "llava"})["text_config"]["model_type"] == "llama"
    complete = {"model_type": "llava", "text_config": text}
    assert model_config_overrides(complete) == {}
    assert model_config_overrides({"model_type": "llava",
                                   "text_config": {"model_type": "qwen2"}}) == {}
    assert model_config_overrides({"model_type": "llama"}) == {}


# llava-hf/llava-v1.6-mistral-7b-hf's text_config in form: the mistral's width, depth and head
# count are left to MistralConfig's defaults.
LLAVA_NEXT_MISTRAL_TEXT = {
    "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
    "architectures": ["MistralForCausalLM"],
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "vocab_size": 32064,
}


def test_llava_next_gets_mistral_and_llama_defaults_and_its_loader_classes():
    from rewind.models.folder_quirks import model_classes
    from rewind.models.llava_next_text import get_model_classes

    config = {"model_type": "llava_next", "text_config": LLAVA_NEXT_MISTRAL_TEXT,
              "vocab_size": 32064}
    text = model_config_overrides(config)["text_config"]
    assert text == {**LLAVA_NEXT_MISTRAL_TEXT, "hidden_size": 4096, "num_hidden_layers": 32,
                    "num_attention_heads": 32}
    vicuna = {**LLAVA_15_7B, "model_type": "llava_next"}  # llava-v1.6-vicuna-7b: as LLaVA 1.5
    assert model_config_overrides(vicuna) == model_config_overrides(LLAVA_15_7B)
    # transformers 5 keeps the rope's base in rope_parameters, which mlx-lm does not read.
    saved_by_v5 = {"model_type": "llava_next", "text_config": {
        "model_type": "mistral", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}}
    assert model_config_overrides(saved_by_v5)["text_config"]["rope_theta"] == 1e6
    assert model_classes(config) is get_model_classes
    assert model_classes(LLAVA_15_7B) is None  # mlx-lm has LLaVA 1.5's class


# ---- a tiny folder with the quirk, through the real loaders -----------------------------------

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from rewind.testing.tiny_vlm import build_tiny_vlm_model

    stated = build_tiny_vlm_model(tmp_path_factory.mktemp("llava-stated"), "llava")
    defaulted = build_tiny_vlm_model(tmp_path_factory.mktemp("llava-defaults"), "llava",
                                     text_defaults=True)
    return stated, defaulted


def test_mlx_lm_alone_refuses_the_folder(folders):
    from mlx_lm.utils import load

    from rewind.testing.tiny_vlm import TEXT_DEFAULTED

    _, defaulted = folders
    text = json.loads((defaulted / "config.json").read_text())["text_config"]
    assert not set(TEXT_DEFAULTED) & set(text)
    with pytest.raises(TypeError, match="rms_norm_eps"):
        load(str(defaulted))


def test_the_folder_loads_and_computes_as_with_its_fields_stated(folders):
    import mlx.core as mx
    import numpy as np
    from vision_helpers import image_prompt, picture

    from rewind.models.loader import load_model
    from rewind.vision.vlm import adapter_for

    stated, defaulted = folders
    models = [load_model(str(folder)) for folder in (stated, defaulted)]
    visions = [(loaded, adapter_for(loaded)) for loaded in models]
    prompts = [image_prompt(vision, ["Look: ", picture(1), " what is it?"]) for vision in visions]
    assert prompts[0].tokens == prompts[1].tokens
    ids = mx.array([prompts[0].tokens])
    logits = [loaded.model(ids, input_embeddings=prompt.embed(0, len(prompt.tokens)))
              for loaded, prompt in zip(models, prompts)]
    np.testing.assert_allclose(np.array(logits[1]), np.array(logits[0]), atol=1e-5)
    text = [loaded.model(ids) for loaded in models]  # the text path too
    np.testing.assert_allclose(np.array(text[1]), np.array(text[0]), atol=1e-5)
