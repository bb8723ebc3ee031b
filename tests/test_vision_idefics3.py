"""Idefics 3 and SmolVLM: the folders load (mlx-lm has no class for them: its llama under their
weight names, rewind.models.idefics3_text) and compute as mlx-vlm's language model, and an
image becomes what mlx-vlm's own processor makes of it: tiles with row/column markers and a
global image (or one frame without splitting), the same pixels. Embeddings, logits, greedy
decode, the prompt cache and batching: tests/test_vision_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from vision_helpers import copy_with_weight_names, picture, processed_by_mlx_vlm, two_image_text

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_idefics3 import (  # noqa: E402
    MODEL_TYPES,
    TOKENS_PER_TILE,
    build_tiny_idefics3_model,
)
from rewind.vision.vlm import adapter_for  # noqa: E402


@pytest.fixture(scope="module", params=MODEL_TYPES)
def vision(request, tmp_path_factory):
    folder = build_tiny_idefics3_model(tmp_path_factory.mktemp(f"tiny-{request.param}"),
                                       request.param)
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


def reference_model(vision):
    from mlx_vlm.utils import load_model as load_vlm

    return load_vlm(Path(vision[0].path))


# ---- loading -----------------------------------------------------------------------------------


def test_the_language_model_is_mlx_lms_llama_and_computes_as_mlx_vlms(vision):
    from mlx_lm.models import llama

    from rewind.kernels.model_split import split_model

    loaded, _ = vision
    assert isinstance(loaded.model, llama.Model)
    assert split_model(loaded.model) is not None  # prefill computes the last logits only
    ids = mx.array([loaded.tokenizer.encode("The weather in Berlin is cloudy")])
    expected = reference_model(vision).language_model(ids).logits
    np.testing.assert_allclose(np.array(loaded.model(ids)), np.array(expected), atol=1e-4)


def test_hugging_face_weight_names_load_too(vision, tmp_path):
    """The same weights under transformers' names (model.text_model.*, lm_head, the tower
    under model.vision_model.*): the same language model."""
    loaded, _ = vision
    copy_with_weight_names(Path(loaded.path), tmp_path, "model.text_model.")
    hf = load_model(str(tmp_path))
    ids = mx.array([loaded.tokenizer.encode("def fibonacci(n: int) -> int:")])
    np.testing.assert_allclose(np.array(hf.model(ids)), np.array(loaded.model(ids)), atol=1e-5)


# ---- the adapter against mlx-vlm --------------------------------------------------------------


def test_layout_and_pixels_equal_mlx_vlm_processor(vision):
    """Images of several sizes (and, with splitting off, one frame each): the expanded tokens
    are what mlx-vlm's processor writes for the same text; the frames are its pixels."""
    from mlx_vlm.utils import load_processor

    loaded, adapter = vision
    text = two_image_text(vision)
    tokens = list(loaded.tokenizer.encode(text))
    theirs = load_processor(Path(loaded.path))
    for sizes, tiles in [(((320, 240), (200, 330)), [(2, 2), (2, 2)]),
                         (((1000, 90), (60, 700)), [(1, 2), (2, 1)])]:
        images = [picture(seed, size) for seed, size in enumerate(sizes)]
        processed = processed_by_mlx_vlm(vision, text, images, theirs)
        assert adapter.expand(tokens, images).tokens == processed["input_ids"][0].tolist()
        assert [adapter.tiles(image) for image in images] == tiles
        frames = np.concatenate([adapter.preprocess(image) for image in images])
        np.testing.assert_allclose(frames, processed["pixel_values"][0].transpose(0, 2, 3, 1),
                                   atol=1e-6)
    prompt = adapter.expand(tokens, images)
    span = prompt.tokens[prompt.spans[0].start:prompt.spans[0].end]
    assert sum(1 for t in span if t == adapter.image_token_id) == 3 * TOKENS_PER_TILE
    for processor in (adapter.processor, theirs.image_processor):
        processor.do_image_splitting = False
    try:
        images = [picture(3), picture(4, (200, 330))]
        processed = processed_by_mlx_vlm(vision, text, images, theirs)
        prompt = adapter.expand(tokens, images)
        assert prompt.tokens == processed["input_ids"][0].tolist()
        assert prompt.image_tokens == 2 * (TOKENS_PER_TILE + 3)  # <fake><global-img> .. <fake>
        frames = np.concatenate([adapter.preprocess(image) for image in images])
        np.testing.assert_allclose(frames, processed["pixel_values"][0].transpose(0, 2, 3, 1),
                                   atol=1e-6)
    finally:
        adapter.processor.do_image_splitting = True
