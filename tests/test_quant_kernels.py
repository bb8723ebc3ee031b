"""The GGUF block kernels (rewind/kernels/c/quant.c) against the `gguf` package's dequantizer:
every type they read, every kernel build this CPU runs, through the checked boundary."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from rewind.kernels import boundary, native
from rewind.kernels.boundary import KernelCallError, MatrixArgs

ISAS = [isa for isa in native.ISAS if native.load_isa(isa) is not None]
pytestmark = pytest.mark.skipif(not ISAS, reason="the C kernels do not build on this machine")

# Byte offsets of each block's fp16 scales: random bytes elsewhere are valid quants, but a random
# fp16 may be NaN or huge.
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TYPES = list(native.GGML_TYPES)


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random blocks of ggml type `name`, with small positive scales."""
    values, nbytes = native.GGML_BLOCKS[native.GGML_TYPES[name]]
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[name]:
        scales = rng.uniform(0.001, 0.02, size=(rows, cols // values)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def random_matrix(name: str, rows: int, cols: int, rng: np.random.Generator
                  ) -> tuple[MatrixArgs, int]:
    """A matrix of `rows` random blocks of type `name`, `cols` wide (256, one super-block, for
    the k-quants), and its width."""
    if native.GGML_BLOCKS[native.GGML_TYPES[name]][0] == 256:
        cols = 256
    return MatrixArgs.build(random_blocks(name, rows, cols, rng),
                            native.FORM_GGML + native.GGML_TYPES[name], cols=cols), cols


def dequantized(name: str, blocks: np.ndarray) -> np.ndarray:
    return np.asarray(quants.dequantize(blocks, GGMLQuantizationType[name]), np.float64)


def activations_as_quantized(x: np.ndarray, k_quant: bool) -> np.ndarray:
    """The values the kernels multiply with: x quantized per block as ggml does (Q8_K for the
    k-quants, Q8_0 otherwise, with a float scale), in float32 arithmetic like the C code."""
    size = 256 if k_quant else 32
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, size)
    if k_quant:
        index = np.abs(blocks).argmax(axis=2)
        signed_max = np.take_along_axis(blocks, index[..., None], axis=2)
        with np.errstate(divide="ignore"):
            iscale = np.where(signed_max != 0, np.float32(-127.0) / signed_max, 0).astype(np.float32)
        q = np.minimum(np.rint(iscale * blocks), 127)
        d = np.where(iscale != 0, np.float32(1.0) / np.where(iscale != 0, iscale, 1), 0)
    else:
        d = (np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127.0)).astype(np.float32)
        inverse = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
        q = np.rint(blocks * inverse)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def product(isa: str, matrix: MatrixArgs, x: np.ndarray, threads: int = 2) -> np.ndarray:
    out = np.zeros((x.shape[0], matrix.rows), np.float32)
    boundary.kernels_for(isa).matvec(matrix, x, out, threads)
    return out


@pytest.mark.parametrize("name", TYPES)
def test_each_type_matches_the_gguf_dequantizer(name: str) -> None:
    """y = W x with W read from its blocks equals the dequantized W times the quantized x, for
    one row (a decode step) and for several (a prefill chunk), on every build."""
    rng = np.random.default_rng(7)
    k_quant = native.GGML_BLOCKS[native.GGML_TYPES[name]][0] == 256
    rows, cols = 67, 512 if k_quant else 96  # rows: not a multiple of any claim
    blocks = random_blocks(name, rows, cols, rng)
    matrix = MatrixArgs.build(blocks, native.FORM_GGML + native.GGML_TYPES[name], cols=cols)
    weight = dequantized(name, blocks)
    for m in (1, 5):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        expected = activations_as_quantized(x, k_quant) @ weight.T
        bound = np.abs(activations_as_quantized(x, k_quant)) @ np.abs(weight).T
        for isa in ISAS:
            got = product(isa, matrix, x)
            assert np.all(np.abs(got - expected) <= 2e-6 * bound + 1e-7), (name, isa, m)
        # And the quantized activations stay close to the float product (a sanity bound).
        assert np.abs(got - x.astype(np.float64) @ weight.T).max() < 0.02 * bound.max()


@pytest.mark.parametrize("name", TYPES)
def test_builds_agree(name: str) -> None:
    """The int8 products are exact integers in every build and path: the two AVX-512 builds
    agree to the bit (one unpacks the stored blocks for any number of rows; with VNNI, more
    than four rows go through strips, and AMX where the CPU has it), and with AVX2 up to the
    float order of the scaled sums."""
    rng = np.random.default_rng(11)
    cols = 256 if native.GGML_BLOCKS[native.GGML_TYPES[name]][0] == 256 else 96  # odd blocks
    blocks = random_blocks(name, 40, cols, rng)
    matrix = MatrixArgs.build(blocks, native.FORM_GGML + native.GGML_TYPES[name], cols=cols)
    for m in (3, 21):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        results = {isa: product(isa, matrix, x) for isa in ISAS}
        if "avx512" in results and "avx512vnni" in results:
            np.testing.assert_array_equal(results["avx512"], results["avx512vnni"])
        for result in results.values():
            np.testing.assert_allclose(result, results["avx2"], rtol=1e-5,
                                       atol=1e-5 * np.abs(results["avx2"]).max())


def test_stacked_parts_of_different_forms_with_a_bias() -> None:
    """q/k in Q5_0 over v in Q8_0 over bf16 rows, as one matrix with a bias."""
    rng = np.random.default_rng(3)
    cols = 64
    q5 = random_blocks("Q5_0", 10, cols, rng)
    q8 = random_blocks("Q8_0", 6, cols, rng)
    floats = rng.standard_normal((4, cols)).astype(np.float32)
    bf16 = (floats.view(np.uint32) >> 16).astype(np.uint16)
    bias = rng.standard_normal(20).astype(np.float32)
    matrix = MatrixArgs.stack([(q5, native.FORM_GGML + 6, None), (q8, native.FORM_GGML + 8, None),
                               (bf16, native.FORM_BF16, None)], cols, bias)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    xq = activations_as_quantized(x, False)
    widened = (bf16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    expected = np.concatenate([xq @ dequantized("Q5_0", q5).T, xq @ dequantized("Q8_0", q8).T,
                               x.astype(np.float64) @ widened.T], axis=1) + bias
    for isa in ISAS:
        np.testing.assert_allclose(product(isa, matrix, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", TYPES)
def test_dequantized_rows_match_the_gguf_package(name: str) -> None:
    rng = np.random.default_rng(5)
    cols = 256 if native.GGML_BLOCKS[native.GGML_TYPES[name]][0] == 256 else 64
    blocks = random_blocks(name, 9, cols, rng)
    ids = np.array([8, 0, 3, 3], np.int64)
    out = np.empty((4, cols), np.float32)
    boundary.kernels().dequantize_rows(blocks, native.FORM_GGML + native.GGML_TYPES[name], cols,
                                       ids, out)
    np.testing.assert_allclose(out, dequantized(name, blocks)[ids], rtol=1e-6, atol=1e-9)


def test_bad_calls_raise_before_reading() -> None:
    kernels = boundary.kernels()
    blocks = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    with pytest.raises(KernelCallError, match="whole blocks"):
        MatrixArgs.build(blocks, native.FORM_GGML + 12, cols=200)
    with pytest.raises(KernelCallError, match="shape"):  # bytes of 256 values, said to be 512
        MatrixArgs.build(blocks, native.FORM_GGML + 12, cols=512)
    with pytest.raises(KernelCallError, match="not one the kernels read"):
        MatrixArgs.build(blocks, native.FORM_GGML + 10, cols=256)  # Q2_K
    with pytest.raises(KernelCallError, match="columns given"):
        MatrixArgs.build(blocks, native.FORM_GGML + 12)
    matrix = MatrixArgs.build(blocks, native.FORM_GGML + 12, cols=256)
    with pytest.raises(KernelCallError):
        kernels.matvec(matrix, np.ones((1, 255), np.float32), np.zeros((1, 4), np.float32), 2)
    out = np.empty((1, 256), np.float32)
    with pytest.raises(KernelCallError, match="outside"):
        kernels.dequantize_rows(blocks, native.FORM_GGML + 12, 256, np.array([4]), out)
    with pytest.raises(KernelCallError, match="dtype"):
        kernels.dequantize_rows(blocks, native.FORM_GGML + 12, 256, np.array([1], np.int32), out)


@pytest.mark.parametrize("name", TYPES)
def test_a_row_gets_the_same_bits_alone_and_among_others(name: str) -> None:
    """The engine batches a prompt's rows with other requests' rows and relies on each row's
    result not depending on its neighbours (cached against uncached, batched against alone).
    One row reads the stored blocks; 3 a tile of them; 7 and 37 (more than two AMX tiles of
    16, the last one part-filled) read strips on the VNNI build, through AMX where the CPU
    has it and the rule takes it, through broadcast vpdpbusd otherwise, and the stored blocks
    in passes of 4 when strips are held back. On the AVX2 build 5, 7 and 32 rows meet each
    weight tile in turn (quant.c's FEW_ROWS_MAX), 33 and 37 read claims of 32 rows a pass of 4
    activation rows at a time."""
    rng = np.random.default_rng(13)
    matrix, cols = random_matrix(name, 37, 96, rng)
    x = rng.standard_normal((37, cols)).astype(np.float32)
    for isa in ISAS:
        alone = np.concatenate([product(isa, matrix, x[row:row + 1]) for row in range(37)])
        lib = native.load_isa(isa)
        # The VNNI build's paths for rows together: the measured rule (AMX for k-quants from 16
        # rows, VNNI strips otherwise), AMX for every type, VNNI strips only, stored blocks only.
        settings = [("measured", native.STRIPS_ABOVE_DEFAULT)]
        if isa == "avx512vnni":
            settings += [("measured", 4), ("all", 4), ("none", 4), ("measured", 1 << 20)]
        for rule, strips_above in settings:
            native.set_amx_rule(lib, rule)
            native.set_strips_above(lib, strips_above)
            try:
                for m in (3, 5, 7, 32, 33, 37):
                    np.testing.assert_array_equal(product(isa, matrix, x[:m]), alone[:m],
                                                  err_msg=f"{isa} {m} rows, AMX {rule}, "
                                                          f"strips above {strips_above}")
            finally:
                native.set_amx_rule(lib, "measured")
                native.set_strips_above(lib, native.STRIPS_ABOVE_DEFAULT)
        if native.amx_in_use(lib):
            native.set_amx(lib, False)
            try:
                np.testing.assert_array_equal(product(isa, matrix, x), alone, err_msg="AMX off")
            finally:
                native.set_amx(lib, True)


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_a_rows_bits_do_not_depend_on_the_thread_count(name: str) -> None:
    """A product of a few activation rows (decode, a drafted row's check; on the AVX2 build up
    to 32) splits the matrix into claims sized by the thread count (quant.c's rows_per_claim),
    one of more rows into 32-row claims: a row's bits may depend on neither. 4,099 rows:
    claims of more than 32 rows at 1 to 5 threads, and tiles left part-filled where claims
    end."""
    rng = np.random.default_rng(17)
    matrix, cols = random_matrix(name, 4099, 64, rng)
    x = rng.standard_normal((32, cols)).astype(np.float32)
    for isa in ISAS:
        together = product(isa, matrix, x)
        for threads in (1, 2, 3, 5):
            for m in (1, 2, 4, 5, 32):
                np.testing.assert_array_equal(product(isa, matrix, x[:m], threads), together[:m],
                                              err_msg=f"{isa}, {m} rows on {threads} threads")


@pytest.mark.skipif("avx512vnni" not in ISAS or not native.set_amx(native.load_isa("avx512vnni"), True),
                    reason="needs a CPU with AMX-INT8 (Sapphire Rapids or later) and Linux's permission")
def test_amx_is_on_where_the_cpu_has_it_and_off_when_asked() -> None:
    lib = native.load_isa("avx512vnni")
    assert native.amx_in_use(lib)
    assert not native.set_amx(lib, False) and not native.amx_in_use(lib)
    assert native.set_amx(lib, True)
