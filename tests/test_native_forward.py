"""The CPU forward pass (rewind.kernels.native_forward): the same answers as MLX's path.

Every test compares a model loaded with the kernels against the same folder loaded with
REWIND_NATIVE=off (MLX's own layers), on tiny random models of each supported family: greedy
tokens identical, logits within float32 summation-order noise, for prefill (whole prompts, chunks
at any offset, no cache, input embeddings) and decode, across sliding windows, past 256-token
blocks, in a continuous batch of rows at different positions, and after a trimmed cache.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.kernels import boundary, native
from rewind.kernels.boundary import KernelCallError, MatrixArgs
from rewind.engine.forward import last_logits
from rewind.kernels.native_forward import (install_native_forward, native_forward,
                                          remove_native_forward)
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model

pytestmark = [pytest.mark.cpu_only, pytest.mark.skipif(native.load_kernels() is None,
                                reason="needs x86-64 AVX2 and a C compiler")]

# Families beyond the factory's three, built from its llama config with overrides.
EXTRA_FAMILIES = {
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},  # q/k/v biases
    "llama-biased": {"attention_bias": True, "mlp_bias": True},
    # Llama 3.1+ rope scaling (mlx-lm's Llama3RoPE: explicit periods); a short original context
    # so that most of the tiny model's frequencies are scaled or smoothed.
    "llama3-rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256}},
}
FAMILIES = ["gemma3", "llama", *EXTRA_FAMILIES]
LOGIT_TOLERANCE = 1e-4  # float32 weights: only the order of summation differs


def assert_logits_close(got: np.ndarray, expected: np.ndarray,
                        tolerance: float = LOGIT_TOLERANCE) -> None:
    """Within float32 summation-order noise, relative to the logits' size (a wrong kernel is off
    by whole units)."""
    scale = max(1.0, float(np.abs(expected).max()))
    assert np.abs(got - expected).max() < tolerance * scale


@pytest.fixture(autouse=True)
def mlx_attention_in_mlx_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference is MLX's own layers and attention (the C attention is checked against
    mx.fast.scaled_dot_product_attention in test_cpu_attention)."""
    monkeypatch.setenv("REWIND_CPU_ATTENTION", "off")


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory: pytest.TempPathFactory):
    """model_pair(family) -> (with kernels, MLX path): two loads of one tiny model folder."""
    pairs: dict[str, tuple] = {}

    def get(family: str):
        if family not in pairs:
            base, overrides = (family, None) if family in ("gemma3", "llama") else (
                "llama", EXTRA_FAMILIES[family])
            folder = build_tiny_model(base, tmp_path_factory.mktemp(f"native-{family}"),
                                      overrides=overrides)
            pairs[family] = (load_model(str(folder)), load_model(str(folder), native_forward="off"))
        return pairs[family]

    return get


def decode_trace(model, prompt: list[int], steps: int, cache=None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logits of every step, through rewind.engine.forward."""
    cache = cache if cache is not None else make_prompt_cache(model)
    logits = last_logits(model, mx.array([prompt]), cache)
    tokens, rows = [], []
    for _ in range(steps):
        token = int(mx.argmax(logits[0]).item())
        tokens.append(token)
        logits = last_logits(model, mx.array([[token]]), cache)
        rows.append(np.array(logits[0].astype(mx.float32)))
    return tokens, np.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_are_installed_for_supported_families(model_pair, family: str) -> None:
    fast, plain = model_pair(family)
    forward = native_forward(fast.model)
    assert forward is not None and forward.form == "f32"  # random float32 weights: not bf16-exact
    assert native_forward(plain.model) is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt_tokens", [5, 150, 300])  # inside, across the 64 window, > 256
def test_decode_equals_mlx_path(model_pair, family: str, prompt_tokens: int) -> None:
    fast, plain = model_pair(family)
    prompt = np.random.default_rng(prompt_tokens).integers(3, 200, prompt_tokens).tolist()
    fast_tokens, fast_logits = decode_trace(fast.model, prompt, 40)
    plain_tokens, plain_logits = decode_trace(plain.model, prompt, 40)
    assert fast_tokens == plain_tokens
    assert_logits_close(fast_logits, plain_logits)
    assert len(set(fast_tokens)) > 3  # a random model that repeats one token would prove little


def chunked_logits(model, prompt: list[int], chunks: list[int], cache) -> np.ndarray:
    """Logits of every prompt position, fed through `cache` in chunks of the given sizes (the
    last chunk takes the rest)."""
    rows, start = [], 0
    for size in [*chunks, len(prompt)]:
        end = min(len(prompt), start + size)
        if end > start:
            rows.append(np.array(model(mx.array([prompt[start:end]]), cache=cache)[0]))
        start = end
    return np.concatenate(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_equals_mlx_path(model_pair, family: str) -> None:
    """Every position's logits of a 300-token prompt, with no cache (one pass, causal and window
    masks built from the length) and through a cache in uneven chunks (offsets, chunks that
    straddle the 64-token window and the 256-token cache step)."""
    fast, plain = model_pair(family)
    prompt = np.random.default_rng(11).integers(3, 200, 300).tolist()
    expected = np.array(plain.model(mx.array([prompt]))[0])
    assert_logits_close(np.array(fast.model(mx.array([prompt]))[0]), expected)
    for model in (fast.model, plain.model):
        got = chunked_logits(model, prompt, [37, 64, 1, 120], make_prompt_cache(model))
        assert_logits_close(got, expected)


def test_prefill_through_a_rotating_cache_equals_mlx_path(model_pair) -> None:
    """--max-kv-size: every layer keeps the last 100 tokens (RotatingKVCache), and chunks longer
    than what is left of the window make mlx-lm rebuild it in temporal order."""
    fast, plain = model_pair("llama")
    prompt = np.random.default_rng(12).integers(3, 200, 260).tolist()
    fast_logits, plain_logits = (
        chunked_logits(loaded.model, prompt, [30, 90, 5, 80],
                       make_prompt_cache(loaded.model, max_kv_size=100))
        for loaded in (fast, plain))
    assert_logits_close(fast_logits, plain_logits)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_input_embeddings_equal_mlx_path(model_pair, family: str) -> None:
    """Image prompts hand the backbone embeddings instead of token ids (Gemma scales them too)."""
    fast, plain = model_pair(family)
    prompt = list(range(3, 80))
    table = plain.model.model.embed_tokens(mx.array([prompt]))
    embeddings = table + 0.5 * mx.random.normal(table.shape, key=mx.random.key(3))
    got, expected = (np.array(loaded.model(mx.array([prompt]), cache=make_prompt_cache(
        loaded.model), input_embeddings=embeddings)[0]) for loaded in (fast, plain))
    assert_logits_close(got, expected)


def test_quantized_kv_cache_equals_mlx_path(model_pair) -> None:
    """--kv-bits: the cache hands packed keys the C attention does not read; MLX's quantized
    attention runs between the kernels instead."""
    fast, plain = model_pair("llama")
    prompt = list(range(3, 110))
    results = []
    for loaded in (fast, plain):
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array([prompt]), cache=cache)
        cache = [layer.to_quantized(group_size=32, bits=8) for layer in cache]
        results.append(decode_trace(loaded.model, [7], 12, cache))
    assert results[0][0] == results[1][0]
    # Summation-order noise can move a key across an 8-bit rounding step: a thousandth, not more.
    assert_logits_close(results[0][1], results[1][1], tolerance=1e-3)


def test_remove_gives_the_mlx_call_back(tiny_model_path) -> None:
    loaded = load_model(str(tiny_model_path("llama")))
    backbone = loaded.model.model
    native_class = type(backbone)
    assert native_forward(loaded.model) is not None
    assert install_native_forward(loaded.model, "f32") is not None  # again: replaces, no nesting
    assert type(backbone) is native_class
    assert remove_native_forward(loaded.model)
    assert native_forward(loaded.model) is None and type(backbone) is native_class.__base__
    assert not remove_native_forward(loaded.model)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_continuous_batch_equals_mlx_path(model_pair, family: str) -> None:
    """Rows at different positions in mlx-lm's batch caches (left padding, rotating windows),
    joining and leaving the batch at different steps."""
    fast, plain = model_pair(family)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 200, n).tolist() for n in (3, 90, 270, 40)]
    lengths = [30, 12, 25, 18]

    def run(loaded) -> list[tuple[list[int], list[float]]]:
        config = EngineConfig(parallel=4, prefill_chunk=256)
        with Engine(loaded, config) as engine:
            handles = [engine.submit(GenerationRequest(p, SamplingParams(
                temperature=0.0, max_tokens=n, logprobs=True,
                logit_bias={t: -1e9 for t in engine.eos_token_ids})))
                for p, n in zip(prompts, lengths)]
            results = [h.collect(120) for h in handles]
        return [(r.tokens, r.logprobs) for r in results]

    for (fast_tokens, fast_lp), (plain_tokens, plain_lp) in zip(run(fast), run(plain)):
        assert fast_tokens == plain_tokens
        assert_logits_close(np.array(fast_lp), np.array(plain_lp))


def on_both_paths(forward, run, one_call_steps: int) -> list:
    """run() with steps through every layer in one C call (step.c), then with the same kernels
    called a layer at a time; checks that `one_call_steps` steps took the one call (at least
    that many where it is negative: minus the least)."""
    results = []
    try:
        for one_call in (True, False):
            forward.steps_in_one_call = one_call
            before = forward.one_call_steps
            results.append(run())
            taken = forward.one_call_steps - before
            if not one_call:
                assert taken == 0
            elif one_call_steps >= 0:
                assert taken == one_call_steps
            else:
                assert taken >= -one_call_steps
    finally:
        forward.steps_in_one_call = True
    return results


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen2"])
def test_steps_in_one_call_gives_the_per_layer_bits(model_pair, family: str) -> None:
    """Decode steps in one call: the same tokens and logits to the bit as a layer at a time,
    past Gemma's 64-token window (its ring buffers wrap) and the caches' 256-slot step."""
    fast, _ = model_pair(family)
    forward = native_forward(fast.model)
    assert forward.steps_in_one_call
    prompt = np.random.default_rng(5).integers(3, 200, 30).tolist()
    one_call, per_layer = on_both_paths(forward, lambda: decode_trace(fast.model, prompt, 240),
                                        240)
    assert one_call[0] == per_layer[0]
    assert np.array_equal(one_call[1], per_layer[1])


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_prompt_chunks_in_one_call_give_the_per_layer_bits(model_pair, family: str) -> None:
    """Prompt chunks over a cache that holds keys run every layer in one C call too: Gemma's
    window of 64 wraps its ring buffers, and mlx-lm's update then keeps the newest 63 keys in
    order before a chunk's own. Every position's logits are the per-layer path's, to the bit.
    A layer at a time still: the first chunk (an empty cache) and, on Gemma, the one-token
    chunk (mlx-lm first cuts the window's buffer a longer chunk left wider back)."""
    fast, _ = model_pair(family)
    prompt = np.random.default_rng(13).integers(3, 200, 330).tolist()
    one_call, per_layer = on_both_paths(
        native_forward(fast.model),
        lambda: chunked_logits(fast.model, prompt, [37, 64, 1, 120, 9],
                               make_prompt_cache(fast.model)),
        4 if family == "gemma3" else 5)
    assert np.array_equal(one_call, per_layer)


def test_batched_steps_in_one_call_gives_the_per_layer_bits(model_pair) -> None:
    """The engine's continuous batch (each row its own cache) with every decode step in one C
    call, rows joining and leaving: each row's tokens and logprobs are the per-layer path's."""
    fast, _ = model_pair("gemma3")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 200, n).tolist() for n in (3, 90, 40)]
    lengths = [30, 12, 80]

    def run() -> list[tuple[list[int], list[float]]]:
        with Engine(fast, EngineConfig(parallel=3, prefill_chunk=256)) as engine:
            handles = [engine.submit(GenerationRequest(p, SamplingParams(
                temperature=0.0, max_tokens=n, logprobs=True,
                logit_bias={t: -1e9 for t in engine.eos_token_ids})))
                for p, n in zip(prompts, lengths)]
            return [(r.tokens, r.logprobs) for r in (h.collect(120) for h in handles)]

    one_call, per_layer = on_both_paths(native_forward(fast.model), run,
                                        -(lengths[-1] - lengths[0]))
    assert one_call == per_layer


def test_decode_after_a_trimmed_cache_equals_mlx_path(model_pair) -> None:
    """Rewinding a full-attention cache (as the prompt cache does) and decoding again."""
    fast, plain = model_pair("llama")
    prompt = list(range(3, 120))
    results = []
    for loaded in (fast, plain):
        cache = make_prompt_cache(loaded.model)
        decode_trace(loaded.model, prompt, 10, cache)
        for layer in cache:
            layer.trim(30)
        results.append(decode_trace(loaded.model, [5], 20, cache))
    assert results[0][0] == results[1][0]
    assert_logits_close(results[0][1], results[1][1])


def test_bf16_and_int8_forms(tmp_path: Path) -> None:
    """bf16 on bf16-exact weights gives MLX's answer; int8 stays within its rounding."""
    folder = build_tiny_model("gemma3", tmp_path / "m")
    plain = load_model(str(folder), native_forward="off")
    for _, module in plain.model.named_modules():  # make every weight bf16-representable
        if "weight" in module and module["weight"].ndim == 2:
            module.weight = module.weight.astype(mx.bfloat16).astype(mx.float32)
    prompt = list(range(3, 100))
    plain_tokens, plain_logits = decode_trace(plain.model, prompt, 30)

    bf16 = install_native_forward(plain.model, "auto")
    assert bf16 is not None and bf16.form == "bf16"
    tokens, logits = decode_trace(plain.model, prompt, 30)
    assert tokens == plain_tokens
    assert_logits_close(logits, plain_logits)

    int8 = install_native_forward(plain.model, "int8")
    assert int8 is not None and int8.form == "int8" and int8.nbytes < bf16.nbytes * 0.6
    _, logits = decode_trace(plain.model, prompt, 1)
    difference = np.abs(logits[0] - plain_logits[0]).max()
    assert 0 < difference < 0.05 * np.abs(plain_logits[0]).max()


def test_unsupported_family_and_off_keep_mlx(tiny_model_path) -> None:
    hybrid = load_model(str(tiny_model_path("qwen3_5")))  # linear attention: not in the kernels
    assert native_forward(hybrid.model) is None
    llama = load_model(str(tiny_model_path("llama")), native_forward="off")
    assert native_forward(llama.model) is None
    with pytest.raises(ValueError, match="REWIND_NATIVE"):
        install_native_forward(llama.model, "fp8")


@pytest.mark.parametrize("form", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_matvec_matches_numpy(form: str, rows: int) -> None:
    """Odd sizes: output rows not a multiple of the 4-row block, inputs not of the vector width."""
    kernels = boundary.kernels()
    rng = np.random.default_rng(rows)
    out_dim, in_dim = 37, 70
    weight = rng.standard_normal((out_dim, in_dim)).astype(np.float32)
    x = rng.standard_normal((rows, in_dim)).astype(np.float32)
    scale = None
    if form == "bf16":
        stored = (weight.view(np.uint32) >> 16).astype(np.uint16)
        weight = (stored.astype(np.uint32) << 16).view(np.float32)
    elif form == "int8":
        scale = (np.abs(weight).max(axis=1) / 127).astype(np.float32)
        stored = np.round(weight / scale[:, None]).astype(np.int8)
        weight = stored.astype(np.float32) * scale[:, None]
    else:
        stored = weight
    y = np.empty((rows, out_dim), np.float32)
    matrix = MatrixArgs.build(stored, native.FORMS[form], scale)
    kernels.matvec(matrix, x, y, 2)
    np.testing.assert_allclose(y, x @ weight.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(KernelCallError, match="x"):
        kernels.matvec(matrix, x[:0], y, 2)  # no rows is refused, not read out of bounds


def test_loaded_bytes_counts_what_the_kernels_hold_beside_the_model(tiny_model_path) -> None:
    """The memory budget charges a model's int8 copies (its layers' and its C head's) on top of
    its arrays; the bf16 form reads the model's own arrays and adds nothing (issue 24: the head's
    copy was read from an attribute nothing set)."""
    from rewind.kernels.fast_head import fast_head
    from rewind.models.memory_estimate import kernel_copy_bytes, loaded_bytes

    path = str(tiny_model_path("llama"))
    exact = load_model(path, native_forward="bf16").model
    assert kernel_copy_bytes(exact) == 0
    copies = load_model(path, native_forward="int8", cpu_head="int8").model
    head, forward = fast_head(copies), native_forward(copies)
    assert head is not None and forward is not None and head.own_bytes > 0
    assert kernel_copy_bytes(copies) == head.own_bytes + forward.nbytes
    arrays_only = loaded_bytes(copies) - kernel_copy_bytes(copies)
    assert arrays_only > 0 and loaded_bytes(copies) > arrays_only
