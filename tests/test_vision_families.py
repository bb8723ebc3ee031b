"""LLaVA, Pixtral, Mistral 3 (with Mistral's or Ministral 3's text model), Idefics 3 and SmolVLM
image prompts (1-D positions; input embeddings only): the prompt layout and pixels equal
mlx-vlm's own processors' (Pixtral's row breaks included; Idefics 3's tiles in
tests/test_vision_idefics3.py), embeddings, logits and greedy decode equal mlx-vlm's own model,
and the prompt cache never changes an answer (repeat, a restore inside an image span, the next
turn, another image at the same place), batched with text requests or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from vision_helpers import (
    TIMEOUT,
    assert_prompt_cache_keeps_image_answers,
    batched_equals_alone,
    generation,
    image_prompt,
    mlx_vlm_embeddings,
    mlx_vlm_greedy,
    picture,
    prefix_of,
    processed_by_mlx_vlm,
    text_parts,
    two_image_prompts,
    two_image_text,
)

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rewind.config import EngineConfig  # noqa: E402
from rewind.engine import Engine  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_idefics3 import MODEL_TYPES as IDEFICS3_TYPES  # noqa: E402
from rewind.testing.tiny_idefics3 import build_tiny_idefics3_model  # noqa: E402
from rewind.testing.tiny_vlm import (  # noqa: E402
    IMG_BREAK,
    IMG_END,
    LLAVA_IMAGE_TOKENS,
    VARIANTS,
    build_tiny_vlm_model,
)
from rewind.vision.vlm import (  # noqa: E402
    VisionUnavailableError,
    adapter_for,
    load_vision_adapter,
)


@pytest.fixture(scope="module", params=[*VARIANTS, *IDEFICS3_TYPES])
def vision(request, tmp_path_factory):
    variant = request.param
    out_dir = tmp_path_factory.mktemp(f"tiny-{variant}")
    folder = (build_tiny_idefics3_model(out_dir, variant) if variant in IDEFICS3_TYPES
              else build_tiny_vlm_model(out_dir, variant))
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


def model_type(vision) -> str:
    return vision[0].config["model_type"]


# ---- the adapter against mlx-vlm --------------------------------------------------------------


def test_layout_and_pixels_equal_mlx_vlm_processor(vision):
    """Two images of different sizes: the expanded tokens are what mlx-vlm's processor writes
    for the same text, and each image's pixels are its (unpadded) pixels."""
    if model_type(vision) in IDEFICS3_TYPES:
        pytest.skip("tiles and their markers: tests/test_vision_idefics3.py")
    loaded, adapter = vision
    images = [picture(1), picture(2, (200, 330))]
    text = two_image_text(vision)
    processed = processed_by_mlx_vlm(vision, text, images)
    prompt = adapter.expand(list(loaded.tokenizer.encode(text)), images)
    assert prompt.tokens == processed["input_ids"][0].tolist()
    for index, (image, span) in enumerate(zip(images, prompt.spans)):
        ours = adapter.preprocess(image)
        pixels = ours[0] if isinstance(ours, tuple) else ours
        height, width = pixels.shape[:2]
        theirs = processed["pixel_values"][index][:, :height, :width].transpose(1, 2, 0)
        np.testing.assert_allclose(pixels, theirs, atol=1e-6)
        span_tokens = prompt.tokens[span.start:span.end]
        image_tokens = sum(1 for t in span_tokens if t == adapter.image_token_id)
        if model_type(vision) == "llava":
            assert span_tokens == [adapter.image_token_id] * LLAVA_IMAGE_TOKENS
            continue
        # Pixtral / Mistral 3: rows of image tokens, [IMG_BREAK] between rows, [IMG_END] after.
        token_px = adapter.token_pixels
        rows, columns = height // token_px, width // token_px
        assert (image_tokens, len(span_tokens)) == (rows * columns, rows * columns + rows - 1)
        row_break = loaded.tokenizer.convert_tokens_to_ids(IMG_BREAK)
        assert [i for i, t in enumerate(span_tokens) if t == row_break] == [
            (columns + 1) * row - 1 for row in range(1, rows)]
        assert prompt.tokens[span.end] == loaded.tokenizer.convert_tokens_to_ids(IMG_END)
    if model_type(vision) == "mistral3":
        # 320x240 fits 224 px as 224x168: 8 columns and 6 rows of 28 px tokens.
        assert prompt.spans[0].end - prompt.spans[0].start == 6 * 8 + 5


def test_embeddings_and_logits_equal_mlx_vlm(vision):
    """Our split (mlx-vlm's tower and projector -> embeddings -> mlx-lm's language model)
    computes what mlx-vlm's whole model computes from its own processor's output."""
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    images = [picture(3), picture(4, (200, 330))]
    text = two_image_text(vision)
    processed = processed_by_mlx_vlm(vision, text, images)
    reference_model = load_vlm(Path(loaded.path))
    expected_embeddings = mlx_vlm_embeddings(reference_model, processed)
    prompt = image_prompt(vision, text_parts(vision, text, images))
    ours = prompt.embed(0, len(prompt.tokens))
    np.testing.assert_allclose(np.array(ours), np.array(expected_embeddings), atol=1e-5)
    ids = mx.array([prompt.tokens])
    expected = reference_model.language_model(ids, inputs_embeds=expected_embeddings).logits
    logits = loaded.model(ids, input_embeddings=ours)
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-3)
    # The image matters (this test can fail): another picture changes the last logits.
    other = image_prompt(vision, text_parts(vision, text, [picture(5), images[1]]))
    changed = loaded.model(ids, input_embeddings=other.embed(0, len(other.tokens)))
    assert np.abs(np.array(changed[0, -1]) - np.array(logits[0, -1])).max() > 0.1


def test_greedy_decode_after_the_image_equals_mlx_vlm(vision):
    """mlx-vlm's language model prefilled with its own embeddings, then decoded greedily with
    its caches: the engine gives the same tokens and log-probabilities."""
    from mlx_lm.models.cache import KVCache
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    prompt = image_prompt(vision, [prefix_of(loaded, 40), picture(6), " describe it"])
    reference_model = load_vlm(Path(loaded.path))
    language = reference_model.language_model
    cache = (language.make_cache() if hasattr(language, "make_cache")
             else [KVCache() for _ in reference_model.layers])
    embeddings = prompt.embed(0, len(prompt.tokens))  # equal to mlx-vlm's (the test above)
    logits = language(mx.array([prompt.tokens]), inputs_embeds=embeddings, cache=cache).logits
    expected, expected_logprobs = mlx_vlm_greedy(language, logits, cache)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(generation(prompt), TIMEOUT)
    assert ours.tokens == expected
    np.testing.assert_allclose(ours.logprobs, expected_logprobs, atol=2e-3)


def test_the_language_model_takes_the_engines_backbone_then_head_path(vision):
    """Prefill computes the logits of the last position only (mlx-lm's llama under the names
    `mistral` and `ministral3` included), not the whole vocabulary at every image token."""
    from rewind.kernels.model_split import split_model

    assert split_model(vision[0].model) is not None


def test_unsupported_vision_family_names_the_supported_ones(tmp_path):
    config = {"model_type": "llava_onevision",
              "vision_config": {"model_type": "siglip_vision_model"}}
    with pytest.raises(VisionUnavailableError, match=r"'llava_onevision' is not supported.*"
                                                     r"Gemma 3.*qwen2_5_vl.*qwen3_vl.*llava.*"
                                                     r"llava_next.*pixtral.*mistral3.*"
                                                     r"idefics3, smolvlm"):
        load_vision_adapter(tmp_path, config, mx.float32)


def test_llava_with_a_language_model_mlx_lm_cannot_load_is_refused(tmp_path):
    config = {"model_type": "llava", "text_config": {"model_type": "qwen2"},
              "vision_config": {"model_type": "clip_vision_model"}}
    with pytest.raises(VisionUnavailableError, match="'qwen2' language model"):
        load_vision_adapter(tmp_path, config, mx.float32)


# ---- the engine and the prompt cache ----------------------------------------------------------


def test_prompt_cache_never_changes_an_image_answer(vision, tmp_path):
    """Repeat, a restore inside the image span (Pixtral's break tokens included), the next
    turn, another image at the same place."""
    assert_prompt_cache_keeps_image_answers(vision, tmp_path)


def test_image_and_text_requests_batched_equal_one_at_a_time(vision, tmp_path):
    batched_equals_alone(vision, two_image_prompts(vision), tmp_path)
