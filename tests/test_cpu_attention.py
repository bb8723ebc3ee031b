"""The C attention kernel (rewind.kernels.cpu_attention) against mx.fast.scaled_dot_product_attention:
every mask kind mlx-lm builds, grouped-query heads, decode and prefill shapes, bf16 keys, strided
cache views, rows that every key masks, and the inputs it refuses."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from rewind.kernels import boundary, native
from rewind.kernels.cpu_attention import attention

pytestmark = [pytest.mark.cpu_only, pytest.mark.skipif(native.load_kernels() is None or mx.default_device() != mx.cpu,
                                reason="needs the CPU backend, x86-64 AVX2 and a C compiler")]
TOLERANCE = 1e-4


def inputs(batch: int, heads: int, kv_heads: int, length: int, total: int, dim: int,
           kv_dtype=mx.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((batch, heads, length, dim)).astype(np.float32))
    # Keys and values as a cache hands them: a view of a larger, preallocated buffer.
    k, v = (mx.array(rng.standard_normal((batch, kv_heads, total + 9, dim)).astype(np.float32))
            .astype(kv_dtype)[:, :, :total, :] for _ in range(2))
    return q, k, v


def assert_matches_mlx(q, k, v, mask, scale: float = 0.1) -> None:
    expected = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float32),
                                                    v.astype(mx.float32), scale=scale, mask=mask)
    got = attention(q, k, v, scale, mask)
    assert got is not None and got.shape == expected.shape
    assert float(mx.abs(got - expected).max()) < TOLERANCE


@pytest.mark.parametrize("length,total", [(512, 512), (100, 900), (1, 1), (33, 33)])
def test_causal_prefill_at_any_offset(length: int, total: int) -> None:
    assert_matches_mlx(*inputs(1, 4, 1, length, total, 256), "causal")


@pytest.mark.parametrize("total", [900, 5000])  # 5000: keys split across threads, recombined
def test_decode_step(total: int) -> None:
    assert_matches_mlx(*inputs(1, 4, 1, 1, total, 256), None)


def test_batched_decode_with_grouped_heads_and_left_padding() -> None:
    mask = create_causal_mask(1, 800, left_padding=mx.array([0, 100, 790]))
    assert_matches_mlx(*inputs(3, 8, 2, 1, 801, 64), mask)


def test_sliding_window_mask() -> None:
    assert_matches_mlx(*inputs(1, 4, 1, 300, 811, 256), create_causal_mask(300, 511, window_size=512))


def test_random_boolean_and_additive_masks() -> None:
    rng = np.random.default_rng(5)
    assert_matches_mlx(*inputs(1, 4, 1, 1, 6000, 128), mx.array(rng.random((1, 1, 1, 6000)) > 0.5))
    additive = mx.array(rng.standard_normal((2, 1, 17, 40)).astype(np.float32))
    assert_matches_mlx(*inputs(2, 4, 4, 17, 40, 32), additive)


def _through_a_cache(cache, chunks: list[int], threads: int, kv_dtype=mx.bfloat16,
                     window: int | None = None) -> np.ndarray:
    """Each position's attention output when the positions arrive in `chunks` through `cache`
    as a model's layer feeds it: the mask mlx-lm builds before the update, then the kernel on
    what update_and_fetch returns. Queries, keys and values depend on the position only."""
    from mlx_lm.models.base import create_attention_mask

    total = sum(chunks)
    rng = np.random.default_rng(11)
    q_all = rng.standard_normal((1, 4, total, 64)).astype(np.float32)
    k_all, v_all = (mx.array(rng.standard_normal((1, 1, total, 64)).astype(np.float32))
                    .astype(kv_dtype) for _ in range(2))
    outs, start = [], 0
    for n in chunks:
        mask = create_attention_mask(mx.zeros((1, n, 1)), cache, window_size=window)
        keys, values = cache.update_and_fetch(k_all[:, :, start:start + n], v_all[:, :, start:start + n])
        got = attention(mx.array(q_all[:, :, start:start + n]), keys, values, 0.125, mask,
                        threads=threads, cache=cache)
        expected = mx.fast.scaled_dot_product_attention(
            mx.array(q_all[:, :, start:start + n]), keys.astype(mx.float32),
            values.astype(mx.float32), scale=0.125, mask=mask)
        assert got is not None and float(mx.abs(got - expected).max()) < TOLERANCE
        outs.append(np.array(got))
        start += n
    return np.concatenate(outs, axis=2)


@pytest.mark.parametrize("window", [None, 512])
def test_the_same_bits_in_any_chunking_thread_count_or_ring_rotation(window) -> None:
    """A position's output does not depend on how the positions came: whole, in chunks, one
    decode step at a time past a sliding window's wrap, on 1 or 4 threads (decode splits the
    keys over threads). The GGUF kernels quantize activations to int8, where any rounding
    difference would become a different answer (issue 25); before the kernel summed keys in
    order of position, a rotated window summed them in buffer order and differed."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    def make():
        return KVCache() if window is None else RotatingKVCache(max_size=window)

    whole = _through_a_cache(make(), [1300], threads=2, window=window)
    for chunks, threads in (([256, 256, 788], 2), ([700, 37, 63] + [1] * 500, 4),
                            ([1000] + [1] * 300, 1), ([511, 1, 788], 3)):
        got = _through_a_cache(make(), chunks, threads=threads, window=window)
        differing = np.argwhere(np.abs(got - whole).max(axis=(0, 1, 3)) > 0).ravel()
        assert differing.size == 0, f"{chunks[:4]}... on {threads} threads: positions {differing[:8]}"


@pytest.mark.parametrize("kind", ["rotating", "growing", "mlx-lm"])
def test_a_decode_step_reads_the_cache_before_its_update_plus_its_own_rows(kind, monkeypatch) -> None:
    """decode_attention_into (the native forward's one-token step) leaves the cache's update
    to be evaluated later and reads the buffers as they were plus the new rows: the same bits
    as updating first, through a sliding window's wrap and a growing cache's copies, and the
    same cache afterwards, with the layout it foresaw before the update (else it falls back
    to updating first). A prefill's over-long ring (its front is trimmed by the next update,
    so indices move) takes the other path."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from rewind.cache.kv import GrowingKVCache
    from rewind.kernels import cpu_attention
    from rewind.kernels.cpu_attention import attention_into, decode_attention_into

    def not_foreseen(*args, **kwargs):
        raise AssertionError("the cache moved otherwise than decode_attention_into foresaw")

    monkeypatch.setattr(cpu_attention, "attention_into", not_foreseen)  # its fallback

    def make():
        return {"rotating": lambda: RotatingKVCache(max_size=128),
                "growing": GrowingKVCache, "mlx-lm": KVCache}[kind]()

    rng = np.random.default_rng(3)
    steps = 300
    q = rng.standard_normal((steps, 1, 4, 1, 64)).astype(np.float32)
    kv = [(mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)).astype(mx.bfloat16),
           mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)).astype(mx.bfloat16))
          for _ in range(steps)]
    prompt = mx.array(rng.standard_normal((1, 2, 150, 64)).astype(np.float32)).astype(mx.bfloat16)
    lazy, eager = make(), make()
    for cache in (lazy, eager):
        mx.eval(cache.update_and_fetch(prompt, prompt))
    took_the_lazy_path = 0
    for step in range(steps):
        got, want = np.empty_like(q[step]), np.empty_like(q[step])
        if decode_attention_into(q[step], *kv[step], lazy, 0.125, None, got, threads=2):
            took_the_lazy_path += 1
            mx.async_eval([lazy.keys, lazy.values])
        else:
            keys, values = lazy.update_and_fetch(*kv[step])
            assert attention_into(q[step], keys, values, 0.125, None, got, 2, cache=lazy)
        keys, values = eager.update_and_fetch(*kv[step])
        assert attention_into(q[step], keys, values, 0.125, None, want, 2, cache=eager)
        assert np.array_equal(got, want), f"step {step}"
    assert took_the_lazy_path >= steps - 1  # all but the first step after the prefill's ring
    assert lazy.offset == eager.offset
    assert mx.array_equal(lazy.keys, eager.keys) and mx.array_equal(lazy.values, eager.values)


def test_bf16_keys_and_values() -> None:
    assert_matches_mlx(*inputs(1, 4, 1, 64, 300, 256, kv_dtype=mx.bfloat16), "causal")


def test_a_row_every_key_masks_gets_the_mean_of_the_values() -> None:
    """MLX fills masked scores with the dtype's minimum, so such a row averages every value."""
    assert_matches_mlx(*inputs(1, 4, 1, 5, 50, 16), mx.zeros((1, 1, 5, 50), dtype=mx.bool_))


def test_refuses_what_it_does_not_implement() -> None:
    q, k, v = inputs(1, 4, 1, 4, 10, 256)
    assert attention(q, k.astype(mx.float16), v.astype(mx.float16), 0.1, "causal") is None
    odd_q, odd_k, odd_v = inputs(1, 4, 1, 4, 10, 12)  # not a multiple of the vector width
    assert attention(odd_q, odd_k, odd_v, 0.1, "causal") is None
    assert attention(q, (k, k, k), (v, v, v), 0.1, None) is None  # a quantized cache's tuples
    with pytest.raises(ValueError, match="mask mode"):
        attention(q, k, v, 0.1, "sideways")


def test_mlx_layers_use_the_kernel_and_give_the_same_answer(tiny_model_path, monkeypatch) -> None:
    """A family without the native forward pass (the hybrid qwen3_5) gets the kernel in its MLX
    attention layers; its logits are those of mlx-lm's own attention."""
    from mlx_lm.models.cache import make_prompt_cache

    from rewind.models.loader import load_model

    loaded = load_model(str(tiny_model_path("qwen3_5")))
    prompt = mx.array([list(range(3, 150))])
    calls = []
    original = boundary.kernels().attention
    monkeypatch.setattr(boundary.kernels(), "attention",
                        lambda *args: calls.append(1) or original(*args))
    with_kernel = loaded.model(prompt, cache=make_prompt_cache(loaded.model))
    mx.eval(with_kernel)
    assert calls  # the kernel ran
    monkeypatch.setenv("REWIND_CPU_ATTENTION", "off")
    calls.clear()
    reference = loaded.model(prompt, cache=make_prompt_cache(loaded.model))
    mx.eval(reference)
    assert not calls
    assert float(mx.abs(with_kernel - reference).max()) < TOLERANCE * max(1.0, float(mx.abs(reference).max()))
