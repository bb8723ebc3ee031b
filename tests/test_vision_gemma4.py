"""Gemma 4 image prompts (rewind.vision.gemma4) on a tiny random-weight folder (sliding window 64,
KV-shared layers, per-layer inputs): the prompt layout and pixels equal mlx-vlm's processor's,
logits and greedy decode equal mlx-vlm's own Gemma 4 model (which scales text embeddings but not
image features, and looks per-layer inputs up with image tokens as id 0), the prompt cache never
changes an answer, image and text requests batch, text requests keep working, and the live
server takes an OpenAI data-URL image."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from vision_helpers import (
    TIMEOUT,
    FILLER,
    answer,
    assert_prompt_cache_keeps_image_answers,
    batched_equals_alone,
    encode,
    generation,
    image_prompt,
    live_vision_server,
    mlx_vlm_greedy,
    picture,
    text_parts,
    two_image_prompts,
    user_with_image,
)

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rewind.config import EngineConfig  # noqa: E402
from rewind.engine import Engine, GenerationRequest, InvalidRequestError  # noqa: E402
from rewind.engine import SamplingParams  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_gemma4 import (  # noqa: E402
    BOI,
    EOI,
    IMAGE_TOKEN,
    build_tiny_gemma4_model,
)
from rewind.vision.vlm import adapter_for  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_gemma4_model(tmp_path_factory.mktemp("tiny-gemma4"))


@pytest.fixture(scope="module")
def vision(folder):
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


@pytest.fixture(scope="module")
def mlx_vlm_model(folder):
    from mlx_vlm.utils import load_model as load_vlm

    return load_vlm(folder)


def mlx_vlm_inputs(vision, text: str, images: list) -> tuple[list[int], list]:
    """mlx-vlm's own Gemma 4 processor on the text and images: its token ids and each image's
    pixels (a list: images of different sizes are not stacked)."""
    from mlx_vlm.utils import load_processor

    processor = load_processor(Path(vision[0].path))
    out = processor(text=text, images=[image.rgb() for image in images])
    pixels = out["pixel_values"]
    pixels = [np.array(p) for p in pixels] if isinstance(pixels, list) else list(np.array(pixels))
    return np.array(out["input_ids"])[0].tolist(), pixels


def mlx_vlm_logits(model, ids: list[int], pixels: list, cache=None):
    """mlx-vlm's whole Gemma 4 model: its input embeddings (scaled text, unscaled image
    features), per-layer inputs (image tokens as 0) and language model."""
    return model(mx.array([ids]), pixel_values=[mx.array(p[None]) for p in pixels],
                 cache=cache).logits


def long_text(vision, repeats: int) -> str:
    placeholder = vision[0].tokenizer.convert_ids_to_tokens(vision[1].placeholder_id)
    return f"{FILLER * repeats}Look: {placeholder} describe it"


# ---- the adapter against mlx-vlm --------------------------------------------------------------


def test_layout_and_pixels_equal_mlx_vlm_processor(vision):
    """Two images of different sizes: the expanded tokens are what mlx-vlm's processor writes
    (BOI, one image token per 24x24 px of the resized image, EOI) and the pixels are its."""
    loaded, adapter = vision
    images = [picture(1), picture(2, (200, 330))]
    placeholder = loaded.tokenizer.convert_ids_to_tokens(adapter.placeholder_id)
    assert placeholder == IMAGE_TOKEN
    text = f"Look: {placeholder} and then {placeholder} compare them"
    ids, pixels = mlx_vlm_inputs(vision, text, images)
    prompt = adapter.expand(list(loaded.tokenizer.encode(text)), images)
    assert prompt.tokens == ids
    boi, eoi = (loaded.tokenizer.convert_tokens_to_ids(t) for t in (BOI, EOI))
    # 320x240 -> 168x120 (7x5 tokens); 200x330 -> 96x192 (4x8 tokens).
    assert [span.end - span.start for span in prompt.spans] == [35, 32]
    for image, span, theirs in zip(images, prompt.spans, pixels):
        assert prompt.tokens[span.start - 1] == boi and prompt.tokens[span.end] == eoi
        ours = adapter.preprocess(image)
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


def test_logits_equal_mlx_vlm_and_need_the_scale_and_the_per_layer_ids(vision, mlx_vlm_model):
    """Our split (mlx-vlm's tower and embedder -> embeddings / sqrt(hidden) -> mlx-lm's
    language model given image tokens as id 0) computes mlx-vlm's whole model's logits. Given
    the real image token ids (per-layer inputs of the image token) or unscaled features, the
    logits are far off: both fixes are needed."""
    loaded, adapter = vision
    images = [picture(3), picture(4, (200, 330))]
    text = long_text(vision, 1) + " and this one " + IMAGE_TOKEN
    ids, pixels = mlx_vlm_inputs(vision, text, images)
    expected = np.array(mlx_vlm_logits(mlx_vlm_model, ids, pixels))
    prompt = image_prompt(vision, text_parts(vision, text, images))
    assert prompt.tokens == ids
    at_images = [i for i, t in enumerate(prompt.tokens) if t == adapter.image_token_id]
    assert prompt.model_tokens == [0 if i in set(at_images) else t
                                   for i, t in enumerate(prompt.tokens)]
    embeddings = prompt.embed(0, len(prompt.tokens))
    logits = np.array(loaded.model(mx.array([prompt.model_tokens]), input_embeddings=embeddings))
    np.testing.assert_allclose(logits, expected, atol=1e-3)
    real_ids = np.array(loaded.model(mx.array([prompt.tokens]), input_embeddings=embeddings))
    assert np.abs(real_ids - expected).max() > 1.0
    # The image rows as the features themselves (not divided by the model's embed scale).
    unscaled = mx.array(embeddings)
    rows = mx.array(at_images)
    unscaled[:, rows] = embeddings[:, rows] * adapter.embed_scale
    wrong_scale = np.array(loaded.model(mx.array([prompt.model_tokens]),
                                        input_embeddings=unscaled))
    assert np.abs(wrong_scale - expected).max() > 1.0


def test_greedy_decode_through_the_engine_equals_mlx_vlm(vision, mlx_vlm_model):
    """A prompt longer than the sliding window whose image crosses the engine's 256-token chunk
    boundary: the engine's greedy tokens and log-probabilities equal mlx-vlm's model prefilled
    in one piece and decoded with its own caches."""
    loaded, _ = vision
    image = picture(6)
    text = long_text(vision, 7)
    ids, pixels = mlx_vlm_inputs(vision, text, [image])
    prompt = image_prompt(vision, text_parts(vision, text, [image]))
    assert prompt.tokens == ids
    span = prompt.prompt.spans[0]
    assert span.start < 256 < span.end
    language = mlx_vlm_model.language_model
    cache = language.make_cache()
    logits = mlx_vlm_logits(mlx_vlm_model, ids, pixels, cache)
    expected, expected_logprobs = mlx_vlm_greedy(language, logits, cache)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(generation(prompt), TIMEOUT)
    assert ours.finish.reason == "length", ours.finish.error
    assert ours.tokens == expected
    np.testing.assert_allclose(ours.logprobs, expected_logprobs, atol=2e-3)


def test_text_requests_take_the_text_path_and_equal_mlx_vlm(vision, mlx_vlm_model):
    loaded, _ = vision
    tokens = encode(loaded, FILLER * 9)  # past the sliding window
    language = mlx_vlm_model.language_model
    cache = language.make_cache()
    logits = language(mx.array([tokens]), cache=cache).logits
    expected, _ = mlx_vlm_greedy(language, logits, cache)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(GenerationRequest(tokens, params), TIMEOUT)
        with pytest.raises(InvalidRequestError, match="model_tokens"):
            engine.submit(GenerationRequest(tokens, params, model_tokens=tokens[1:]))
    assert ours.tokens == expected


def test_bidirectional_vision_attention_is_warned_about(folder, tmp_path, caplog):
    """The larger Gemma 4 models attend bidirectionally within an image; Rewind does not, and
    says so when such a folder is loaded."""
    copy = Path(shutil.copytree(folder, tmp_path / "bidirectional"))
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (copy / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="rewind.vision.gemma4"):
        adapter_for(load_model(str(copy)))
    assert "attends causally" in caplog.text


# ---- the engine and the prompt cache ----------------------------------------------------------


def test_prompt_cache_never_changes_an_image_answer(vision, tmp_path):
    """Repeat (the whole prefix restored), a restore inside the image span, the next turn after
    the image, another image at the same place (a miss from its first block)."""
    assert_prompt_cache_keeps_image_answers(vision, tmp_path)


def test_image_and_text_requests_batched_equal_one_at_a_time(vision, tmp_path):
    batched_equals_alone(vision, two_image_prompts(vision), tmp_path)


# ---- the live server ---------------------------------------------------------------------------


def test_openai_data_url_image_through_the_live_server(vision, tmp_path, monkeypatch):
    loaded, adapter = vision
    with live_vision_server(loaded, tmp_path) as (client, model, engine):
        seen: list[GenerationRequest] = []
        submit = engine.submit
        monkeypatch.setattr(engine, "submit",
                            lambda request, **kw: seen.append(request) or submit(request, **kw))
        text_only = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is in this picture?"}],
            **GREEDY)
        first = client.chat.completions.create(model=model, messages=user_with_image(1), **GREEDY)
        second = client.chat.completions.create(model=model, messages=user_with_image(1),
                                                **GREEDY)
    # 35 image tokens for a 320x240 image, between BOI and EOI.
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 35 + 2
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert answer(second) == answer(first) != ""
    text_request, image_request = seen[0], seen[1]
    assert text_request.model_tokens is None and text_request.embed is None
    tokens = image_request.prompt_tokens
    assert tokens.count(adapter.image_token_id) == 35
    assert image_request.model_tokens == [0 if t == adapter.image_token_id else t for t in tokens]
