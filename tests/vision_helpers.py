"""Helpers shared by the vision-family tests: seeded pictures, image prompts through the real
adapter, engine requests for them, and the answer text of an OpenAI completion.

`vision` is a (LoadedModel, VisionAdapter) pair, as the tests' fixtures build it."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from rewind.config import CacheConfig, EngineConfig, ServerConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.vision.images import DecodedImage, image_from_bytes
from rewind.vision.prompting import ImagePrompt, prepare_image_prompt

TIMEOUT = 120
FILLER = "An agent reads a long conversation again and again, and each turn adds a tool result. "


def copy_with_weight_names(source: Path, target: Path, language_prefix: str,
                           language_model_level: str = "") -> None:
    """Copy an mlx-vlm-layout folder to `target` with its weights under transformers' names:
    `language_model.lm_head.*` -> `lm_head.*`, `language_model.<level>*` ->
    `<language_prefix>*`, everything else under `model.`."""
    import shutil

    import mlx.core as mx

    renamed = {}
    for name, value in mx.load(str(source / "model.safetensors")).items():
        if name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        elif name.startswith("language_model." + language_model_level):
            name = language_prefix + name.removeprefix("language_model." + language_model_level)
        else:
            name = "model." + name
        renamed[name] = value
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, target / item.name)
    mx.save_safetensors(str(target / "model.safetensors"), renamed)


def png_bytes(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    """A PNG of seeded noise, `size` = (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def picture(seed: int, size: tuple[int, int] = (320, 240)) -> DecodedImage:
    return image_from_bytes(png_bytes(seed, size))


def png_base64(seed: int, size: tuple[int, int] = (320, 240)) -> str:
    return base64.b64encode(png_bytes(seed, size)).decode()


def encode(loaded, text: str) -> list[int]:
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))


def prefix_of(loaded, length: int) -> list[int]:
    """Exactly `length` tokens of plain text."""
    tokens = encode(loaded, FILLER * (length // 10 + 2))
    assert len(tokens) >= length
    return tokens[:length]


def image_prompt(vision, parts: list, checkpoints: list[int] | None = None) -> ImagePrompt:
    """parts: token lists, strings, or DecodedImage (one placeholder each), in order."""
    loaded, adapter = vision
    tokens: list[int] = []
    images: list[DecodedImage] = []
    for part in parts:
        if isinstance(part, DecodedImage):
            tokens.append(adapter.placeholder_id)
            images.append(part)
        elif isinstance(part, str):
            tokens += encode(loaded, part)
        else:
            tokens += part
    return prepare_image_prompt(adapter, loaded.model, tokens, images, checkpoints or [len(tokens)])


def generation(prompt: ImagePrompt, max_tokens: int = 8, delta: int | None = None
               ) -> GenerationRequest:
    """A greedy request for `prompt` with its embeddings (and 3-D positions and layer residuals
    where it has them); `delta` overrides the position delta of generated tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=True, top_logprobs=3)
    request = prompt.into(GenerationRequest(prompt.tokens, params, prompt.checkpoints))
    if delta is not None:
        request.position_delta = delta
    return request


def reference(vision, prompt: ImagePrompt, max_tokens: int = 8):
    """The answer without any prompt cache, alone in the engine."""
    with Engine(vision[0], EngineConfig(parallel=1)) as engine:
        return engine.generate(generation(prompt, max_tokens), TIMEOUT)


def assert_same(result, expected) -> None:
    assert result.finish.reason == expected.finish.reason, result.finish.error
    assert result.tokens == expected.tokens
    np.testing.assert_allclose(result.logprobs, expected.logprobs, atol=2e-3)


def two_image_prompts(vision) -> list[ImagePrompt]:
    """Two image prompts for batching tests: one image after 90 tokens of text; two images of
    different sizes in a short prompt."""
    return [
        image_prompt(vision, [prefix_of(vision[0], 90), picture(15), " describe it"]),
        image_prompt(vision, ["short ", picture(16, (200, 330)), " and ", picture(17),
                              " compare"]),
    ]


def batched_equals_alone(vision, prompts: list[ImagePrompt], scratch: Path) -> None:
    """The image prompts and two text prompts, interleaved in one continuous batch (with a
    prompt cache in `scratch`), give the greedy tokens each gives alone."""
    from rewind.cache import PromptCache

    loaded = vision[0]
    texts = [encode(loaded, FILLER * 3), encode(loaded, "def fibonacci(n: int) -> int:")]
    params = SamplingParams(temperature=0.0, max_tokens=10)

    def all_requests() -> list[GenerationRequest]:
        requests = [generation(p, 10) for p in prompts]
        for index, text in enumerate(texts):
            requests.insert(2 * index + 1, GenerationRequest(text, params))
        return requests

    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        alone = [engine.generate(r, TIMEOUT).tokens for r in all_requests()]
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=scratch, disk_bytes=64 << 20))
    try:
        with Engine(loaded, EngineConfig(parallel=len(alone)), prompt_cache) as engine:
            handles = [engine.submit(r) for r in all_requests()]
            together = [h.collect(TIMEOUT) for h in handles]
    finally:
        prompt_cache.close()
    assert all(c.finish.reason == "length" for c in together), [c.finish.error for c in together]
    assert [c.tokens for c in together] == alone


def processed_by_mlx_vlm(vision, text: str, images: list, processor=None) -> dict:
    """mlx-vlm's own processor for the folder (its prompt expansion and pixels); `processor`:
    one loaded (and changed) already."""
    from mlx_vlm.utils import load_processor

    loaded, _ = vision
    processor = processor or load_processor(Path(loaded.path))
    out = processor(text=text, images=[image.rgb() for image in images])
    return {key: np.array(value) for key, value in out.items()}


def mlx_vlm_embeddings(reference_model, processed: dict):
    """mlx-vlm's whole model's input embeddings for its processor's output."""
    import mlx.core as mx

    kwargs = {}
    if "image_sizes" in processed:
        kwargs["image_sizes"] = [tuple(int(v) for v in size) for size in processed["image_sizes"]]
    if "pixel_attention_mask" in processed:  # Idefics 3 / SmolVLM
        kwargs["pixel_attention_mask"] = mx.array(processed["pixel_attention_mask"])
    return reference_model.get_input_embeddings(
        mx.array(processed["input_ids"]), mx.array(processed["pixel_values"]), **kwargs
    ).inputs_embeds


def two_image_text(vision) -> str:
    """A text with two image placeholders (the model's own placeholder token)."""
    loaded, adapter = vision
    placeholder = loaded.tokenizer.convert_ids_to_tokens(adapter.placeholder_id)
    return f"Look: {placeholder} and then {placeholder} compare them"


def text_parts(vision, text: str, images: list) -> list:
    """The text with its placeholders (BOS first, as the tokenizer encodes it) as image_prompt
    parts."""
    loaded, adapter = vision
    parts: list = []
    tokens = list(loaded.tokenizer.encode(text))
    index = 0
    run: list[int] = []
    for token in tokens:
        if token == adapter.placeholder_id:
            parts += [run, images[index]]
            run, index = [], index + 1
        else:
            run.append(token)
    return [*parts, run]


def mlx_vlm_greedy(language, logits, cache, first_position: int | None = None,
                   steps: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from mlx-vlm's language model, continuing
    from its prefill `logits` with its `cache`; with `first_position`, decode step i runs at
    3-D position first_position + i (Qwen's index + rope delta)."""
    import mlx.core as mx
    import mlx.nn as nn

    tokens, logprobs = [], []
    for step in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
        logprobs.append(float(nn.log_softmax(logits[0, -1].astype(mx.float32))[token]))
        kwargs = {} if first_position is None else {
            "position_ids": mx.full((3, 1, 1), first_position + step, dtype=mx.int32)}
        logits = language(mx.array([[token]]), cache=cache, **kwargs).logits
    return tokens, logprobs


def qwen_mlx_vlm_inputs(reference_model, adapter, prompt: ImagePrompt):
    """mlx-vlm's own input features for a Qwen-VL-family prompt and its images (embeddings,
    position ids, rope deltas; Qwen3-VL's deepstack too), and the token ids [1, T]."""
    import mlx.core as mx

    ids = mx.array([prompt.tokens])
    pixels = [adapter.preprocess(span.image) for span in prompt.prompt.spans]
    patches = mx.array(np.concatenate([p for p, _ in pixels]))
    grids = mx.array(np.concatenate([g for _, g in pixels]))
    return ids, reference_model.get_input_embeddings(ids, patches, image_grid_thw=grids)


def assert_prompt_cache_keeps_image_answers(vision, scratch: Path) -> None:
    """A repeat restores the whole prefix; a restore that stops inside the image span prefills
    the rest of it from the image's features; the next turn restores the answer; another image
    at the same place misses from its first block. Each gives the uncached answer."""
    from rewind.cache import PromptCache
    from rewind.config import BLOCK_TOKENS

    loaded, _ = vision
    image = picture(7)
    prefix = prefix_of(loaded, 230)
    first = image_prompt(vision, [prefix, image, " first question, about the shapes"])
    other = image_prompt(vision, [prefix, image, " another question entirely"])
    span = other.prompt.spans[0]
    assert span.start < BLOCK_TOKENS < span.end
    late = prefix_of(loaded, 300)
    swapped = [image_prompt(vision, [late, picture(seed), " describe it"]) for seed in (8, 9)]
    assert swapped[0].tokens == swapped[1].tokens  # same size: only the pixels differ
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=scratch, disk_bytes=64 << 20))
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            answer = engine.generate(generation(first), TIMEOUT)
            again = engine.generate(generation(first), TIMEOUT)
            inside = engine.generate(generation(other), TIMEOUT)
            turn2 = image_prompt(vision, [prefix, image, " first question, about the shapes",
                                          answer.tokens, " and the colours?"])
            second = engine.generate(generation(turn2), TIMEOUT)
            engine.generate(generation(swapped[0]), TIMEOUT)
            replaced = engine.generate(generation(swapped[1]), TIMEOUT)
    finally:
        prompt_cache.close()
    assert answer.finish.usage.cached_tokens == 0
    assert again.finish.usage.cached_tokens == len(first.tokens) - 1
    assert inside.finish.usage.cached_tokens == BLOCK_TOKENS
    assert second.finish.usage.cached_tokens == len(first.tokens) + len(answer.tokens) - 1
    assert replaced.finish.usage.cached_tokens == BLOCK_TOKENS  # the span starts at 300
    assert_same(answer, reference(vision, first))
    assert_same(again, reference(vision, first))
    assert_same(inside, reference(vision, other))
    assert_same(second, reference(vision, turn2))
    expected = reference(vision, swapped[1])
    assert_same(replaced, expected)
    assert expected.tokens != reference(vision, swapped[0]).tokens  # the image does matter


def user_with_image(seed: int, size: tuple[int, int] = (320, 240)) -> list[dict]:
    url = f"data:image/png;base64,{png_base64(seed, size)}"
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def answer(completion) -> str:
    """The whole answer text: the tiny tokenizer's chat template has <think> tags, so a random
    model's text may come back as reasoning_content."""
    message = completion.choices[0].message
    return (getattr(message, "reasoning_content", None) or "") + (message.content or "")


def streamed_answer(stream) -> str:
    """The whole answer text of a streamed OpenAI chat completion (reasoning included)."""
    return "".join((getattr(chunk.choices[0].delta, "reasoning_content", None) or "")
                   + (chunk.choices[0].delta.content or "") for chunk in stream if chunk.choices)


@contextmanager
def live_vision_server(loaded, scratch: Path) -> Iterator[tuple[object, str, Engine]]:
    """The live HTTP server (uvicorn on loopback) over `loaded` with a prompt cache in
    `scratch`: yields the real `openai` client, the model name and the engine."""
    import openai
    from live_server import serve_on_free_port

    from rewind.cache.prompt_cache import PromptCache
    from rewind.server.app import create_app

    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=scratch, disk_bytes=64 << 20))
    engine = Engine(loaded, EngineConfig(parallel=2), prompt_cache).start()
    url, server, thread = serve_on_free_port(create_app(loaded, engine, ServerConfig(),
                                                        prompt_cache))
    try:
        yield (openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0),
               str(loaded.name), engine)
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
        prompt_cache.close()
