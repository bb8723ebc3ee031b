"""Qwen2.5-VL, Qwen2-VL and Qwen 3.5 image prompts: 3-D rotary positions equal mlx-vlm's
get_rope_index, logits and greedy decode equal mlx-vlm's own model (and differ with 1-D
positions), and the prompt cache never changes an answer (repeat, next turn, another image at
the same place, two images, a restore inside an image span), batched with text requests or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from vision_helpers import (
    FILLER,
    TIMEOUT,
    assert_same,
    batched_equals_alone,
    encode,
    generation,
    image_prompt,
    mlx_vlm_greedy,
    picture,
    prefix_of,
    qwen_mlx_vlm_inputs,
    reference,
    two_image_prompts,
)

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rewind.cache import PromptCache  # noqa: E402
from rewind.config import BLOCK_TOKENS, CacheConfig, EngineConfig  # noqa: E402
from rewind.engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from rewind.engine.positions import given_positions  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_qwen_vl import build_tiny_qwen_vl_model  # noqa: E402
from rewind.vision.vlm import adapter_for  # noqa: E402


def build(tmp_path_factory, model_type: str):
    folder = build_tiny_qwen_vl_model(tmp_path_factory.mktemp(f"tiny-{model_type}"), model_type)
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    return build(tmp_path_factory, "qwen2_5_vl")


@pytest.fixture(scope="module")
def vision_qwen2(tmp_path_factory):
    return build(tmp_path_factory, "qwen2_vl")


@pytest.fixture(scope="module")
def vision_qwen35(tmp_path_factory):
    return build(tmp_path_factory, "qwen3_5")


@pytest.fixture
def cached_engine(vision, tmp_path):
    loaded = vision[0]
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20))
    engine = Engine(loaded, EngineConfig(parallel=2), prompt_cache).start()
    yield engine
    engine.shutdown()
    prompt_cache.close()


# ---- the adapter against mlx-vlm --------------------------------------------------------------


def test_positions_equal_mlx_vlm_rope_index(vision):
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    prompt = image_prompt(vision, ["two: ", picture(1), " and ", picture(2, (200, 330)), " end"])
    first, second = prompt.prompt.spans
    assert first.grid == (1, 6, 9) and second.grid == (1, 10, 6)  # the size sets the grid
    _, features = qwen_mlx_vlm_inputs(load_vlm(Path(loaded.path)), adapter, prompt)
    np.testing.assert_array_equal(prompt.prompt.positions, np.array(features.position_ids)[:, 0])
    assert prompt.position_delta == int(np.array(features.rope_deltas)[0, 0]) < 0
    # Really 3-D: inside an image the three rows differ.
    image_rows = prompt.prompt.positions[:, first.start:first.end]
    assert len({tuple(row) for row in image_rows}) == 3


@pytest.mark.parametrize("which", ["vision", "vision_qwen2", "vision_qwen35"])
def test_logits_equal_mlx_vlm_and_need_3d_positions(which, request):
    from mlx_vlm.utils import load_model as load_vlm

    vision = request.getfixturevalue(which)
    loaded, adapter = vision
    prompt = image_prompt(vision, ["Look: ", picture(3), " what is it?"])
    reference_model = load_vlm(Path(loaded.path))
    ids, features = qwen_mlx_vlm_inputs(reference_model, adapter, prompt)
    ours = prompt.embed(0, len(prompt.tokens))
    np.testing.assert_allclose(np.array(ours), np.array(features.inputs_embeds), atol=1e-5)
    expected = reference_model.language_model(ids, inputs_embeds=features.inputs_embeds,
                                              position_ids=features.position_ids).logits
    with given_positions(loaded.model, prompt.positions(0, len(prompt.tokens))):
        logits = loaded.model(ids, input_embeddings=ours)
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-3)
    flat = loaded.model(ids, input_embeddings=ours)  # 1-D positions: wrong for the image
    assert np.abs(np.array(flat) - np.array(expected)).max() > 0.1


@pytest.mark.parametrize("which", ["vision", "vision_qwen35"])
def test_greedy_decode_after_the_image_equals_mlx_vlm(which, request):
    """Prefill with mlx-vlm's positions, then decode at offset + rope delta, in mlx-vlm's own
    language model: the engine's tokens are the same. With no delta they are not."""
    from mlx_lm.models.cache import KVCache
    from mlx_vlm.utils import load_model as load_vlm

    vision = request.getfixturevalue(which)
    loaded, adapter = vision
    prompt = image_prompt(vision, [prefix_of(loaded, 40), picture(4), " describe it"])
    reference_model = load_vlm(Path(loaded.path))
    ids, features = qwen_mlx_vlm_inputs(reference_model, adapter, prompt)
    language = reference_model.language_model
    cache = (language.make_cache() if hasattr(language, "make_cache")
             else [KVCache() for _ in language.model.layers])
    logits = language(ids, inputs_embeds=features.inputs_embeds, cache=cache,
                      position_ids=features.position_ids).logits
    delta = int(np.array(features.rope_deltas)[0, 0])
    expected, expected_logprobs = mlx_vlm_greedy(language, logits, cache,
                                                 len(prompt.tokens) + delta)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(generation(prompt), TIMEOUT)
        no_delta = engine.generate(generation(prompt, delta=0), TIMEOUT)
    assert ours.tokens == expected
    np.testing.assert_allclose(ours.logprobs, expected_logprobs, atol=2e-3)
    # Decode positions matter (this test can fail): without the delta the answer changes.
    wrong = np.abs(np.array(no_delta.logprobs) - np.array(expected_logprobs)).max()
    assert no_delta.tokens != expected or wrong > 0.05


def test_mrope_replaces_the_cpu_kernels_and_keeps_the_weights(vision):
    from mlx.utils import tree_flatten

    from rewind.kernels.native_forward import native_forward
    from rewind.vision.mrope import MultimodalRoPE

    loaded, _ = vision
    layers = loaded.model.language_model.model.layers
    assert all(isinstance(layer.self_attn.rope, MultimodalRoPE) for layer in layers)
    assert native_forward(loaded.model) is None  # its kernels rotate by the cache offset
    if mx.default_device() == mx.cpu:  # MLX's layers then compute in float32, as the loader's
        assert {v.dtype for _, v in tree_flatten(layers[0].parameters())} == {mx.float32}
    names = [name for name, _ in tree_flatten(loaded.model.parameters())]
    assert not any("rope" in name for name in names)


def test_text_request_on_a_qwen_vl_model_is_plain_text(vision):
    loaded, _ = vision
    tokens = encode(loaded, FILLER * 2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        result = engine.generate(GenerationRequest(tokens, params), TIMEOUT)
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([tokens]), cache=cache)  # offset positions, no holder set
    assert result.tokens[0] == int(mx.argmax(logits[0, -1]).item())


# ---- the engine and the prompt cache ----------------------------------------------------------


def test_repeated_image_prompt_restores_its_whole_prefix(vision, cached_engine):
    prompt = image_prompt(vision, [prefix_of(vision[0], 300), picture(6), " describe it"])
    expected = reference(vision, prompt)
    first = cached_engine.generate(generation(prompt), TIMEOUT)
    second = cached_engine.generate(generation(prompt), TIMEOUT)
    assert first.finish.usage.cached_tokens == 0
    assert second.finish.usage.cached_tokens == len(prompt.tokens) - 1
    assert_same(first, expected)
    assert_same(second, expected)


def test_next_turn_after_an_image(vision, cached_engine):
    """The answer was decoded at index + delta; the next turn's prompt gives it the same
    positions, so its checkpoint restores and the rest continues from there."""
    loaded = vision[0]
    image = picture(7)
    turn1 = image_prompt(vision, [prefix_of(loaded, 200), image, " describe it"])
    answer = cached_engine.generate(generation(turn1, 8), TIMEOUT)
    turn2 = image_prompt(vision, [prefix_of(loaded, 200), image, " describe it", answer.tokens,
                                  " and now the colours?"])
    second = cached_engine.generate(generation(turn2), TIMEOUT)
    assert second.finish.usage.cached_tokens == len(turn1.tokens) + len(answer.tokens) - 1
    assert_same(second, reference(vision, turn2))


def test_another_image_at_the_same_place_misses_from_its_first_block(vision, cached_engine):
    prefix = prefix_of(vision[0], 300)
    first = image_prompt(vision, [prefix, picture(8), " describe it"])
    other = image_prompt(vision, [prefix, picture(9), " describe it"])
    assert first.tokens == other.tokens  # same size: same tokens, only the pixels differ
    span_start = other.prompt.spans[0].start
    cached_engine.generate(generation(first), TIMEOUT)
    result = cached_engine.generate(generation(other), TIMEOUT)
    assert result.finish.usage.cached_tokens == (span_start // BLOCK_TOKENS) * BLOCK_TOKENS == 256
    expected = reference(vision, other)
    assert_same(result, expected)
    assert expected.tokens != reference(vision, first).tokens  # the image does matter


def test_two_images_repeat_and_change_the_second(vision, cached_engine):
    loaded = vision[0]
    a, b, c = picture(10), picture(11, (200, 330)), picture(12, (200, 330))
    text = prefix_of(loaded, 150)
    both = image_prompt(vision, [text, a, " versus ", text, b, " compare them"])
    changed = image_prompt(vision, [text, a, " versus ", text, c, " compare them"])
    cached_engine.generate(generation(both), TIMEOUT)
    again = cached_engine.generate(generation(both), TIMEOUT)
    assert again.finish.usage.cached_tokens == len(both.tokens) - 1
    assert_same(again, reference(vision, both))
    second_start = changed.prompt.spans[1].start
    result = cached_engine.generate(generation(changed), TIMEOUT)
    assert result.finish.usage.cached_tokens == (second_start // BLOCK_TOKENS) * BLOCK_TOKENS
    assert result.finish.usage.cached_tokens > changed.prompt.spans[0].end  # past the first image
    assert_same(result, reference(vision, changed))


def test_restore_that_stops_inside_an_image_span(vision, cached_engine):
    """A checkpoint at 256 inside the image: the rest of the span is prefilled from the sliced
    features at the positions of the middle of the image."""
    loaded = vision[0]
    image = picture(13)
    prefix = prefix_of(loaded, 230)
    first = image_prompt(vision, [prefix, image, " first question, about the shapes"])
    other = image_prompt(vision, [prefix, image, " another question entirely"])
    span = other.prompt.spans[0]
    assert span.start < BLOCK_TOKENS < span.end
    cached_engine.generate(generation(first), TIMEOUT)
    result = cached_engine.generate(generation(other), TIMEOUT)
    assert result.finish.usage.cached_tokens == BLOCK_TOKENS
    assert_same(result, reference(vision, other))


def test_image_and_text_requests_batched_equal_one_at_a_time(vision, tmp_path):
    """Rows of one decode batch with different position deltas (two image prompts, two text
    prompts) give what each gives alone."""
    prompts = two_image_prompts(vision)
    assert prompts[0].position_delta != prompts[1].position_delta
    batched_equals_alone(vision, prompts, tmp_path)


def test_qwen2_vl_repeat_from_the_cache(vision_qwen2, tmp_path):
    loaded = vision_qwen2[0]
    prompt = image_prompt(vision_qwen2, [prefix_of(loaded, 230), picture(18), " describe it"])
    expected = reference(vision_qwen2, prompt)
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20))
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            engine.generate(generation(prompt), TIMEOUT)
            second = engine.generate(generation(prompt), TIMEOUT)
    finally:
        prompt_cache.close()
    assert second.finish.usage.cached_tokens == len(prompt.tokens) - 1
    assert_same(second, expected)


def test_qwen35_hybrid_cache_equivalence(vision_qwen35, tmp_path):
    """Qwen 3.5: gated-delta states and full-attention K/V with 3-D positions; a repeat, a
    restore inside an image span and the next turn give the uncached answers."""
    loaded = vision_qwen35[0]
    image = picture(19)
    prefix = prefix_of(loaded, 230)
    first = image_prompt(vision_qwen35, [prefix, image, " first question, about the shapes"])
    other = image_prompt(vision_qwen35, [prefix, image, " another question entirely"])
    assert other.prompt.spans[0].start < BLOCK_TOKENS < other.prompt.spans[0].end
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20))
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            answer = engine.generate(generation(first), TIMEOUT)
            again = engine.generate(generation(first), TIMEOUT)
            inside = engine.generate(generation(other), TIMEOUT)
            turn2 = image_prompt(vision_qwen35, [prefix, image, " first question, about the "
                                                 "shapes", answer.tokens, " and the colours?"])
            second = engine.generate(generation(turn2), TIMEOUT)
    finally:
        prompt_cache.close()
    assert again.finish.usage.cached_tokens == len(first.tokens) - 1
    assert inside.finish.usage.cached_tokens == BLOCK_TOKENS
    assert second.finish.usage.cached_tokens == len(first.tokens) + len(answer.tokens) - 1
    assert_same(again, reference(vision_qwen35, first))
    assert_same(inside, reference(vision_qwen35, other))
    assert_same(second, reference(vision_qwen35, turn2))


def test_qwen35_image_and_text_batched_equal_one_at_a_time(vision_qwen35):
    loaded = vision_qwen35[0]
    image = image_prompt(vision_qwen35, ["short ", picture(20, (200, 330)), " describe it"])
    text = encode(loaded, FILLER * 2)
    params = SamplingParams(temperature=0.0, max_tokens=10)

    def both() -> list[GenerationRequest]:
        return [generation(image, 10), GenerationRequest(text, params)]

    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        alone = [engine.generate(r, TIMEOUT).tokens for r in both()]
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        handles = [engine.submit(r) for r in both()]
        together = [h.collect(TIMEOUT).tokens for h in handles]
    assert together == alone
