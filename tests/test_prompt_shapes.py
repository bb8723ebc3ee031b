"""rewind.kernels.prompt_shapes: a prompt call's attention at padded shapes that repeat gives
the exact-shape causal attention, on every backend (CPU here, CUDA where it runs), and a model's
prompt calls are routed through it only where it applies."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from rewind import env
from rewind.cache.capacity import ladder
from rewind.cache.kv import GrowingKVCache, make_cache
from rewind.kernels import cuda_attention, prompt_shapes

cuda = pytest.mark.skipif(not cuda_attention.available(), reason="needs MLX's CUDA backend")


def test_buckets_repeat_and_hold_the_call() -> None:
    assert [prompt_shapes.query_bucket(n) for n in (1, 16, 37, 255, 256, 257, 600)] \
        == [256, 256, 256, 256, 256, 512, 768]
    assert GrowingKVCache.ladder_rows(3109) == 4096
    assert ladder(3000) == [256, 512, 768, 1024, 1536, 2048, 3072]
    # every call of up to 256 tokens into a conversation of up to 12k tokens: one shape a rung
    seen = {(prompt_shapes.query_bucket(q), GrowingKVCache.ladder_rows(t))
            for t in range(256, 12_289, 7) for q in (1, 50, 200, 256) if q <= t}
    assert seen == {(256, rung) for rung in ladder(12_288)}
    assert len(seen) == 11
    with pytest.raises(ValueError):
        prompt_shapes.query_bucket(0)
    for bad in ((0, 10, 256), (11, 10, 256), (10, 300, 256)):
        with pytest.raises(ValueError):
            prompt_shapes.additive_mask(*bad, mx.float32)


def _filled(total: int, heads: int, dim: int, dtype: mx.Dtype, seed: int) -> GrowingKVCache:
    rng = np.random.default_rng(seed)
    cache = GrowingKVCache()
    for part in (total // 3, total - total // 3):  # two appends: the buffer grows once
        keys = mx.array(rng.standard_normal((1, heads, part, dim)).astype(np.float32))
        values = mx.array(rng.standard_normal((1, heads, part, dim)).astype(np.float32))
        cache.update_and_fetch(keys.astype(dtype), values.astype(dtype))
    return cache


@pytest.mark.parametrize("queries,tokens,heads,kv_heads,dim", [
    (1 + 36, 37, 4, 4, 32),       # a cold first call, padded 37 -> 256 queries
    (200, 700, 8, 2, 64),         # a later call, grouped heads, keys read to 768
    (256, 1280, 4, 1, 64),        # a full chunk, no query padding, keys to 1,536
    (5, 3109, 2, 2, 128),         # a short tail far into the conversation
])
def test_padded_attention_gives_the_exact_shapes_answer(queries, tokens, heads, kv_heads,
                                                        dim) -> None:
    dtype = mx.bfloat16
    cache = _filled(tokens, kv_heads, dim, dtype, seed=queries)
    rng = np.random.default_rng(tokens)
    q = mx.array(rng.standard_normal((1, heads, queries, dim)).astype(np.float32)).astype(dtype)
    keys, values = cache.keys[..., :tokens, :], cache.values[..., :tokens, :]
    assert prompt_shapes.takes(cache, keys, "causal", None)
    scale = dim ** -0.5
    padded = prompt_shapes.attention(q, cache, scale)
    exact = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask="causal")
    assert padded.shape == exact.shape == (1, heads, queries, dim)
    tolerance = 2e-2
    np.testing.assert_allclose(np.array(padded.astype(mx.float32)),
                               np.array(exact.astype(mx.float32)), atol=tolerance, rtol=tolerance)


def test_only_plain_prompt_calls_are_taken() -> None:
    cache = _filled(40, 2, 32, mx.bfloat16, seed=1)
    keys = cache.keys[..., :40, :]
    assert prompt_shapes.takes(cache, keys, "causal", None)
    assert not prompt_shapes.takes(cache, keys, None, None)
    assert not prompt_shapes.takes(cache, keys, mx.ones((1, 1, 4, 40), mx.bool_), None)
    assert not prompt_shapes.takes(cache, keys, "causal", mx.zeros((2,)))  # sinks
    assert not prompt_shapes.takes(cache, keys[..., :39, :], "causal", None)  # not its slice
    with env.overridden({env.PROMPT_SHAPES: "off"}):
        assert not prompt_shapes.takes(cache, keys, "causal", None)
    # heads cuDNN does not take (MLX's matmul path would hold the padded scores whole)
    for dim, dtype in ((256, mx.bfloat16), (32, mx.float32)):
        other = _filled(40, 2, dim, dtype, seed=2)
        assert not prompt_shapes.takes(other, other.keys[..., :40, :], "causal", None)
    from mlx_lm.models.cache import KVCache

    plain = KVCache()
    plain.update_and_fetch(mx.ones((1, 2, 40, 32)), mx.ones((1, 2, 40, 32)))
    assert not prompt_shapes.takes(plain, plain.keys[..., :40, :], "causal", None)


def test_a_models_prompt_calls_are_routed_and_give_its_logits(tiny_model_path, monkeypatch):
    """mlx-lm's Llama with Rewind's attention routing (installed on CUDA by the loader; here on
    whatever backend runs) takes each prompt call of a three-call prefill through the padded
    shapes and gets the exact-shape logits; a one-token call takes the decode kernel (here
    MLX's attention over the same keys stands in for it, where CUDA may be missing)."""
    from mlx_lm.utils import load

    model, _ = load(str(tiny_model_path("llama")))
    plain, _ = load(str(tiny_model_path("llama")))
    for which in (model, plain):  # bf16, as on a GPU: the shapes cuDNN takes
        which.set_dtype(mx.bfloat16)
    assert cuda_attention.use_in_model(model) > 0
    decode_calls: list[tuple[int, int]] = []

    def decode(queries, keys, values, length, starts, scale):
        decode_calls.append((queries.shape[2], length))
        return mx.fast.scaled_dot_product_attention(
            queries, keys[..., :length, :], values[..., :length, :], scale=scale)

    monkeypatch.setattr(cuda_attention, "decode_attention", decode)
    calls: list[tuple[int, int]] = []
    original = prompt_shapes.attention

    def recorded(queries, cache, scale):
        calls.append((queries.shape[2], cache.offset))
        return original(queries, cache, scale)

    monkeypatch.setattr(prompt_shapes, "attention", recorded)
    tokens = [(7 * i + 3) % 200 + 1 for i in range(300)]

    def logits(which) -> list[np.ndarray]:
        cache = make_cache(which)
        out = []
        for start, stop in ((0, 37), (37, 256), (256, 299), (299, 300)):
            step = which(mx.array([tokens[start:stop]]), cache=cache)
            out.append(np.array(step[:, -1, :].astype(mx.float32)))
        return out

    routed, exact = logits(model), logits(plain)
    layers = len(model.layers)
    assert calls == [(37, 37)] * layers + [(219, 256)] * layers + [(43, 299)] * layers
    assert decode_calls == [(1, 300)] * layers
    for ours, theirs in zip(routed, exact):
        np.testing.assert_allclose(ours, theirs, atol=0.05, rtol=0.05)


@cuda
def test_the_engine_answers_as_with_exact_shapes(tiny_model_path) -> None:
    """On CUDA, through the engine: a prompt cut in several calls, then a cached second turn,
    give the same tokens (and, up to bf16 rounding, log-probabilities) with padded and exact
    prompt shapes."""
    from rewind.config import EngineConfig
    from rewind.engine import Engine, GenerationRequest, SamplingParams
    from rewind.models.loader import load_model

    loaded = load_model(str(tiny_model_path("llama")))
    words = " ".join(f"word{i % 97} item{i % 13}" for i in range(400))
    first = loaded.tokenizer.encode(words)
    second = first + loaded.tokenizer.encode(" and then some more words about the items")

    def run() -> list[list[tuple[int, float]]]:
        with Engine(loaded, EngineConfig(parallel=2)) as engine:
            no_eos = {int(t): -100.0 for t in engine.eos_token_ids}
            params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=True,
                                    logit_bias=no_eos)
            results = [engine.submit(GenerationRequest(p, params)).collect(120)
                       for p in (first, second)]
        return [list(zip(r.tokens, r.logprobs)) for r in results]

    padded = run()
    with env.overridden({env.PROMPT_SHAPES: "off"}):
        exact = run()
    for ours, theirs in zip(padded, exact):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=0.05)


def test_warm_graphs_runs_a_full_chunk_at_every_rung_of_the_shapes_cudnn_takes(monkeypatch):
    """One call a rung up to the context asked (3,000 tokens: 256 to 3,072, seven rungs) for
    each head shape padded so far that cuDNN takes; the 256-wide heads take MLX's matmul path
    and are left alone."""
    monkeypatch.setattr(prompt_shapes, "seen",
                        lambda: {(mx.bfloat16, 4, 2, 64), (mx.bfloat16, 8, 2, 256)})
    assert prompt_shapes.warm_graphs(ladder(3000)) == 7
    monkeypatch.setattr(prompt_shapes, "seen", lambda: set())
    assert prompt_shapes.warm_graphs(ladder(3000)) == 0


def test_the_shapes_to_warm_are_the_threads_own() -> None:
    """A model's engines run on a thread of their own: another model's thread does not build
    graphs for this one's head shapes."""
    cache = _filled(40, 2, 32, mx.bfloat16, seed=1)
    mx.eval(prompt_shapes.attention(mx.zeros((1, 4, 8, 32), mx.bfloat16), cache, 0.1))
    assert (mx.bfloat16, 4, 2, 32) in prompt_shapes.seen()
    other: list[set] = []
    thread = threading.Thread(target=lambda: other.append(set(prompt_shapes.seen())))
    thread.start()
    thread.join()
    assert other == [set()]
