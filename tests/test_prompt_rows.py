"""rewind.kernels.prompt_rows: a prompt call's products at padded row counts give the padded
product's rows on every backend (CPU here, CUDA where it runs), only prompt calls are taken, and
on CUDA a model's prompt calls pad (its fingerprint says so) with the engine's answers kept."""

from __future__ import annotations

import mlx.core as mx
import pytest

from rewind import env
from rewind.kernels import cuda_attention, prompt_rows

cuda = pytest.mark.skipif(not cuda_attention.available(), reason="needs MLX's CUDA backend")


def test_row_counts_round_up_to_the_bucket() -> None:
    assert [prompt_rows.padded_rows(n) for n in (1, 2, 31, 32, 33, 155, 256, 257)] == \
        [32, 32, 32, 32, 64, 160, 256, 288]
    with pytest.raises(ValueError):
        prompt_rows.padded_rows(0)


@pytest.mark.parametrize("batch,positions", [(1, 7), (1, 32), (1, 155), (3, 5)])
def test_the_product_is_the_padded_products_rows(batch: int, positions: int) -> None:
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    x = mx.random.normal((batch, positions, 96), key=mx.random.key(1)).astype(dtype)
    weight = mx.random.normal((80, 96), key=mx.random.key(2)).astype(dtype)
    ours = prompt_rows.product(x, weight)
    assert ours.shape == (batch, positions, 80) and ours.dtype == dtype
    rows = batch * positions
    flat = x.reshape(rows, 96)
    filler = mx.zeros((prompt_rows.padded_rows(rows) - rows, 96), dtype)
    padded = (mx.concatenate([flat, filler]) @ weight.T)[:rows]
    assert mx.array_equal(ours.reshape(rows, 80), padded)
    tolerance = 1e-4 if dtype == mx.float32 else 5e-2
    assert mx.allclose(ours, x @ weight.T, rtol=tolerance, atol=tolerance)


def test_the_product_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError):
        prompt_rows.product(mx.zeros((1, 4, 8)), mx.zeros((3, 9)))
    with pytest.raises(ValueError):
        prompt_rows.product(mx.zeros((4, 8)), mx.zeros((3, 8)))


def test_only_prompt_calls_are_taken() -> None:
    assert prompt_rows.takes(mx.zeros((1, 5, 8)))
    assert prompt_rows.takes(mx.zeros((2, 3, 8)))
    assert not prompt_rows.takes(mx.zeros((1, 1, 8)))  # a decode step
    assert not prompt_rows.takes(mx.zeros((6, 1, 8)))  # a decode batch: the compiled step's
    assert not prompt_rows.takes(mx.zeros((5, 8)))
    with env.overridden({env.PROMPT_ROWS: "off"}):
        assert not prompt_rows.takes(mx.zeros((1, 5, 8)))


def test_warm_plans_runs_each_shape_once_at_every_padded_count() -> None:
    weights = [mx.zeros((16, 8)), mx.zeros((16, 8)), mx.zeros((24, 8)), mx.zeros((4,))]
    # two distinct 2-D shapes, row counts 32, 64 and 96 for calls of up to 70 rows
    assert prompt_rows.warm_plans(weights, 70) == 6


def test_the_fingerprint_names_padded_products_where_the_model_has_them(tiny_model_path) -> None:
    from rewind.models.loader import load_model

    path = str(tiny_model_path("llama"))
    loaded = load_model(path)
    assert ("|rows32" in loaded.fingerprint) == cuda_attention.available()
    with env.overridden({env.PROMPT_ROWS: "off"}):
        assert "|rows" not in load_model(path).fingerprint


@cuda
def test_the_engine_answers_as_with_exact_row_counts(tiny_model_path) -> None:
    """On CUDA, through the engine with a prompt cache: a prompt cut in calls of several
    lengths, then a cached second turn whose tail is a new length, give the same tokens (and,
    up to bf16 rounding, log-probabilities) with padded and exact row counts."""
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine, GenerationRequest, SamplingParams
    from rewind.models.loader import load_model

    loaded = load_model(str(tiny_model_path("llama")))
    words = " ".join(f"word{i % 97} item{i % 13}" for i in range(400))
    first = loaded.tokenizer.encode(words)
    second = first + loaded.tokenizer.encode(" and then some more words about the items")

    def run(cache_dir) -> list[list[tuple[int, float]]]:
        from rewind.cache.prompt_cache import PromptCache

        cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(cache_dir=cache_dir))
        try:
            with Engine(loaded, EngineConfig(parallel=2), cache) as engine:
                no_eos = {int(t): -100.0 for t in engine.eos_token_ids}
                params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=True,
                                        logit_bias=no_eos)
                results = [engine.submit(GenerationRequest(p, params)).collect(120)
                           for p in (first, second)]
                assert results[1].finish.usage.cached_tokens > 0
        finally:
            cache.close()
        return [list(zip(r.tokens, r.logprobs)) for r in results]

    import tempfile

    with tempfile.TemporaryDirectory() as padded_dir, tempfile.TemporaryDirectory() as exact_dir:
        padded = run(padded_dir)
        with env.overridden({env.PROMPT_ROWS: "off"}):
            exact = run(exact_dir)
    for ours, theirs in zip(padded, exact):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=0.05)
