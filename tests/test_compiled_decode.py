"""rewind.engine.compiled_decode: the decode batch's call built once per shape and replayed gives
the answers of the plain call, on the path the server runs (the engine, its scheduler, its prompt
cache), for rows of mixed lengths that join and leave, across a growth of the KV buffers, with
and without pipelined decode. On the CPU it runs on MLX's own layers (REWIND_NATIVE=off); on a
GPU on the backend's layers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from rewind import env
from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.engine.compiled_decode import CompiledDecode, DecodeView
from rewind.models.loader import load_model

# float32 on every backend (tests/conftest.py); the compiled step may fuse elementwise chains
# into other roundings, and its attention runs over the whole buffer under a mask
LOGPROB_ATOL = 1e-4

TEXTS = ("one two three",
         "a longer prompt with quite a few more words in it than the first one has",
         "the middle one, of some length",
         "close to a rung of the ladder: " + "word " * 60)


def _answers(loaded, config: EngineConfig, prompts: list[list[int]], max_tokens: int
             ) -> tuple[list[list[tuple[int, float]]], int]:
    """Every prompt's greedy tokens and log-probabilities, the first three submitted together
    and the last once they are decoding (it joins the batch), then all again (prompt cache
    hits); and how many steps went through the compiled call."""
    steps = 0
    original = CompiledDecode.__call__

    def counted(self, segment):
        nonlocal steps
        out = original(self, segment)
        steps += out is not None
        return out

    CompiledDecode.__call__ = counted
    try:
        with Engine(loaded, config) as engine:
            no_eos = {int(t): -100.0 for t in engine.eos_token_ids}

            def submit(prompt: list[int]):
                return engine.submit(GenerationRequest(prompt, SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, logprobs=True, logit_bias=no_eos)))

            answers = []
            for _ in range(2):
                streams = [submit(p) for p in prompts[:3]]
                first = next(streams[0].events(300))  # the first rows decode before the last joins
                streams.append(submit(prompts[3]))
                results = [s.collect(300) for s in streams]
                answers.append([(first.token, first.logprob),
                                *zip(results[0].tokens, results[0].logprobs)])
                answers += [list(zip(r.tokens, r.logprobs)) for r in results[1:]]
    finally:
        CompiledDecode.__call__ = original
    return answers, steps


@pytest.mark.parametrize("family,pipelined", [("llama", False), ("llama", True),
                                               ("qwen3_5", False), ("qwen3_5", True)])
def test_compiled_decode_gives_the_plain_calls_answers(tiny_model_path, family: str,
                                                       pipelined: bool, caplog) -> None:
    """Full attention (Llama) and full attention beside linear attention (Qwen 3.5, whose
    recurrence runs through mlx-lm's ops inside the trace where Rewind's kernel computes on
    the host, and stays Rewind's kernel for every other call)."""
    loaded = load_model(str(tiny_model_path(family)), native_forward="off")
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    # the last prompt's row crosses a rung of the capacity ladder (256) while it decodes
    assert 150 < len(prompts[3]) < 256
    max_tokens = 256 + 8 - len(prompts[3])
    config = EngineConfig(parallel=4, pipeline_decode=pipelined, speculative="off")
    with env.overridden({env.COMPILED_DECODE: "on"}):
        compiled, steps = _answers(loaded, config, prompts, max_tokens)
    with env.overridden({env.COMPILED_DECODE: "off"}):
        plain, plain_steps = _answers(loaded, config, prompts, max_tokens)
    assert steps > max_tokens and plain_steps == 0
    assert not [r for r in caplog.records if "kernel failed" in r.getMessage()]
    for ours, theirs in zip(compiled, plain):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs],
                                                       abs=LOGPROB_ATOL)


def test_the_default_compiles_on_cuda_only(tiny_model_path) -> None:
    """REWIND_COMPILED_DECODE=auto (the default): compiled steps on MLX's CUDA backend, where
    they were measured faster, and none elsewhere."""
    from rewind.kernels.cuda_attention import available

    loaded = load_model(str(tiny_model_path("llama")), native_forward="off")
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    with env.overridden({env.COMPILED_DECODE: "auto"}):
        _, steps = _answers(loaded, EngineConfig(parallel=4, speculative="off"), prompts, 6)
    assert (steps > 0) == available()


def test_caches_a_view_does_not_fit_take_the_plain_call(tiny_model_path) -> None:
    """Sliding windows (Gemma 3) keep their own caches: no step goes through the compiled
    call."""
    loaded = load_model(str(tiny_model_path("gemma3")), native_forward="off")
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    with env.overridden({env.COMPILED_DECODE: "on"}):
        _, steps = _answers(loaded, EngineConfig(parallel=4, speculative="off"), prompts, 6)
    assert steps == 0


def test_a_view_attends_to_each_rows_keys_and_writes_in_place() -> None:
    keys = mx.zeros((2, 1, 8, 4))
    view = DecodeView(keys, keys, mx.array([1, 3], mx.int32), mx.array([5], mx.int32))
    assert view.offset.tolist() == [4, 2]  # each row's position of the new token
    allowed = view.make_mask(1).reshape(2, 8).tolist()
    assert allowed == [[False, True, True, True, True, True, False, False],
                       [False, False, False, True, True, True, False, False]]
    new_keys, _ = view.update_and_fetch(mx.ones((2, 1, 1, 4)), mx.ones((2, 1, 1, 4)))
    assert new_keys.shape == (2, 1, 8, 4)
    assert mx.sum(new_keys, axis=(1, 3)).tolist() == [[0, 0, 0, 0, 0, 4, 0, 0]] * 2
    with pytest.raises(ValueError):
        view.make_mask(1, window_size=4)
    with pytest.raises(ValueError):
        view.update_and_fetch(mx.ones((2, 1, 2, 4)), mx.ones((2, 1, 2, 4)))


def test_on_cuda_a_views_attention_is_the_kernel_with_the_views_length(tiny_model_path,
                                                                       monkeypatch) -> None:
    """rewind.kernels.cuda_attention routes a view's attention to the decode kernel with the
    whole buffers, the length after the step's key and each row's first key; here with the kernel
    replaced by its definition (any backend), the logits of mlx-lm's masked batch step."""
    import numpy as np
    from mlx_lm.utils import load

    from rewind.cache.kv import GrowingBatchKVCache, make_cache
    from rewind.kernels import cuda_attention

    calls: list[tuple[int, list[int]]] = []

    def definition(queries, key_buffer, value_buffer, length, starts, scale, bounds_memo=None):
        length = int(length.item())
        calls.append((length, starts.tolist()))
        return mx.concatenate([mx.fast.scaled_dot_product_attention(
            queries[b:b + 1], key_buffer[b:b + 1, :, start:length],
            value_buffer[b:b + 1, :, start:length], scale=scale)
            for b, start in enumerate(starts.tolist())])

    monkeypatch.setattr(cuda_attention, "decode_attention", definition)
    routed, _ = load(str(tiny_model_path("llama")))
    plain, _ = load(str(tiny_model_path("llama")))
    assert cuda_attention.use_in_model(routed) > 0

    def batch_of(model) -> list[GrowingBatchKVCache]:
        rows = []
        for prompt in ([5, 9, 13, 17, 21, 25, 29], [7, 11, 15]):
            cache = make_cache(model)
            mx.eval(model(mx.array([prompt]), cache=cache))
            rows.append(cache)
        return [GrowingBatchKVCache.merge([a, b]) for a, b in zip(*rows)]

    tokens = mx.array([[40], [41]])
    views = [DecodeView(c.keys, c.values, c.left_padding.astype(mx.int32),
                        mx.array([c._idx], mx.int32)) for c in batch_of(routed)]
    through_views = np.array(routed(tokens, cache=views))
    masked = np.array(plain(tokens, cache=batch_of(plain)))
    assert calls == [(8, [0, 4])] * len(routed.layers)
    np.testing.assert_allclose(through_views, masked, atol=1e-4, rtol=1e-4)


def test_a_layer_that_scores_keys_itself_takes_the_plain_call(tiny_model_path) -> None:
    """A family whose attention does not go through scaled_dot_product_attention would read a
    view's whole buffer (OLMo adds the mask to its scores): a model with such a layer keeps the
    plain call, and its answers."""
    from mlx_lm.models import llama

    class OwnScores(llama.Attention):
        def __call__(self, x, mask=None, cache=None):
            batch, length, _ = x.shape
            def heads(projected, count):
                return projected.reshape(batch, length, count, -1).transpose(0, 2, 1, 3)

            queries = heads(self.q_proj(x), self.n_heads)
            keys = heads(self.k_proj(x), self.n_kv_heads)
            values = heads(self.v_proj(x), self.n_kv_heads)
            queries = self.rope(queries, offset=cache.offset)
            keys, values = cache.update_and_fetch(self.rope(keys, offset=cache.offset), values)
            repeats = self.n_heads // self.n_kv_heads
            keys, values = mx.repeat(keys, repeats, axis=1), mx.repeat(values, repeats, axis=1)
            scores = (queries * self.scale) @ keys.transpose(0, 1, 3, 2)
            if isinstance(mask, mx.array):
                scores = mx.where(mask, scores, -mx.inf)
            elif mask == "causal":
                scores = scores + mx.triu(mx.full((length, keys.shape[2]), -mx.inf),
                                          k=keys.shape[2] - length + 1)
            out = mx.softmax(scores, axis=-1) @ values
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    loaded = load_model(str(tiny_model_path("llama")), native_forward="off")
    loaded.model.layers[1].self_attn.__class__ = OwnScores
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    with env.overridden({env.COMPILED_DECODE: "on"}):
        _, steps = _answers(loaded, EngineConfig(parallel=4, speculative="off"), prompts, 6)
    assert steps == 0


def _step_memory(model, lengths: tuple[int, int]) -> tuple[int, int]:
    """(peak memory over six compiled steps of a batch of two rows of these prompt lengths,
    less the memory held before them; the batch's KV buffers' bytes)."""
    from rewind.cache.kv import GrowingBatchKVCache, make_cache
    from rewind.engine.segment import Segment
    from rewind.kernels.model_split import split_model

    rows = []
    for length in lengths:
        cache = make_cache(model)
        mx.eval(model(mx.array([[5] * length]), cache=cache))
        rows.append(cache)
    batch = [GrowingBatchKVCache.merge(pair) for pair in zip(*rows)]
    mx.eval([(layer.keys, layer.values) for layer in batch])
    del rows
    buffers = sum(layer.keys.nbytes + layer.values.nbytes for layer in batch)
    step = CompiledDecode(split_model(model).backbone)
    segment = Segment(mx.array([[7], [8]]), batch, logits=True)
    mx.reset_peak_memory()
    active = mx.get_active_memory()  # the weights and these buffers
    with env.overridden({env.COMPILED_DECODE: "on"}):
        for _ in range(6):
            assert step.takes(segment)
            mx.eval(step(segment), [layer.state for layer in batch])
    # six steps of one row count and capacity: one shape traced, replayed five times
    assert step.steps == 6 and step.traces == 1 and batch[0]._idx == max(lengths) + 6
    return mx.get_peak_memory() - active, buffers


def test_the_step_writes_the_kv_buffers_in_place(tiny_model_path) -> None:
    """The caches hand their buffers to the step, so MLX writes the new keys into them instead
    of copying every buffer each step: what a step holds beyond the buffers does not grow with
    them. A step's own scratch (activations; on CUDA cuBLAS's workspace, 32 MiB on Hopper) is
    the same at any context, so short rows measure it."""
    model = load_model(str(tiny_model_path("llama")), native_forward="off").model
    scratch, _ = _step_memory(model, (300, 290))
    extra, buffers = _step_memory(model, (3000, 2900))
    # a copy a step would hold a second set of buffers at some point
    assert extra - scratch < buffers / 4


def test_an_unloaded_model_is_freed_after_compiled_steps(tiny_model_path) -> None:
    """The compiled steps' traces hold the model's weights: once its engine is gone, nothing
    keeps them (the traces go with the runner)."""
    import gc
    import weakref

    loaded = load_model(str(tiny_model_path("llama")), native_forward="off")
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    with env.overridden({env.COMPILED_DECODE: "on"}):
        _, steps = _answers(loaded, EngineConfig(parallel=4, speculative="off"), prompts, 6)
    assert steps > 0
    model = weakref.ref(loaded.model)
    del loaded
    gc.collect()
    assert model() is None


def test_the_engine_counts_and_logs_the_shapes_it_traces(tiny_model_path, caplog) -> None:
    """Each new (rows, capacity) is traced once inside a serving step: the engine's stats count
    those traces, and the debug log marks the steps that made one (where a stream's slow steps
    come from, on a GPU: docs/HARDWARE.md). Two rows decoding, then one (the shorter answer
    ends): two shapes; the same again traces nothing new."""
    import logging

    loaded = load_model(str(tiny_model_path("llama")), native_forward="off")
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS[:2]]
    config = EngineConfig(parallel=2, pipeline_decode=False, speculative="off")
    traces = []
    with env.overridden({env.COMPILED_DECODE: "on"}), \
            caplog.at_level(logging.DEBUG, logger="rewind.engine.engine"):
        with Engine(loaded, config) as engine:
            no_eos = {int(t): -100.0 for t in engine.eos_token_ids}
            for _ in range(2):
                handles = [engine.submit(GenerationRequest(prompt, SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, logit_bias=no_eos)))
                    for prompt, max_tokens in zip(prompts, (16, 4))]
                for handle in handles:
                    handle.collect(300)
                traces.append(engine.stats()["compiled_decode_traces"])
            stats = engine.stats()
    marked = [r for r in caplog.records if "traced a new compiled decode shape" in r.getMessage()]
    assert stats["compiled_decode_steps"] >= 2 * 15
    assert traces == [2, 2] and len(marked) == 2
