"""LLaVA-NeXT (`llava_next`): the folders load (mlx-lm has no class for them: its llama under
their weight names, rewind.models.llava_next_text), text included; an image expands into as
many image tokens as transformers' and mlx-vlm's LlavaNextProcessor write for its size, with
their pixels; the features are packed as transformers packs them (whole image first, then the
grid's tiles as one unpadded map with the learned newline after each row). mlx-vlm's own
LLaVA-NeXT model does not pack the grid (it gives the language model every frame and a frame of
newlines), so the reference embeddings here are mlx-vlm's tower, projector and newline packed
by mlx-vlm's LLaVA-OneVision `pack_image_features` (the same packing, whose extra downsampling
stays off at these sizes), before mlx-vlm's LLaVA-NeXT language model. The prompt cache and
batching never change an answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from vision_helpers import (
    TIMEOUT,
    assert_prompt_cache_keeps_image_answers,
    batched_equals_alone,
    copy_with_weight_names,
    encode,
    generation,
    image_prompt,
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
from rewind.engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_llava_next import (  # noqa: E402
    PINPOINTS,
    TILE_PIXELS,
    build_tiny_llava_next_model,
)
from rewind.vision.vlm import VisionUnavailableError, adapter_for  # noqa: E402

# (width, height) -> (rows, columns) of tiles: every grid of PINPOINTS, padding above and below
# and at the sides, odd leftovers, images smaller than a tile.
SIZES = {(320, 240): (2, 2), (200, 330): (2, 2), (113, 57): (2, 2), (64, 48): (1, 2),
         (48, 64): (2, 1), (45, 77): (2, 1), (150, 70): (1, 3), (60, 700): (3, 1)}


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    folder = build_tiny_llava_next_model(tmp_path_factory.mktemp("tiny-llava-next"))
    loaded = load_model(str(folder))
    return loaded, adapter_for(loaded)


@pytest.fixture(scope="module")
def reference_model(vision):
    from mlx_vlm.utils import load_model as load_vlm

    return load_vlm(Path(vision[0].path))


def transformers_processor(folder: Path):
    """transformers' own LlavaNextProcessor (no torch needed) over the folder's files."""
    from transformers import AutoTokenizer
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    settings = json.loads((folder / "processor_config.json").read_text())
    settings.pop("processor_class")
    return LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil.from_pretrained(folder),
                              tokenizer=AutoTokenizer.from_pretrained(folder), **settings)


def reference_embeddings(reference_model, processed: dict):
    """Input embeddings from mlx-vlm's pieces: its tower, projector and image_newline on its
    processor's pixels, packed by mlx-vlm's LLaVA-OneVision packing, scattered at the image
    tokens."""
    from mlx_vlm.models.llava_onevision.llava_onevision import Model as OneVision

    config = reference_model.config
    pixels = mx.array(processed["pixel_values"])
    sizes = processed["image_sizes"].tolist()
    packer = SimpleNamespace(
        config=SimpleNamespace(image_grid_pinpoints=PINPOINTS,
                               vision_config=config.vision_config),
        patches_per_side=config.vision_config.image_size // config.vision_config.patch_size,
        max_num_patches=10 ** 6,  # OneVision's anyres_max downsampling: off, as LLaVA-NeXT
        image_newline=reference_model.image_newline)
    per_image = []
    for index, size in enumerate(sizes):
        rows, columns = reference_grid(size)
        frames = pixels[index, :1 + rows * columns].transpose(0, 2, 3, 1)
        *_, hidden = reference_model.vision_tower(frames, output_hidden_states=True)
        selected = hidden[config.vision_feature_layer][:, 1:]
        per_image.append(reference_model.multi_modal_projector(selected))
    features = mx.concatenate(OneVision.pack_image_features(packer, per_image, sizes), axis=0)
    ids = mx.array(processed["input_ids"])
    embeddings = reference_model.language_model.model.embed_tokens(ids)
    return OneVision._scatter_features(None, embeddings, ids, features,
                                       config.image_token_index, "Image")


def reference_grid(size: list[int]) -> tuple[int, int]:
    """(rows, columns) of tiles for an image of (height, width), by mlx-vlm's OneVision."""
    from mlx_vlm.models.llava_onevision.llava_onevision import get_anyres_image_grid_shape

    return get_anyres_image_grid_shape(size, PINPOINTS, TILE_PIXELS)


# ---- loading ----------------------------------------------------------------------------------


def test_the_language_model_is_mlx_lms_llama_and_computes_as_mlx_vlms(vision, reference_model):
    from mlx_lm.models import llama

    from rewind.kernels.model_split import split_model

    loaded, _ = vision
    assert isinstance(loaded.model, llama.Model)
    assert split_model(loaded.model) is not None  # prefill computes the last logits only
    ids = mx.array([loaded.tokenizer.encode("The weather in Berlin is cloudy")])
    expected = reference_model.language_model(ids).logits
    np.testing.assert_allclose(np.array(loaded.model(ids)), np.array(expected), atol=1e-4)


def test_text_requests_answer_as_mlx_vlms_language_model(vision, reference_model):
    from mlx_lm.models.cache import KVCache

    loaded, _ = vision
    tokens = encode(loaded, "def fibonacci(n: int) -> int:")
    language = reference_model.language_model
    cache = [KVCache() for _ in reference_model.layers]
    logits = language(mx.array([tokens]), cache=cache).logits
    expected, expected_logprobs = mlx_vlm_greedy(language, logits, cache)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(GenerationRequest(tokens, params), TIMEOUT)
    assert ours.tokens == expected
    np.testing.assert_allclose(ours.logprobs, expected_logprobs, atol=2e-3)


def test_transformers_5_weight_names_and_a_mistral_text_model_load_too(vision, tmp_path):
    """The same weights as transformers 5 saves them (model.language_model.*, lm_head,
    model.vision_tower.*, model.multi_modal_projector.*, model.image_newline), with the text
    model named `mistral` and its rms_norm_eps left to MistralConfig's default: the same
    model."""
    loaded, _ = vision
    copy_with_weight_names(Path(loaded.path), tmp_path, "model.language_model.",
                           language_model_level="model.")
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    assert config["text_config"].pop("rms_norm_eps") == 1e-6  # MistralConfig's default
    (tmp_path / "config.json").write_text(json.dumps(config))
    other = load_model(str(tmp_path))
    ids = mx.array([loaded.tokenizer.encode("def fibonacci(n: int) -> int:")])
    np.testing.assert_allclose(np.array(other.model(ids)), np.array(loaded.model(ids)), atol=1e-5)
    vision_other = (other, adapter_for(other))
    ours, theirs = (image_prompt(v, ["Look: ", picture(1), " what is it?"])
                    for v in (vision, vision_other))
    np.testing.assert_allclose(np.array(theirs.embed(0, len(theirs.tokens))),
                               np.array(ours.embed(0, len(ours.tokens))), atol=1e-6)


def test_other_language_models_are_refused_naming_the_supported_ones(vision, tmp_path):
    loaded, _ = vision
    for item in Path(loaded.path).iterdir():
        shutil.copy(item, tmp_path / item.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["model_type"] = "qwen2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'qwen2' language model .*llama, mistral"):
        load_model(str(tmp_path))
    from rewind.vision.vlm import load_vision_adapter

    with pytest.raises(VisionUnavailableError, match=r"'qwen2' language model .*llama, mistral"):
        load_vision_adapter(tmp_path, config, mx.float32)


# ---- the adapter against transformers and mlx-vlm ---------------------------------------------


def test_image_token_counts_and_pixels_equal_the_processors(vision):
    """Every grid and both padding directions: the layout's count (from the image's size
    alone) is transformers' LlavaNextProcessor's, the expanded prompt is what mlx-vlm's
    processor writes, and the frames are its pixels."""
    from mlx_vlm.utils import load_processor

    loaded, adapter = vision
    folder = Path(loaded.path)
    ours_per_size = []
    counted = transformers_processor(folder)._get_num_multimodal_tokens(
        image_sizes=[(h, w) for w, h in SIZES]).num_image_tokens
    theirs = load_processor(folder)
    text = two_image_text(vision)
    tokens = list(loaded.tokenizer.encode(text))
    sizes = list(SIZES)
    for first, second in zip(sizes[::2], sizes[1::2]):
        images = [picture(seed, size) for seed, size in enumerate((first, second))]
        processed = processed_by_mlx_vlm(vision, text, images, theirs)
        prompt = adapter.expand(tokens, images)
        assert prompt.tokens == processed["input_ids"][0].tolist()
        for index, (image, span) in enumerate(zip(images, prompt.spans)):
            frames, (height, width) = adapter.preprocess(image)
            rows, columns = SIZES[image.pixels.size]
            assert adapter.grid(height, width) == (rows, columns)
            assert frames.shape == (1 + rows * columns, TILE_PIXELS, TILE_PIXELS, 3)
            assert [height, width] == processed["image_sizes"][index].tolist()
            expected = processed["pixel_values"][index][:len(frames)].transpose(0, 2, 3, 1)
            np.testing.assert_allclose(frames, expected, atol=1e-6)
            ours_per_size.append(span.end - span.start)
    assert ours_per_size == counted
    assert counted[0] == 16 + 6 * (8 + 1)  # 320x240: base 4x4, 8x8 grid unpadded to 6 rows


def test_embeddings_logits_and_greedy_decode_equal_mlx_vlm(vision, reference_model):
    """Two images (a 2x2 grid padded above and below, one padded at the sides): embeddings
    and whole-prompt logits equal mlx-vlm's language model on the reference embeddings, and the
    engine's greedy answer is what mlx-vlm's language model decodes from them."""
    from mlx_lm.models.cache import KVCache

    loaded, _ = vision
    images = [picture(3), picture(4, (200, 330))]
    text = two_image_text(vision)
    processed = processed_by_mlx_vlm(vision, text, images)
    expected_embeddings = reference_embeddings(reference_model, processed)
    prompt = image_prompt(vision, text_parts(vision, text, images))
    assert prompt.tokens == processed["input_ids"][0].tolist()
    ours = prompt.embed(0, len(prompt.tokens))
    np.testing.assert_allclose(np.array(ours), np.array(expected_embeddings), atol=1e-5)
    ids = mx.array([prompt.tokens])
    language = reference_model.language_model
    cache = [KVCache() for _ in reference_model.layers]
    expected = language(ids, inputs_embeds=expected_embeddings, cache=cache).logits
    logits = loaded.model(ids, input_embeddings=ours)
    difference = float(np.abs(np.array(logits) - np.array(expected)).max())
    assert difference < 1e-3, difference
    expected_tokens, expected_logprobs = mlx_vlm_greedy(language, expected, cache)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        answer = engine.generate(generation(prompt), TIMEOUT)
    assert answer.tokens == expected_tokens
    np.testing.assert_allclose(answer.logprobs, expected_logprobs, atol=2e-3)
    # The image matters (this test can fail): another picture changes the last logits.
    other = image_prompt(vision, text_parts(vision, text, [picture(5), images[1]]))
    changed = loaded.model(ids, input_embeddings=other.embed(0, len(other.tokens)))
    assert np.abs(np.array(changed[0, -1]) - np.array(logits[0, -1])).max() > 0.1


def test_image_after_long_text_decodes_as_mlx_vlm(vision, reference_model):
    """An image after 40 tokens of text, then text: the engine's answer equals mlx-vlm's
    language model's from the reference embeddings."""
    from mlx_lm.models.cache import KVCache

    loaded, adapter = vision
    prompt = image_prompt(vision, [prefix_of(loaded, 40), picture(6, (48, 64)), " describe it"])
    image_tokens = prompt.prompt.spans[0]
    processed = {  # as mlx-vlm's processor makes them (pixels: the test above)
        "input_ids": np.array([prompt.tokens]),
        "pixel_values": adapter.preprocess(picture(6, (48, 64)))[0].transpose(0, 3, 1, 2)[None],
        "image_sizes": np.array([[64, 48]])}
    embeddings = reference_embeddings(reference_model, processed)
    # A 2x1 grid: 8x4 patches, the rows padding added cut to 6, a newline after each.
    assert image_tokens.end - image_tokens.start == 16 + 6 * (4 + 1)
    language = reference_model.language_model
    cache = [KVCache() for _ in reference_model.layers]
    logits = language(mx.array([prompt.tokens]), inputs_embeds=embeddings, cache=cache).logits
    expected, expected_logprobs = mlx_vlm_greedy(language, logits, cache)
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        ours = engine.generate(generation(prompt), TIMEOUT)
    assert ours.tokens == expected
    np.testing.assert_allclose(ours.logprobs, expected_logprobs, atol=2e-3)


# ---- the engine and the prompt cache ----------------------------------------------------------


def test_prompt_cache_never_changes_an_image_answer(vision, tmp_path):
    """Repeat, a restore inside the image span, the next turn, another image at the same
    place."""
    assert_prompt_cache_keeps_image_answers(vision, tmp_path)


def test_image_and_text_requests_batched_equal_one_at_a_time(vision, tmp_path):
    batched_equals_alone(vision, two_image_prompts(vision), tmp_path)
