"""rewind.kernels.cuda_skinny (opt-in): a decode batch's matrix products (2 to 32 rows) in one
tensor-core kernel instead of a cuBLAS call. What it takes is decided on every backend; the
kernel runs where CUDA is (skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rewind import env
from rewind.kernels import cuda_skinny
from rewind.kernels.model_split import split_model
from rewind.models.loader import load_model
from rewind.testing.engine_answers import greedy_answers
from rewind.testing.tiny_models import build_tiny_model

cuda = pytest.mark.skipif(not cuda_skinny.available(), reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("rows, tiles", [(2, 1), (8, 1), (9, 2), (16, 2), (17, 4), (32, 4),
                                         (33, 8), (64, 8)])
def test_row_counts_round_up_to_a_power_of_two_tiles(rows: int, tiles: int) -> None:
    assert cuda_skinny.tiles(rows) == tiles


@pytest.mark.parametrize("x_shape, x_dtype, w_shape, w_dtype", [
    ((1, 64), mx.bfloat16, (48, 64), mx.bfloat16),  # one row: MLX's gemv
    ((33, 64), mx.bfloat16, (48, 64), mx.bfloat16),  # past MAX_ROWS
    ((4, 64), mx.float32, (48, 64), mx.float32),
    ((4, 64), mx.float16, (48, 64), mx.bfloat16),
    ((4, 48), mx.bfloat16, (48, 48), mx.bfloat16),  # K not a multiple of 32
    ((4, 64), mx.bfloat16, (48, 96), mx.bfloat16),  # x does not fit the weight
])
def test_what_the_kernel_does_not_take_raises_before_it_runs(x_shape, x_dtype, w_shape,
                                                             w_dtype) -> None:
    with pytest.raises(ValueError):
        cuda_skinny.matmul(mx.zeros(x_shape, x_dtype), mx.zeros(w_shape, w_dtype))


def test_only_asked_for_and_on_cuda_are_products_marked(tmp_path: Path) -> None:
    folder = build_tiny_model("llama", tmp_path / "model", dtype="bfloat16")
    loaded = load_model(str(folder), dtype=mx.bfloat16)  # auto keeps cuBLAS
    for setting in ("off", "auto"):
        with env.overridden({env.SKINNY_PRODUCTS: setting}):
            assert cuda_skinny.use_in_model(loaded.model) == 0
    assert not [m for _, m in loaded.model.named_modules() if "_rewind_skinny" in m.__dict__]
    with env.overridden({env.SKINNY_PRODUCTS: "on"}):
        marked = cuda_skinny.use_in_model(loaded.model)
    assert (marked > 0) == cuda_skinny.available()


@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
                                  (128256, 2048), (6144, 1024), (1024, 3584), (48, 64)])
def test_every_rows_tiling_fits_a_blocks_shared_memory(n: int, k: int) -> None:
    for rows in range(2, cuda_skinny.MAX_ROWS + 1):
        tiling = cuda_skinny.tiling_for(rows, n, k)
        assert cuda_skinny.fits(tiling, rows), (rows, tiling)


def test_a_tiling_past_shared_memory_raises_before_it_runs() -> None:
    x = mx.zeros((32, 64), mx.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        cuda_skinny.matmul(x, mx.zeros((48, 64), mx.bfloat16), cuda_skinny.Tiling(warps=32))


# the default and each kind of change to it: wider W tiles, fewer warps, K split over blocks
# (a second kernel adding the parts), W's loads streamed past L1
TILINGS = [cuda_skinny.Tiling(), cuda_skinny.Tiling(w_tiles=2, unroll=2),
           cuda_skinny.Tiling(w_tiles=4, unroll=1, warps=4),
           cuda_skinny.Tiling(split=4), cuda_skinny.Tiling(w_tiles=2, split=3, stream_w=True)]


@cuda
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n, k", [(48, 64), (40, 96), (3072, 2048), (2048, 8192)])
def test_products_are_a_float32_products_rounded(dtype, n: int, k: int, tiling) -> None:
    """Each row within the output's rounding of the float32 product of the same inputs, at every
    tile count, a last tile of W rows cut short (n = 40), and K parts left empty (k = 64 split
    in 3 or 4)."""
    w = (mx.random.normal((n, k), key=mx.random.key(n)) * 0.05).astype(dtype)
    for rows in (2, 5, 8, 9, 17, 32):
        x = mx.random.normal((1, rows, k), key=mx.random.key(rows)).astype(dtype)
        ours = cuda_skinny.matmul(x, w, tiling)
        assert ours.shape == (1, rows, n) and ours.dtype == dtype
        exact = x.astype(mx.float32) @ w.astype(mx.float32).T
        error = mx.max(mx.abs(ours.astype(mx.float32) - exact) / (mx.abs(exact) + 1e-2)).item()
        assert error < 1e-2, (rows, error)


@cuda
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_a_row_gets_the_same_bits_whatever_rows_share_the_product(tiling) -> None:
    w = (mx.random.normal((256, 512), key=mx.random.key(0)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((32, 512), key=mx.random.key(1)).astype(mx.bfloat16)
    everything = cuda_skinny.matmul(x, w, tiling)
    for rows in ([0, 1], [5, 0, 7], list(range(17)), [31, 30, 0]):
        part = cuda_skinny.matmul(x[mx.array(rows)], w, tiling)
        assert mx.array_equal(part, everything[mx.array(rows)]).item(), rows


@cuda
def test_a_loaded_models_batch_step_is_mlxs_within_rounding(tmp_path: Path) -> None:
    """The loader marks the products and the runner's batch head; a three-row decode step's
    logits through them stay within bf16 rounding of cuBLAS's."""
    folder = build_tiny_model("llama", tmp_path / "model", dtype="bfloat16",
                              overrides={"tie_word_embeddings": True})
    with env.overridden({env.SKINNY_PRODUCTS: "on"}):
        ours = load_model(str(folder), dtype=mx.bfloat16)
    theirs = load_model(str(folder), dtype=mx.bfloat16)
    assert any("_rewind_skinny" in m.__dict__ for _, m in ours.model.named_modules())
    head = cuda_skinny.head_of(split_model(ours.model).head)
    assert head is not None
    assert cuda_skinny.head_of(split_model(theirs.model).head) is None
    tokens = mx.array([[3, 17, 40, 99, 5], [8, 8, 21, 7, 300], [42, 1, 2, 3, 4]])
    logits = []
    for loaded, batch_head in ((ours, head), (theirs, None)):
        split = split_model(loaded.model)
        cache = make_prompt_cache(loaded.model)
        split.backbone(tokens[:, :4], cache=cache)
        hidden = split.backbone(tokens[:, 4:], cache=cache)
        logits.append(split.logits(hidden[:, -1, :], batch_head).astype(mx.float32))
    scale = mx.max(mx.abs(logits[1])).item()
    assert mx.max(mx.abs(logits[0] - logits[1])).item() < 3e-2 * scale


@cuda
def test_a_rows_answer_in_a_batch_does_not_depend_on_the_other_rows(tmp_path: Path) -> None:
    """The path the server runs: rows decoding together (the compiled step, the batch head) get
    their tokens and log-probabilities from products whose rows compute alone, so a row's answer
    is the same bits beside any other rows."""
    folder = build_tiny_model("llama", tmp_path / "model", dtype="bfloat16")
    with env.overridden({env.SKINNY_PRODUCTS: "on"}):
        loaded = load_model(str(folder), dtype=mx.bfloat16)
    prompts = [[5, 9, 200, 31] * 5, [7, 7, 8] * 9, [100, 101] * 4, [300, 2, 60] * 6]

    first = greedy_answers(loaded, prompts[:3], speculative="off")
    second = greedy_answers(loaded, [prompts[0], prompts[3]], speculative="off")
    assert first[0] == second[0]
