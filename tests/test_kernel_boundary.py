"""The kernels' Python boundary (rewind.kernels.boundary): a call whose buffers do not match what
the C code would read or write raises KernelCallError, and the kernel never runs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from rewind.kernels import boundary, native
from rewind.kernels.boundary import KernelCallError, LayerArgs, MatrixArgs, checked

pytestmark = pytest.mark.skipif(native.load_kernels() is None,
                                reason="needs x86-64 AVX2 and a C compiler")

F32 = np.dtype(np.float32)


def test_a_strided_view_past_its_buffer_is_refused() -> None:
    """The unchecked `as_strided` views of issue 23: a view whose rows run past the array it
    views is refused before any pointer is taken."""
    buffer = np.zeros((4, 64), np.float32)
    inside = as_strided(buffer[:, 16:], shape=(2, 2, 2, 16), strides=(512, 64, 256, 4))
    assert checked(inside, "q", F32, (2, 2, 2, 16), strided=True)
    outside = as_strided(buffer[:, 16:], shape=(2, 2, 4, 16), strides=(512, 64, 256, 4))
    with pytest.raises(KernelCallError, match="outside its buffer"):
        checked(outside, "q", F32, (2, 2, 4, 16), strided=True)


def test_a_strided_view_past_an_mlx_arrays_host_view_is_refused() -> None:
    """A host view of an MLX array (rewind.kernels.host_view: NumPy over the array's memory) is
    its own root, and passes as it is; a view built on it that runs past it is refused."""
    import mlx.core as mx

    from rewind.kernels.host_view import host_view

    whole = host_view(mx.zeros((1, 2, 8, 16), mx.float32) + 1)
    assert checked(whole, "k", F32, (1, 2, 8, 16), strided=True)
    assert checked(whole[:, :, :4], "k", F32, (1, 2, 4, 16), strided=True)
    outside = as_strided(whole, shape=(1, 2, 16, 16), strides=whole.strides)
    with pytest.raises(KernelCallError, match="outside its buffer"):
        checked(outside, "k", F32, (1, 2, 16, 16), strided=True)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((3, 8), np.float64), "dtype"),
    (np.zeros((3, 9), np.float32), "shape"),
    (np.zeros((8, 3), np.float32).T, "C-contiguous"),
    ([[0.0] * 8] * 3, "NumPy array"),
])
def test_wrong_dtype_shape_order_or_type_is_refused(bad: object, match: str) -> None:
    with pytest.raises(KernelCallError, match=match):
        checked(bad, "x", F32, (3, 8))


def test_an_output_the_kernel_cannot_write_is_refused() -> None:
    out = np.zeros((2, 4), np.float32)
    out.flags.writeable = False
    matrix = MatrixArgs.build(np.ones((4, 8), np.float32), native.FORM_F32)
    with pytest.raises(KernelCallError, match="read-only"):
        boundary.kernels().matvec(matrix, np.ones((2, 8), np.float32), out, 2)


def test_matvec_checks_rows_against_the_matrix() -> None:
    kernels = boundary.kernels()
    matrix = MatrixArgs.build(np.ones((4, 8), np.float32), native.FORM_F32)
    with pytest.raises(KernelCallError, match="x"):
        kernels.matvec(matrix, np.ones((2, 7), np.float32), np.zeros((2, 4), np.float32), 2)
    with pytest.raises(KernelCallError, match="out"):
        kernels.matvec(matrix, np.ones((3, 8), np.float32), np.zeros((2, 4), np.float32), 2)
    with pytest.raises(KernelCallError, match="int8 needs one scale"):
        MatrixArgs.build(np.ones((4, 8), np.int8), native.FORM_INT8)
    with pytest.raises(KernelCallError, match="dtype"):
        MatrixArgs.build(np.ones((4, 8), np.float32), native.FORM_BF16)
    out = np.zeros((3, 4), np.float32)
    kernels.matvec(matrix, np.ones((3, 8), np.float32), out, 2)
    assert (out == 8).all()


def _layer(hidden: int = 32, heads: int = 2, kv_heads: int = 1, dim: int = 16,
           intermediate: int = 48, qkv_rows: int | None = None) -> LayerArgs:
    shape = native.Shape(hidden, heads, kv_heads, dim, intermediate, dim, native.ACT_SILU, 2,
                         1e-6, 1.0, 0)
    ones = lambda *dims: np.ones(dims, np.float32)  # noqa: E731
    matrices = {"qkv": MatrixArgs.build(ones(qkv_rows or (heads + 2 * kv_heads) * dim, hidden),
                                        native.FORM_F32),
                "o": MatrixArgs.build(ones(hidden, heads * dim), native.FORM_F32),
                "gate_up": MatrixArgs.build(ones(2 * intermediate, hidden), native.FORM_F32),
                "down": MatrixArgs.build(ones(hidden, intermediate), native.FORM_F32)}
    vectors = {"input_norm": ones(hidden), "pre_ff_norm": ones(hidden)}
    return LayerArgs.build(shape, vectors, matrices, ones(dim // 2))


def test_a_layer_whose_weights_do_not_fit_its_shape_is_refused() -> None:
    with pytest.raises(KernelCallError, match="qkv"):
        _layer(qkv_rows=63)


def test_layer_calls_check_every_row_buffer() -> None:
    kernels, layer = boundary.kernels(), _layer()
    rows = 3
    x = np.ones((rows, 32), np.float32)
    positions = np.arange(rows, dtype=np.int64)
    qkv = np.zeros((rows, layer.width), np.float32)
    kernels.layer_pre(layer, x, positions, qkv, np.zeros((rows, 32), np.float32))
    assert np.isfinite(qkv).all() and qkv.any()
    with pytest.raises(KernelCallError, match="qkv_out"):  # a buffer as wide as another layer's
        kernels.layer_pre(layer, x, positions, np.zeros((rows, layer.width + 8), np.float32),
                          np.zeros((rows, 32), np.float32))
    with pytest.raises(KernelCallError, match="positions"):
        kernels.layer_pre(layer, x, positions[:2], qkv, np.zeros((rows, 32), np.float32))
    with pytest.raises(KernelCallError, match="scratch"):  # layer_post needs hidden + 3 I a row
        kernels.layer_post(layer, x, np.zeros((rows, 32), np.float32),
                           np.zeros((rows, 32 + 3 * 48 - 1), np.float32))


def test_attention_checks_its_views_and_mask() -> None:
    kernels = boundary.kernels()
    rng = np.random.default_rng(0)
    dim = 2 * native.vector_width()
    q = rng.standard_normal((1, 2, 3, dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, 5, dim)).astype(np.float32)
    out = np.zeros_like(q)
    assert kernels.attention(q, k, k, native.FORM_F32, None, native.MASK_CAUSAL, out, 0.1, 2)
    assert out.any()
    with pytest.raises(KernelCallError, match="mask"):  # a mask for 4 keys against 5
        kernels.attention(q, k, k, native.FORM_F32, np.ones((1, 2, 3, 4), bool),
                          native.MASK_BOOL, out, 0.1, 2)
    with pytest.raises(KernelCallError, match="v"):
        kernels.attention(q, k, k[:, :, :4], native.FORM_F32, None, native.MASK_NONE, out,
                          0.1, 2)
    with pytest.raises(KernelCallError, match="k"):  # bf16 keys are uint16 words
        kernels.attention(q, k, k, native.FORM_BF16, None, native.MASK_NONE, out, 0.1, 2)
    broadcast = np.broadcast_to(np.ones((1, 1, 1, 5), bool), (1, 2, 3, 5))  # strides 0 are fine
    assert kernels.attention(q, k, k, native.FORM_F32, broadcast, native.MASK_BOOL, out, 0.1, 2)
    # The key layout: one int64 per batch row, the rotation an index into the 5 keys.
    layout = (np.array([700], np.int64), np.array([3], np.int64))
    assert kernels.attention(q, k, k, native.FORM_F32, None, native.MASK_NONE, out, 0.1, 2, layout)
    for bad, match in (((np.array([0], np.int64), np.array([5], np.int64)), "rotation"),
                       ((np.array([0], np.int64), np.array([-1], np.int64)), "rotation"),
                       ((np.array([0, 0], np.int64), np.array([0, 0], np.int64)), "positions"),
                       ((np.array([0], np.int32), np.array([0], np.int64)), "positions")):
        with pytest.raises(KernelCallError, match=match):
            kernels.attention(q, k, k, native.FORM_F32, None, native.MASK_NONE, out, 0.1, 2, bad)
    # A tail: the last keys come from their own arrays, the rest from buffers of any length
    # that must hold every slot the layout reads.
    tail = rng.standard_normal((1, 1, 1, dim)).astype(np.float32)
    assert kernels.attention(q, k, k, native.FORM_F32, None, native.MASK_NONE, out, 0.1, 2,
                             None, (tail, tail), 6)
    rotated = (np.array([0], np.int64), np.array([2], np.int64))
    tail2 = np.concatenate([tail, tail], axis=2)
    for layout, pair, keys, match in ((None, None, 6, "without a tail"),
                                      (None, (tail, tail[:, :, :0]), 6, "tail values"),
                                      (None, (tail, tail), 7, "slot 5"),
                                      (rotated, (tail, tail), 6, "slot 5"),
                                      (None, (tail2, tail2), 1, "tail of 2 keys of 1")):
        with pytest.raises(KernelCallError, match=match):
            kernels.attention(q, k, k, native.FORM_F32, None, native.MASK_NONE, out, 0.1, 2,
                              layout, pair, keys)


def _random_layer(rng: np.random.Generator, dim: int, hidden: int = 32,
                  intermediate: int = 48) -> LayerArgs:
    heads, kv_heads = 2, 1
    shape = native.Shape(hidden, heads, kv_heads, dim, intermediate, dim, native.ACT_SILU, 2,
                         1e-6, 1.0, 0)
    r = lambda *dims: (0.3 * rng.standard_normal(dims)).astype(np.float32)  # noqa: E731
    matrices = {"qkv": MatrixArgs.build(r((heads + 2 * kv_heads) * dim, hidden), native.FORM_F32),
                "o": MatrixArgs.build(r(hidden, heads * dim), native.FORM_F32),
                "gate_up": MatrixArgs.build(r(2 * intermediate, hidden), native.FORM_F32),
                "down": MatrixArgs.build(r(hidden, intermediate), native.FORM_F32)}
    vectors = {"input_norm": 1 + r(hidden), "pre_ff_norm": 1 + r(hidden)}
    inv_freq = (1.0 / 10000 ** (np.arange(dim // 2) / (dim // 2))).astype(np.float32)
    return LayerArgs.build(shape, vectors, matrices, inv_freq)


def test_step_layers_gives_the_per_layer_bits_and_checks_each_cache() -> None:
    """step.c's step_layers on one-token blocks: two layers, two rows (one over a cache in
    order, one over a full ring buffer read from its oldest slot), against layer_pre /
    attention with a tail / layer_post called a layer at a time; then calls it must refuse."""
    kernels, rng = boundary.kernels(), np.random.default_rng(3)
    dim = 2 * native.vector_width()
    layers = [_random_layer(rng, dim) for _ in range(2)]
    step = boundary.StepArgs.build(layers, [0.25, 0.5])
    rows, width = 2, layers[0].width
    kv = lambda slots: rng.standard_normal((1, 1, slots, dim)).astype(np.float32)  # noqa: E731
    # Row 0: 4 keys in a buffer of 8 slots, in order from position 0; row 1: a ring of 6 slots
    # whose oldest key (position 97) sits in slot 3, the new key overwriting it.
    layouts = [(5, 0, 0, 8), (6, 97, 3, 6)]
    caches = [boundary.StepCache(kv(slots), kv(slots), keys, first, rotation)
              for _ in layers for keys, first, rotation, slots in layouts]
    x = rng.standard_normal((rows, 32)).astype(np.float32)
    positions = np.array([4, 102], np.int64)

    expected, qkv_expected = x.copy(), np.zeros((2, rows, width), np.float32)
    scratch = np.zeros((rows, 32 + 3 * 48), np.float32)
    attended = np.zeros((rows, 2 * dim), np.float32)
    for index, layer in enumerate(layers):
        projected = qkv_expected[index]
        kernels.layer_pre(layer, expected, positions, projected, scratch[:, :32].copy())
        for row, (keys, first, rotation, _) in enumerate(layouts):
            cache = caches[index * rows + row]
            heads = projected[row:row + 1].reshape(1, 1, 4, dim).transpose(0, 2, 1, 3)
            out = attended[row:row + 1].reshape(1, 1, 2, dim).transpose(0, 2, 1, 3)
            assert kernels.attention(
                heads[:, :2], cache.keys_buffer, cache.values_buffer, native.FORM_F32, None,
                native.MASK_NONE, out, step.scales[index], 2,
                (np.array([first], np.int64), np.array([rotation], np.int64)),
                (heads[:, 2:3], heads[:, 3:4]), keys)
        kernels.layer_post(layer, expected, attended, scratch)

    got, qkv = x.copy(), np.zeros((2, rows, width), np.float32)
    kernels.step_layers(step, 0, 2, [1, 1], caches, got, positions, qkv, scratch, attended)
    assert np.array_equal(got, expected) and np.array_equal(qkv, qkv_expected)
    assert not np.array_equal(got, x)

    short = [boundary.StepCache(c.keys_buffer[:, :, :4], c.values_buffer[:, :, :4], c.keys,
                                c.first, c.rotation) for c in caches]
    bad_dtype = [boundary.StepCache(c.keys_buffer.astype(np.float64), c.values_buffer, c.keys,
                                    c.first, c.rotation) for c in caches]
    bad_rotation = [boundary.StepCache(c.keys_buffer, c.values_buffer, c.keys, c.first, c.keys)
                    for c in caches]
    for bad, match in ((short, "slot"), (bad_dtype, "dtype"), (bad_rotation, "rotation"),
                       (caches[:3], "3 caches")):
        with pytest.raises(KernelCallError, match=match):
            kernels.step_layers(step, 0, 2, [1, 1], bad, got, positions, qkv, scratch,
                                attended)
    with pytest.raises(KernelCallError, match="qkv"):
        kernels.step_layers(step, 0, 2, [1, 1], caches, got, positions, qkv[:1], scratch,
                            attended)
    with pytest.raises(KernelCallError, match="different widths"):
        boundary.StepArgs.build([layers[0], _random_layer(rng, dim, intermediate=64)], [1.0, 1.0])


def test_step_layers_reads_a_ring_and_a_window_mask_as_the_updated_cache() -> None:
    """A block of 3 rows over a full ring of 6 slots whose oldest key sits in slot 4 (a
    sliding window of 6 after wrapping): the block reads the newest 5 old keys from the ring,
    then its own 3, under a window mask. The reference is what the per-layer path runs after
    mlx-lm's update: the 5 kept keys and the 3 new ones concatenated in order."""
    kernels, rng = boundary.kernels(), np.random.default_rng(4)
    dim = 2 * native.vector_width()
    layer = _random_layer(rng, dim)
    step = boundary.StepArgs.build([layer], [0.3])
    rows, window, width = 3, 6, layer.width
    ring_k, ring_v = (rng.standard_normal((1, 1, window, dim)).astype(np.float32)
                      for _ in range(2))
    offset, oldest_slot = 40, 4  # positions 34..39 in slots 4, 5, 0, 1, 2, 3
    kept, first = window - 1, offset - (window - 1)
    total = kept + rows
    positions = np.arange(offset, offset + rows, dtype=np.int64)
    key_positions = np.arange(first, first + total)
    mask = ((key_positions[None, :] <= positions[:, None])
            & (key_positions[None, :] > positions[:, None] - window))
    mask4 = np.broadcast_to(mask, (1, 2, rows, total))
    x = rng.standard_normal((rows, 32)).astype(np.float32)

    got, qkv = x.copy(), np.zeros((1, rows, width), np.float32)
    scratch = np.zeros((rows, 32 + 3 * 48), np.float32)
    attended = np.zeros((rows, 2 * dim), np.float32)
    cache = boundary.StepCache(ring_k, ring_v, total, first, (oldest_slot + 1) % window, window,
                               native.MASK_BOOL, mask4)
    kernels.step_layers(step, 0, 1, [rows], [cache], got, positions, qkv, scratch, attended)

    expected, projected = x.copy(), np.zeros((rows, width), np.float32)
    kernels.layer_pre(layer, expected, positions, projected, np.zeros((rows, 32), np.float32))
    by_head = projected.reshape(1, rows, 4, dim).transpose(0, 2, 1, 3)
    order = [(oldest_slot + 1 + t) % window for t in range(kept)]
    keys = np.concatenate([ring_k[:, :, order], by_head[:, 2:3]], axis=2)
    values = np.concatenate([ring_v[:, :, order], by_head[:, 3:4]], axis=2)
    out = np.zeros((rows, 2 * dim), np.float32)
    assert kernels.attention(by_head[:, :2], keys, values, native.FORM_F32, mask4,
                             native.MASK_BOOL, out.reshape(1, rows, 2, dim).transpose(0, 2, 1, 3),
                             0.3, 2, (np.array([first], np.int64), np.array([0], np.int64)))
    kernels.layer_post(layer, expected, out, scratch)
    assert np.array_equal(got, expected)

    for bad, match in ((dict(ring=window - 1), "ring"), (dict(rotation=window), "rotation"),
                       (dict(mask=mask4[:, :, :, :-1]), "mask"),
                       (dict(mask_kind=native.MASK_CAUSAL), "mask kind")):
        fields = dict(keys_buffer=ring_k, values_buffer=ring_v, keys=total, first=first,
                      rotation=(oldest_slot + 1) % window, ring=window,
                      mask_kind=native.MASK_BOOL, mask=mask4) | bad
        with pytest.raises(KernelCallError, match=match):
            kernels.step_layers(step, 0, 1, [rows], [boundary.StepCache(**fields)], got,
                                positions, qkv, scratch, attended)


def test_gated_delta_checks_heads_and_state() -> None:
    kernels = boundary.kernels()
    b, t, hk, hv, dk, dv = 1, 2, 2, 4, 8, 8
    z = lambda *dims: np.zeros(dims, np.float32)  # noqa: E731
    kernels.gated_delta(z(b, t, hk, dk), z(b, t, hk, dk), z(b, t, hv, dv), z(b, t, hv),
                        z(b, t, hv), None, z(b, hv, dv, dk), z(b, t, hv, dv), 2)
    with pytest.raises(KernelCallError, match="state"):
        kernels.gated_delta(z(b, t, hk, dk), z(b, t, hk, dk), z(b, t, hv, dv), z(b, t, hv),
                            z(b, t, hv), None, z(b, hv, dv, dk - 1), z(b, t, hv, dv), 2)
    with pytest.raises(KernelCallError, match="group"):
        kernels.gated_delta(z(b, t, 3, dk), z(b, t, 3, dk), z(b, t, hv, dv), z(b, t, hv),
                            z(b, t, hv), None, z(b, hv, dv, dk), z(b, t, hv, dv), 2)


def test_nothing_but_the_boundary_calls_the_library() -> None:
    """The one door: no other module of Rewind takes a kernel pointer or calls the library."""
    source = Path(boundary.__file__).parent.parent
    offenders = []
    for path in source.rglob("*.py"):
        if path.name in ("boundary.py", "native.py"):
            continue
        text = path.read_text()
        if re.search(r"\.ctypes\.data|ctypes\.byref|load_kernels\(\)\.\w+\(", text):
            offenders.append(str(path.relative_to(source)))
    assert not offenders, offenders
