"""The fast paths compute the same thing as the plain model: last-position logits, chunked
prefill, the single-sequence generator, the CPU decode head and the per-backend loader.

Tolerances: everything computes in float32 on CPU. Different graph shapes (one chunk vs several,
the head applied to one position vs all) only reorder float32 sums, so logits agree to ~1e-5;
we allow 1e-4 absolute + 1e-4 relative.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rewind.kernels import fast_head
from rewind.engine.forward import last_logits, prefill
from rewind.kernels.model_split import split_model
from rewind.engine.single import BLOCK_TOKENS, chunk_ends, generate_tokens, prefill_prompt
from rewind.models.loader import load_model, prepare_for_backend

ATOL = RTOL = 1e-4


def _prompt(length: int, vocab: int, seed: int = 7) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=length).tolist()


@pytest.fixture(scope="module")
def loaded(tiny_model_path: Callable[[str], Path]):
    """Tiny models loaded through Rewind's loader, without a fast head (exact MLX path)."""
    models = {}

    def get(family: str):
        if family not in models:
            models[family] = load_model(str(tiny_model_path(family)), cpu_head="off")
        return models[family]

    return get


def test_chunk_ends_follow_one_grid() -> None:
    # Grid multiples, the last token alone, the end.
    assert chunk_ends(0, 1000, 256) == [256, 512, 768, 999, 1000]
    assert chunk_ends(0, 512, 256) == [256, 511, 512]
    assert chunk_ends(100, 300, 64) == [128, 192, 256, 299, 300]  # a restore realigns first
    assert chunk_ends(0, 300, 64, stops=[70, 300, 400]) == [64, 70, 128, 192, 256, 299, 300]
    assert chunk_ends(5, 6, 256) == [6]
    ends = chunk_ends(37, 5000, 64)
    assert all(end % BLOCK_TOKENS == 0 for end in ends if end in range(256, 4999, 256))
    assert set(range(256, 5000, 256)) <= set(ends)  # every block boundary is a call's end
    assert all(b - a <= 64 for a, b in zip([37, *ends], ends)) and ends[-1] == 5000


def test_split_is_known_for_every_tiny_family(loaded, tiny_family: str) -> None:
    assert split_model(loaded(tiny_family).model) is not None


def test_last_logits_equal_full_model(loaded, tiny_family: str) -> None:
    model = loaded(tiny_family).model
    tokens = mx.array([_prompt(150, 512)])  # crosses gemma3's 64-token window
    full = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
    fast = last_logits(model, tokens, make_prompt_cache(model))
    assert fast.shape == (1, 512) and fast.dtype == mx.float32
    np.testing.assert_allclose(np.array(fast), np.array(full), atol=ATOL, rtol=RTOL)


def test_tied_head_split_equals_full_model(loaded) -> None:
    """The default model ties its output projection to the embedding; the tiny models do not."""
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs.from_dict(loaded("gemma3").config)
    mx.random.seed(3)
    model = gemma3_text.Model(args)
    model.sanitize({})  # no lm_head.weight: tied, as in Gemma 3 270M
    model.set_dtype(mx.float32)
    assert model.tie_word_embeddings
    tokens = mx.array([_prompt(20, args.vocab_size)])
    full = model(tokens)[:, -1, :]
    fast = last_logits(model, tokens, make_prompt_cache(model))
    np.testing.assert_allclose(np.array(fast), np.array(full), atol=ATOL, rtol=RTOL)


def test_prefill_fills_the_cache_without_logits(loaded, tiny_family: str) -> None:
    model = loaded(tiny_family).model
    tokens = _prompt(90, 512)
    cache = make_prompt_cache(model)
    prefill(model, mx.array([tokens[:-1]]), cache)
    after_prefill = last_logits(model, mx.array([tokens[-1:]]), cache)
    one_shot = last_logits(model, mx.array([tokens]), make_prompt_cache(model))
    np.testing.assert_allclose(np.array(after_prefill), np.array(one_shot), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_equals_one_shot(loaded, tiny_family: str) -> None:
    model = loaded(tiny_family).model
    tokens = _prompt(530, 512, seed=11)
    boundaries: list[int] = []
    chunked_cache = make_prompt_cache(model)
    chunked = prefill_prompt(model, mx.array(tokens), chunked_cache,
                             on_boundary=lambda position, _cache: boundaries.append(position))
    assert boundaries == [256, 512]
    one_shot = last_logits(model, mx.array([tokens]), make_prompt_cache(model))
    np.testing.assert_allclose(np.array(chunked), np.array(one_shot), atol=ATOL, rtol=RTOL)
    # The caches agree too: one more step from each gives the same logits.
    step = mx.array([[5]])
    one_shot_cache = make_prompt_cache(model)
    prefill(model, mx.array([tokens]), one_shot_cache)
    np.testing.assert_allclose(np.array(last_logits(model, step, chunked_cache)),
                               np.array(last_logits(model, step, one_shot_cache)),
                               atol=ATOL, rtol=RTOL)


def test_generate_tokens_greedy_equals_mlx_lm(loaded, tiny_family: str) -> None:
    from mlx_lm.generate import generate_step

    model = loaded(tiny_family).model
    prompt = _prompt(280, 512, seed=5)
    ours = [token for token, _ in generate_tokens(model, prompt, max_tokens=16)]
    theirs = [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=16,
                                                   sampler=lambda lp: mx.argmax(lp, axis=-1))]
    assert ours == theirs
    assert len(set(ours)) > 1  # the tiny models do not collapse onto one token


def test_generate_tokens_continues_a_restored_cache(loaded) -> None:
    """A cache that already holds a prefix: the generator computes only the rest."""
    model = loaded("gemma3").model
    prompt = _prompt(200, 512, seed=9)
    whole = [t for t, _ in generate_tokens(model, prompt, max_tokens=8)]
    cache = make_prompt_cache(model)
    prefill(model, mx.array([prompt[:130]]), cache)
    resumed = [t for t, _ in generate_tokens(model, prompt[130:], cache=cache, max_tokens=8)]
    assert resumed == whole


def test_logprobs_are_normalized(loaded) -> None:
    model = loaded("llama").model
    _, logprobs = next(generate_tokens(model, _prompt(10, 512), max_tokens=1))
    assert logprobs.shape == (512,)
    assert abs(float(mx.logsumexp(logprobs).item())) < 1e-4


kernel_needed = pytest.mark.skipif(fast_head.build_kernel() is None,
                                   reason="the C head kernel needs x86-64 AVX2 and a C compiler")


@kernel_needed
@pytest.mark.parametrize("rows", [1, 3, 11])
@pytest.mark.cpu_only
def test_cpu_head_bf16_matches_float32_matmul(rows: int) -> None:
    mx.random.seed(1)
    # bf16-representable weights (a bf16 checkpoint widened to float32): the bf16 head is exact
    # up to summation order. A dim that is not a multiple of 8 exercises the kernel's tail loop.
    weight = (mx.random.normal((1000, 77)) * 0.1).astype(mx.bfloat16).astype(mx.float32)
    hidden = mx.random.normal((rows, 77))
    assert fast_head.bf16_is_exact(weight)
    head = fast_head.CpuHead(weight, "bf16", fast_head.build_kernel(), threads=2)
    np.testing.assert_allclose(np.array(head(hidden)), np.array(hidden @ weight.T),
                               atol=ATOL, rtol=RTOL)


@kernel_needed
@pytest.mark.cpu_only
def test_cpu_head_int8_is_within_its_rounding_bound() -> None:
    mx.random.seed(2)
    weight = mx.random.normal((4096, 64)) * 0.05
    hidden = mx.random.normal((2, 64))
    head = fast_head.CpuHead(weight, "int8", fast_head.build_kernel())
    exact, approx = np.array(hidden @ weight.T), np.array(head(hidden))
    # Per-row symmetric int8: each product is off by at most half a step of its row's scale.
    half_step = np.abs(np.array(weight)).max(axis=1) / 127 / 2  # [vocab]
    bound = np.abs(np.array(hidden)).sum(axis=1)[:, None] * half_step[None, :]  # [rows, vocab]
    assert np.all(np.abs(approx - exact) <= bound + 1e-5)
    assert np.abs(approx - exact).max() > 0  # it really is the int8 path
    assert head.nbytes < weight.nbytes / 3


@kernel_needed
@pytest.mark.cpu_only
def test_installed_head_is_used_by_last_logits(tiny_model_path) -> None:
    loaded_model = load_model(str(tiny_model_path("llama")), cpu_head="off")
    model = loaded_model.model
    # fp32 random weights are not bf16-exact: "auto" refuses, so the answer never changes silently.
    assert fast_head.install_fast_head(model, "auto") is None
    model.lm_head.weight = model.lm_head.weight.astype(mx.bfloat16).astype(mx.float32)
    assert fast_head.install_fast_head(model, "auto") is not None
    tokens = mx.array([_prompt(40, 512)])
    full = model(tokens)[:, -1, :]
    fast = last_logits(model, tokens, make_prompt_cache(model))
    np.testing.assert_allclose(np.array(fast), np.array(full), atol=ATOL, rtol=RTOL)
    fast_head.remove_fast_head(model)
    assert fast_head.fast_head(model) is None


@pytest.mark.cpu_only
def test_prepare_for_backend_computes_in_float32_on_cpu(tiny_model_path) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, quantize_model

    model, _ = load(str(tiny_model_path("llama")))
    model.set_dtype(mx.bfloat16)
    quantize_model(model, {}, group_size=32, bits=8)
    prepare_for_backend(model, cpu_head="off")
    dtypes = {value.dtype for _, value in tree_flatten(model.parameters())}
    assert dtypes == {mx.float32}  # dequantized: MLX's CPU quantized matmul is not the fast path


def test_fast_gelu_matches_mlx_gelu_approx() -> None:
    import mlx.nn as nn

    from rewind.models.cpu_activations import gelu_tanh, tanh_rational

    x = mx.linspace(-12, 12, 200_001)
    np.testing.assert_allclose(np.array(tanh_rational(x)), np.array(mx.tanh(x)), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.array(gelu_tanh(x)), np.array(nn.gelu_approx(x)),
                               atol=2e-6, rtol=1e-6)


@pytest.mark.cpu_only
def test_fast_gelu_swap_keeps_weights_and_answers(tiny_model_path) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from rewind.models.cpu_activations import use_fast_gelu

    plain, _ = load(str(tiny_model_path("gemma3")))
    swapped, _ = load(str(tiny_model_path("gemma3")))
    names_before = [name for name, _ in tree_flatten(swapped.parameters())]
    assert use_fast_gelu(swapped) == 6  # one MLP per layer
    assert [name for name, _ in tree_flatten(swapped.parameters())] == names_before
    tokens = mx.array([_prompt(100, 512)])
    np.testing.assert_allclose(np.array(swapped(tokens)), np.array(plain(tokens)),
                               atol=ATOL, rtol=RTOL)
