"""Qwen3-VL image prompts (dense and MoE): interleaved 3-D positions, input embeddings and the
deepstack features added after the first language-model layers (rewind.engine.residuals).
The prompt layout and positions equal mlx-vlm's, logits and greedy decode equal mlx-vlm's own
model (and differ without deepstack), and the prompt cache never changes an answer (repeat, a
restore inside an image span, the next turn, another image at the same place), batched with
text requests or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from vision_helpers import (
    FILLER,
    TIMEOUT,
    assert_prompt_cache_keeps_image_answers,
    batched_equals_alone,
    encode,
    generation,
    image_prompt,
    mlx_vlm_greedy,
    picture,
    prefix_of,
    qwen_mlx_vlm_inputs,
    two_image_prompts,
)

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rewind.config import BLOCK_TOKENS, EngineConfig  # noqa: E402
from rewind.engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from rewind.engine.positions import given_positions  # noqa: E402
from rewind.engine.residuals import given_residuals  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_qwen_vl import DEEPSTACK_INDEXES, build_tiny_qwen_vl_model  # noqa: E402
from rewind.vision.prompting import ImagePrompt  # noqa: E402
from rewind.vision.vlm import adapter_for  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def vision(request, tmp_path_factory):
    folder = build_tiny_qwen_vl_model(tmp_path_factory.mktemp(f"tiny-{request.param}"),
                                      request.param)
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


def deepstack_kwargs(features) -> dict:
    return {"visual_pos_masks": features.visual_pos_masks,
            "deepstack_visual_embeds": features.deepstack_visual_embeds}


def whole(prompt: ImagePrompt):
    """The prompt's embeddings, positions and residuals for all of it at once."""
    total = len(prompt.tokens)
    return prompt.embed(0, total), prompt.positions(0, total), prompt.residuals(0, total)


# ---- the adapter against mlx-vlm --------------------------------------------------------------


def test_layout_positions_and_deepstack_equal_mlx_vlm(vision):
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    assert adapter.residual_layers == len(DEEPSTACK_INDEXES)
    prompt = image_prompt(vision, ["two: ", picture(1), " and ", picture(2, (200, 330)), " end"])
    first, second = prompt.prompt.spans
    assert first.grid == (1, 6, 9) and second.grid == (1, 10, 6)
    ids, features = qwen_mlx_vlm_inputs(load_vlm(Path(loaded.path)), adapter, prompt)
    np.testing.assert_array_equal(prompt.prompt.positions, np.array(features.position_ids)[:, 0])
    assert prompt.position_delta == int(np.array(features.rope_deltas)[0, 0]) < 0
    embeddings, _, residuals = whole(prompt)
    np.testing.assert_allclose(np.array(embeddings), np.array(features.inputs_embeds), atol=1e-5)
    # Our dense residuals are mlx-vlm's compact deepstack rows at the image positions, zeros
    # elsewhere.
    image_at = np.array(features.visual_pos_masks)[0]
    assert image_at.sum() == sum(span.end - span.start for span in prompt.prompt.spans)
    for layer, theirs in enumerate(features.deepstack_visual_embeds):
        ours = np.array(residuals[layer])[0]
        np.testing.assert_allclose(ours[image_at], np.array(theirs), atol=1e-5)
        assert not ours[~image_at].any()
    assert prompt.residuals(0, first.start) is None  # no image: nothing to add


def test_logits_equal_mlx_vlm_and_need_the_deepstack(vision):
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    prompt = image_prompt(vision, ["Look: ", picture(3), " what is it?"])
    reference_model = load_vlm(Path(loaded.path))
    ids, features = qwen_mlx_vlm_inputs(reference_model, adapter, prompt)
    expected = reference_model.language_model(
        ids, inputs_embeds=features.inputs_embeds, position_ids=features.position_ids,
        **deepstack_kwargs(features)).logits
    embeddings, positions, residuals = whole(prompt)
    with given_positions(loaded.model, positions), given_residuals(loaded.model, residuals):
        logits = loaded.model(ids, input_embeddings=embeddings)
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-3)
    with given_positions(loaded.model, positions):  # without the deepstack: another answer
        flat = loaded.model(ids, input_embeddings=embeddings)
    assert np.abs(np.array(flat[0, -1]) - np.array(expected[0, -1])).max() > 0.1


def test_greedy_decode_equals_mlx_vlm_with_the_image_across_a_chunk_boundary(vision):
    """mlx-vlm prefills the whole prompt in one call; the engine prefills it in chunks that
    end at 256, inside the image, so each chunk takes its slice of the deepstack features.
    Both then decode at offset + rope delta: the same tokens."""
    from mlx_lm.models.cache import KVCache
    from mlx_vlm.utils import load_model as load_vlm

    loaded, adapter = vision
    prompt = image_prompt(vision, [prefix_of(loaded, 230), picture(4), " describe it"])
    span = prompt.prompt.spans[0]
    assert span.start < BLOCK_TOKENS < span.end
    reference_model = load_vlm(Path(loaded.path))
    ids, features = qwen_mlx_vlm_inputs(reference_model, adapter, prompt)
    language = reference_model.language_model
    cache = [KVCache() for _ in language.model.layers]
    logits = language(ids, inputs_embeds=features.inputs_embeds, cache=cache,
                      position_ids=features.position_ids, **deepstack_kwargs(features)).logits
    delta = int(np.array(features.rope_deltas)[0, 0])
    expected, expected_logprobs = mlx_vlm_greedy(language, logits, cache,
                                                 len(prompt.tokens) + delta)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(generation(prompt), TIMEOUT)
    assert ours.tokens == expected
    np.testing.assert_allclose(ours.logprobs, expected_logprobs, atol=2e-3)


def test_the_first_layers_take_residuals_and_keep_their_weights(vision):
    from mlx.utils import tree_flatten

    from rewind.kernels.model_split import split_model
    from rewind.kernels.native_forward import native_forward
    from rewind.engine.residuals import residuals_holder

    loaded, _ = vision
    assert residuals_holder(loaded.model).layers == frozenset(range(len(DEEPSTACK_INDEXES)))
    assert native_forward(loaded.model) is None
    assert split_model(loaded.model) is not None  # prefill computes the last logits only
    names = [name for name, _ in tree_flatten(loaded.model.parameters())]
    assert not any("rope" in name or "residual" in name.lower() for name in names)


def test_text_request_on_a_qwen3_vl_model_is_plain_text(vision):
    from mlx_lm.models.cache import make_prompt_cache

    loaded, _ = vision
    tokens = encode(loaded, FILLER * 2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        result = engine.generate(GenerationRequest(tokens, params), TIMEOUT)
    logits = loaded.model(mx.array([tokens]), cache=make_prompt_cache(loaded.model))
    assert result.tokens[0] == int(mx.argmax(logits[0, -1]).item())


# ---- the engine and the prompt cache ----------------------------------------------------------


def test_prompt_cache_never_changes_an_image_answer(vision, tmp_path):
    """Repeat, the next turn, another image at the same place, and a restore inside the image
    span, which prefills the rest of it with the rest of its deepstack features."""
    assert_prompt_cache_keeps_image_answers(vision, tmp_path)


def test_image_and_text_requests_batched_equal_one_at_a_time(vision, tmp_path):
    batched_equals_alone(vision, two_image_prompts(vision), tmp_path)
