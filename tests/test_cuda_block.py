"""rewind.kernels.cuda_block: one row's decode step of a Llama block in four product kernels
that also do what follows them, bit for bit mlx-lm's block. Which blocks take it is decided on
every backend; the kernels run where CUDA is (skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as load_mlx_model

from rewind import env
from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.kernels import cuda_block
from rewind.models import fused_projections
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model

cuda = pytest.mark.skipif(not cuda_block.available(), reason="needs MLX's CUDA backend")

LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
               "max_position_embeddings": 131072, "rope_theta": 500000.0}
# K of 96 for q/k/v (MLX's one-row product takes one element a lane there), heads of 32
ODD_WIDTHS = {"hidden_size": 96, "head_dim": 32, "intermediate_size": 160}


def _blocks(tmp_path: Path, overrides: dict | None = None, family: str = "llama",
            dtype: str = "bfloat16", fuse: bool = True) -> list:
    folder = build_tiny_model(family, tmp_path / "model", overrides=overrides, dtype=dtype)
    model, _ = load_mlx_model(folder)
    if fuse:
        fused_projections.use_in_model(model)
    return list(model.layers)


def test_a_llama_block_with_fused_projections_is_taken(tmp_path: Path) -> None:
    blocks = _blocks(tmp_path)
    shapes = {cuda_block.block_shape(block) for block in blocks}
    assert shapes == {cuda_block.BlockShape(
        mx.bfloat16, True, cuda_block.AttentionShape(4, 2, 64, 1.0, 10000.0))}


@pytest.mark.parametrize("overrides, dtype, fuse", [
    (None, "bfloat16", False),  # gate/up as two products
    (None, "float32", True),  # the kernels are for bf16/fp16 weights
    ({"mlp_bias": True}, "bfloat16", True),
])
def test_blocks_it_does_not_compute_keep_mlx_lms_call(tmp_path: Path, overrides, dtype: str,
                                                      fuse: bool) -> None:
    blocks = _blocks(tmp_path, overrides, dtype=dtype, fuse=fuse)
    assert all(cuda_block.block_shape(block) is None for block in blocks)


@pytest.mark.parametrize("overrides", [{"attention_bias": True}, {"rope_traditional": True}])
def test_an_attention_it_does_not_compute_leaves_the_mlp_half_fused(tmp_path: Path,
                                                                    overrides) -> None:
    for block in _blocks(tmp_path, overrides):
        shape = cuda_block.block_shape(block)
        assert shape is not None and shape.attention is None and shape.norms


def test_qwen_3_5s_layers_fuse_their_mlp_half_and_gemma_3s_nothing(tmp_path: Path) -> None:
    qwen = [cuda_block.block_shape(block) for block in _blocks(tmp_path / "q", family="qwen3_5")]
    assert qwen and all(shape is not None and shape.attention is None for shape in qwen)
    gemma = _blocks(tmp_path / "g", family="gemma3")
    assert all(cuda_block.block_shape(block) is None for block in gemma)


def test_llama3_rope_is_taken_with_its_frequencies(tmp_path: Path) -> None:
    shape = cuda_block.block_shape(_blocks(tmp_path, LLAMA3_ROPE)[0])
    assert shape is not None and shape.attention is not None
    assert shape.attention.rope_base is None and shape.attention.rope_scale == 1.0


def test_off_cuda_or_switched_off_no_block_changes(tmp_path: Path) -> None:
    folder = build_tiny_model("llama", tmp_path / "model", dtype="bfloat16")
    model, _ = load_mlx_model(folder)
    fused_projections.use_in_model(model)
    classes = [type(block) for block in model.layers]
    with env.overridden({env.FUSED_DECODE: "off"}):
        assert cuda_block.use_in_model(model) == 0
    if not cuda_block.available():
        assert cuda_block.use_in_model(model) == 0
    assert [type(block) for block in model.layers] == classes
    assert cuda_block.fused_in(model) == 0 or cuda_block.available()


@pytest.mark.parametrize("size, layout", [
    (64, (64, 1, 8)), (512, (64, 1, 8)), (1000, (128, 1, 8)), (2048, (128, 2, 8)),
    (3072, (128, 3, 8)), (1536, (64, 3, 8)), (8192, (128, 8, 8)), (8200, None)])
def test_norm_layout_is_mlxs_dispatch(size: int, layout) -> None:
    """rms_norm.cu's dispatch_num_chunks for bf16 rows (16-byte loads of 8 elements)."""
    assert cuda_block.norm_layout(size, mx.bfloat16) == layout


def test_bad_calls_raise_before_any_kernel() -> None:
    x = mx.zeros((1, 1, 64), mx.bfloat16)
    offset = mx.array([3], mx.int32)
    with pytest.raises(ValueError, match="q/k/v"):
        cuda_block.qkv_rope(x, mx.zeros((100, 64), mx.bfloat16), offset, (4, 2, 64), 1.0,
                            10000.0, None)
    with pytest.raises(ValueError, match="does not fit"):
        cuda_block.qkv_rope(x, mx.zeros((512, 32), mx.bfloat16), offset, (4, 2, 64), 1.0,
                            10000.0, None)
    with pytest.raises(ValueError, match="offset"):
        cuda_block.qkv_rope(x, mx.zeros((512, 64), mx.bfloat16), mx.array([[1]], mx.int32),
                            (4, 2, 64), 1.0, 10000.0, None)
    with pytest.raises(ValueError, match="one of them"):
        cuda_block.qkv_rope(x, mx.zeros((512, 64), mx.bfloat16), offset, (4, 2, 64), 1.0,
                            10000.0, mx.ones((32,)))
    with pytest.raises(ValueError, match="one row"):
        cuda_block.product_add(mx.zeros((2, 1, 64), mx.bfloat16), mx.zeros((8, 64), mx.bfloat16),
                               mx.zeros((1, 1, 8), mx.bfloat16))
    with pytest.raises(ValueError, match="residual"):
        cuda_block.product_add(x, mx.zeros((8, 64), mx.bfloat16), mx.zeros((1, 1, 9), mx.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        cuda_block.gate_up(x, mx.zeros((8, 64), mx.float32))
    with pytest.raises(ValueError, match="even"):
        cuda_block.gate_up(x, mx.zeros((9, 64), mx.bfloat16))
    with pytest.raises(ValueError, match="norm weight"):
        cuda_block.gate_up(x, mx.zeros((8, 64), mx.bfloat16), (mx.ones((32,), mx.bfloat16), 1e-5))


def _cache(shape: cuda_block.AttentionShape, keys: int, seed: int, dtype) -> KVCache:
    cache = KVCache()
    if keys:
        size = (1, shape.kv_heads, keys, shape.head_dim)
        cache.update_and_fetch(mx.random.normal(size, key=mx.random.key(seed)).astype(dtype),
                               mx.random.normal(size, key=mx.random.key(seed + 1)).astype(dtype))
    return cache


@cuda
@pytest.mark.parametrize("overrides", [None, LLAMA3_ROPE, ODD_WIDTHS])
@pytest.mark.parametrize("fuse_norms", [True, False])
def test_a_fused_block_gives_mlx_lms_bits(tmp_path: Path, overrides, fuse_norms: bool,
                                          monkeypatch) -> None:
    """Output and the cache's new key and value, against the block's own call, at positions
    from the first to past a buffer's growth, every layer; with the norms computed inside the
    products and with MLX's."""
    monkeypatch.setattr(cuda_block, "FUSE_NORMS", fuse_norms)
    for index, block in enumerate(_blocks(tmp_path, overrides)):
        shape = cuda_block.block_shape(block)
        assert shape is not None and shape.attention is not None
        hidden = block.mlp.down_proj.weight.shape[0]
        for position in (0, 1, 255, 256, 1000):
            plain_cache = _cache(shape.attention, position, index, shape.dtype)
            fused_cache = _cache(shape.attention, position, index, shape.dtype)
            x = (mx.random.normal((1, 1, hidden), key=mx.random.key(position)) * 3).astype(
                mx.bfloat16)
            plain = block(x, None, plain_cache)
            fused = cuda_block.fused_call(block, shape, x, None, fused_cache)
            assert mx.array_equal(plain, fused).item(), (index, position)
            assert mx.array_equal(plain_cache.keys[..., :position + 1, :],
                                  fused_cache.keys[..., :position + 1, :]).item()
            assert mx.array_equal(plain_cache.values[..., :position + 1, :],
                                  fused_cache.values[..., :position + 1, :]).item()


@cuda
@pytest.mark.parametrize("family, overrides", [("qwen3_5", None), ("llama", {"attention_bias": True})])
@pytest.mark.parametrize("fuse_norms", [True, False])
def test_a_fused_mlp_half_gives_mlx_lms_bits(tmp_path: Path, family: str, overrides,
                                             fuse_norms: bool, monkeypatch) -> None:
    monkeypatch.setattr(cuda_block, "FUSE_NORMS", fuse_norms)
    for block in _blocks(tmp_path, overrides, family=family):
        shape = cuda_block.block_shape(block)
        assert shape is not None and shape.attention is None
        assert cuda_block._same_as_plain(block, shape) is None


@cuda
def test_the_loader_switches_every_block_after_one_passed_its_check(tmp_path: Path) -> None:
    folder = build_tiny_model("llama", tmp_path / "model", dtype="bfloat16")
    loaded = load_model(str(folder), dtype=mx.bfloat16)
    assert cuda_block.fused_in(loaded.model) == 4
    with env.overridden({env.FUSED_DECODE: "off"}):
        unfused = load_model(str(folder), dtype=mx.bfloat16)
    assert cuda_block.fused_in(unfused.model) == 0


def _greedy(loaded, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[int, float]]]:
    """Each prompt alone, then all three together (a batch: mlx-lm's blocks), greedy with
    log-probabilities."""
    answers = []
    with Engine(loaded, EngineConfig(parallel=3, speculative="off")) as engine:
        no_eos = {int(t): -100.0 for t in engine.eos_token_ids}

        def submit(prompt: list[int]):
            return engine.submit(GenerationRequest(prompt, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, logprobs=True, logit_bias=no_eos)))

        for prompt in prompts:
            result = submit(prompt).collect(300)
            answers.append(list(zip(result.tokens, result.logprobs)))
        for result in [stream.collect(300) for stream in [submit(p) for p in prompts]]:
            answers.append(list(zip(result.tokens, result.logprobs)))
        assert engine._scheduler.runner.compiled_decode.steps > 0
    return answers


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_engine_answers_as_without_it(tmp_path: Path, monkeypatch, family: str) -> None:
    """The path the server runs: lone rows decode through the compiled step, whose trace takes
    the fused blocks; tokens and log-probabilities are the same bits as with it off."""
    monkeypatch.setattr(cuda_block, "FUSE_MLP_HALVES", True)  # Qwen 3.5's layers: the MLP half
    folder = build_tiny_model(family, tmp_path / "model", dtype="bfloat16")
    fused_calls = []
    original = cuda_block.fused_call

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(cuda_block, "fused_call", counted)
    loaded = load_model(str(folder), dtype=mx.bfloat16)
    prompts = [loaded.tokenizer.encode(text) for text in
               ("one two three", "a somewhat longer prompt " * 12, "x " * 250)]
    fused_calls.clear()  # the loader's check called it: count the engine's calls
    fused = _greedy(loaded, prompts, 40)
    assert fused_calls  # traced into the compiled step at least once
    with env.overridden({env.FUSED_DECODE: "off"}):
        plain = _greedy(load_model(str(folder), dtype=mx.bfloat16), prompts, 40)
    assert fused == plain
