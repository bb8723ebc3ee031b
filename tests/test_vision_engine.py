"""Image prompts through the vision adapter and the engine: the same logits as mlx-vlm's own
Gemma 3, and the prompt cache never changes an image prompt's answer (repeat, next turn, another
image at the same place, two images, a restore inside an image span), batched or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from vision_helpers import (
    TIMEOUT,
    assert_same,
    batched_equals_alone,
    encode,
    generation,
    image_prompt,
    picture,
    prefix_of,
    reference,
)

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rewind.cache import PromptCache  # noqa: E402
from rewind.config import BLOCK_TOKENS, CacheConfig, EngineConfig  # noqa: E402
from rewind.engine import Engine  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_vision import BOI, IMAGE_TOKENS, build_tiny_vision_model  # noqa: E402
from rewind.vision.images import ImageError  # noqa: E402
from rewind.vision.prompting import prepare_image_prompt  # noqa: E402
from rewind.vision.vlm import adapter_for  # noqa: E402


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    folder = build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision"))
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


@pytest.fixture
def cached_engine(vision, tmp_path):
    loaded = vision[0]
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20))
    engine = Engine(loaded, EngineConfig(parallel=2), prompt_cache).start()
    yield engine
    engine.shutdown()
    prompt_cache.close()


# ---- the adapter ----------------------------------------------------------------------------


def test_embeddings_and_logits_equal_mlx_vlm_gemma3(vision):
    """Our split (mlx-vlm tower + projector -> embeddings -> mlx-lm language model) computes what
    mlx-vlm's whole Gemma 3 model computes for the same prompt and image."""
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    image = picture(1)
    prompt = image_prompt(vision, ["Look: ", image, " what is it?"])
    reference_model = load_vlm(Path(loaded.path))
    ids = mx.array([prompt.tokens])
    pixels = mx.array(adapter.preprocess(image)[None])
    hidden, _, _ = reference_model.vision_tower(pixels, output_hidden_states=True)
    features = reference_model.multi_modal_projector(hidden)
    text_embeds = reference_model.language_model.model.embed_tokens(ids)
    embeds, _ = reference_model.prepare_inputs_for_multimodal(
        reference_model.config.hidden_size, reference_model.config.pad_token_id,
        adapter.image_token_id, features, text_embeds, ids, mx.ones(ids.shape))
    ours = prompt.embed(0, len(prompt.tokens))
    # Compared before the forward passes: Gemma 3 scales its input embeddings in place (`h *=`).
    np.testing.assert_allclose(np.array(ours), np.array(embeds), atol=1e-5)
    expected = reference_model.language_model(ids, inputs_embeds=embeds).logits
    logits = loaded.model(ids, input_embeddings=ours)
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-3)


def test_any_chunking_gives_the_same_embeddings(vision):
    prompt = image_prompt(vision, ["a", picture(2), "b", picture(3), "c"])
    total = len(prompt.tokens)
    whole = np.array(prompt.embed(0, total))
    first, second = prompt.prompt.spans
    for cut in (first.start, first.start + 5, first.end - 1, second.start + 17, total - 1):
        parts = np.concatenate([np.array(prompt.embed(0, cut)), np.array(prompt.embed(cut, total))],
                               axis=1)
        np.testing.assert_array_equal(parts, whole)


def test_expansion_spans_and_checkpoint_positions(vision):
    loaded, adapter = vision
    text = encode(loaded, "before")
    tokens = text + [adapter.boi_token_id] + text + [adapter.boi_token_id] + text
    images = [picture(4), picture(5)]
    prepared = prepare_image_prompt(adapter, loaded.model, tokens, images, [len(text), len(tokens)])
    spans = prepared.prompt.spans
    added = len(adapter.newline_ids) * 2 + IMAGE_TOKENS + 1  # newlines, image tokens, EOI
    assert len(prepared.tokens) == len(tokens) + 2 * added
    assert [s.end - s.start for s in spans] == [IMAGE_TOKENS, IMAGE_TOKENS]
    assert prepared.tokens[spans[0].start - 1] == adapter.boi_token_id
    assert prepared.tokens[spans[0].end] == adapter.eoi_token_id
    assert set(prepared.tokens[spans[1].start:spans[1].end]) == {adapter.image_token_id}
    assert prepared.checkpoints == [len(text), len(prepared.tokens)]
    assert prepared.extras.image_hashes == [(s.start, s.end, im.sha256)
                                            for s, im in zip(spans, images)]


def test_placeholders_must_match_the_images(vision):
    loaded, adapter = vision
    tokens = encode(loaded, f"one {BOI} two {BOI}")
    assert tokens.count(adapter.boi_token_id) == 2
    with pytest.raises(ImageError, match="2 image placeholder"):
        prepare_image_prompt(adapter, loaded.model, tokens, [picture(1)])
    with pytest.raises(ImageError, match="image token as text"):
        prepare_image_prompt(adapter, loaded.model, tokens + [adapter.image_token_id],
                             [picture(1), picture(2)])


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
    assert first.tokens == other.tokens  # the same placeholder tokens: only the pixels differ
    span_start = other.prompt.spans[0].start
    cached_engine.generate(generation(first), TIMEOUT)
    result = cached_engine.generate(generation(other), TIMEOUT)
    # The 256-token block before the image is shared; the block holding the image is not.
    assert result.finish.usage.cached_tokens == (span_start // BLOCK_TOKENS) * BLOCK_TOKENS == 256
    expected = reference(vision, other)
    assert_same(result, expected)
    assert expected.tokens != reference(vision, first).tokens  # the image does matter


def test_two_images_repeat_and_change_the_second(vision, cached_engine):
    loaded = vision[0]
    a, b, c = picture(10), picture(11), picture(12)
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
    """A 256-token checkpoint inside an image span is restored and the rest of the span is
    prefilled from the sliced features."""
    loaded = vision[0]
    image = picture(13)
    prefix = prefix_of(loaded, 220)
    first = image_prompt(vision, [prefix, image, " first question, about the shapes"])
    other = image_prompt(vision, [prefix, image, " another question entirely"])
    span = other.prompt.spans[0]
    assert span.start < BLOCK_TOKENS < span.end
    cached_engine.generate(generation(first), TIMEOUT)
    result = cached_engine.generate(generation(other), TIMEOUT)
    assert result.finish.usage.cached_tokens == BLOCK_TOKENS
    assert_same(result, reference(vision, other))


def test_tower_output_is_reused_when_the_prompt_cache_misses(vision, cached_engine):
    loaded, adapter = vision
    image = picture(14)
    cached_engine.generate(generation(image_prompt(vision, ["first system text ", image, " hi"])),
                           TIMEOUT)
    runs = adapter.tower_runs
    other_prefix = image_prompt(vision, ["another system text ", image, " hi"])
    result = cached_engine.generate(generation(other_prefix), TIMEOUT)
    assert result.finish.usage.cached_tokens < other_prefix.prompt.spans[0].start
    assert adapter.tower_runs == runs  # features came from the LRU
    assert_same(result, reference(vision, other_prefix))


def test_image_and_text_requests_batched_equal_one_at_a_time(vision, tmp_path):
    loaded = vision[0]
    prompts = [
        image_prompt(vision, [prefix_of(loaded, 90), picture(15), " describe it"]),
        image_prompt(vision, ["short ", picture(16), " and ", picture(17), " compare"]),
    ]
    batched_equals_alone(vision, prompts, tmp_path)


def test_without_mlx_vlm_a_vision_folder_says_what_to_install(vision, monkeypatch):
    import sys

    from rewind.vision.vlm import VisionUnavailableError

    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # makes `import mlx_vlm` fail
    with pytest.raises(VisionUnavailableError, match=r"rewind-engine\[vision\]"):
        adapter_for(vision[0])


def test_feature_lru_is_bounded_and_counts_tower_runs(vision):
    from rewind.vision.features import FeatureLRU

    _, adapter = vision
    saved = adapter.feature_cache
    one_image = IMAGE_TOKENS * vision[0].config["text_config"]["hidden_size"] * 4  # float32
    adapter.feature_cache = FeatureLRU(budget_bytes=one_image)
    try:
        runs = adapter.tower_runs
        first, second = picture(20), picture(21)
        adapter.features(first)
        adapter.features(first)  # kept
        adapter.features(second)  # evicts the first
        adapter.features(first)
        assert adapter.tower_runs - runs == 3
        assert adapter.feature_cache.stats()["evictions"] == 2
    finally:
        adapter.feature_cache = saved
