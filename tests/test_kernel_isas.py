"""Every build of the C kernels this CPU runs (simd.h's AVX2 and AVX-512 paths, and AVX-512 with
VNNI for the GGUF block products) gives the AVX2 build's outputs within float tolerance (they
differ only in summation order), kernel by kernel and for a whole model's forward pass. Runs
where the CPU has AVX-512; on an AVX2-only CPU the main suite is the AVX2 build, and
scripts/test.sh runs the kernel tests again as AVX2 on an AVX-512 CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rewind.kernels import boundary, native
from rewind.kernels.boundary import Kernels, LayerArgs, MatrixArgs

pytestmark = pytest.mark.skipif(
    "avx512" not in native.runnable_isas() or native.load_isa("avx2") is None,
    reason="this CPU has no AVX-512 (or no C compiler): only the AVX2 build runs here")

RTOL, ATOL = 2e-5, 2e-5


WIDE_ISAS = [isa for isa in native.runnable_isas() if isa != "avx2"]


@pytest.fixture(scope="module")
def builds() -> tuple[Kernels, ...]:
    """The AVX2 build first, then every wider one this CPU runs."""
    loaded = [boundary.kernels_for(isa) for isa in ("avx2", *WIDE_ISAS)]
    assert all(kernels is not None for kernels in loaded)
    assert [k.vector_width for k in loaded] == [8] + [16] * len(WIDE_ISAS)
    return tuple(loaded)


def _same(results: list[np.ndarray]) -> None:
    """Each wider build's result against the AVX2 build's (the first)."""
    reference = results[0]
    scale = max(1.0, float(np.abs(reference).max()))
    for other in results[1:]:
        np.testing.assert_allclose(other, reference, rtol=RTOL, atol=ATOL * scale)


@pytest.mark.parametrize("form", [native.FORM_F32, native.FORM_BF16, native.FORM_INT8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
def test_matvec(builds, form: int, rows: int) -> None:
    rng = np.random.default_rng(rows + 10 * form)
    out_dim, in_dim = 67, 150  # neither a multiple of the 4-row block nor of a vector
    weight = rng.standard_normal((out_dim, in_dim)).astype(np.float32)
    scale = None
    if form == native.FORM_BF16:
        weight = (weight.view(np.uint32) >> 16).astype(np.uint16)
    elif form == native.FORM_INT8:
        scale = rng.uniform(0.01, 0.02, out_dim).astype(np.float32)
        weight = rng.integers(-127, 128, (out_dim, in_dim)).astype(np.int8)
    matrix = MatrixArgs.build(weight, form, scale)
    x = rng.standard_normal((rows, in_dim)).astype(np.float32)
    results = []
    for kernels in builds:
        out = np.empty((rows, out_dim), np.float32)
        kernels.matvec(matrix, x, out, 2)
        results.append(out)
    _same(results)


@pytest.mark.parametrize("mask_kind", [native.MASK_NONE, native.MASK_CAUSAL, native.MASK_BOOL,
                                       native.MASK_ADD])
@pytest.mark.parametrize("length, total", [(1, 700), (5, 70), (40, 300)])
@pytest.mark.parametrize("kv_form", [native.FORM_F32, native.FORM_BF16])
def test_attention(builds, mask_kind: int, length: int, total: int, kv_form: int) -> None:
    """Decode against a long context (split key ranges), a short chunk and a longer one, with
    grouped query heads, for every mask kind and both KV forms."""
    rng = np.random.default_rng(length + total)
    batch, heads, kv_heads, dim = 2, 4, 2, 64
    q = rng.standard_normal((batch, heads, length, dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, total, dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, total, dim)).astype(np.float32)
    if kv_form == native.FORM_BF16:
        k, v = ((a.view(np.uint32) >> 16).astype(np.uint16) for a in (k, v))
    mask = None
    if mask_kind == native.MASK_BOOL:
        mask = np.broadcast_to(rng.random((batch, 1, length, total)) > 0.3,
                               (batch, heads, length, total))
    elif mask_kind == native.MASK_ADD:
        mask = np.broadcast_to(rng.standard_normal((1, 1, length, total)).astype(np.float32),
                               (batch, heads, length, total))
    results = []
    for kernels in builds:
        out = np.zeros((batch, heads, length, dim), np.float32)
        assert kernels.attention(q, k, v, kv_form, mask, mask_kind, out, 0.125, 2)
        results.append(out)
    _same(results)


def _layer(rng: np.random.Generator, form: int) -> LayerArgs:
    hidden, heads, kv_heads, dim, intermediate = 64, 4, 2, 32, 96
    shape = native.Shape(hidden, heads, kv_heads, dim, intermediate, dim, native.ACT_GELU_TANH,
                         2, 1e-6, 1.0, 0)

    def matrix(rows: int, cols: int) -> MatrixArgs:
        weight = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if form == native.FORM_BF16:
            return MatrixArgs.build((weight.view(np.uint32) >> 16).astype(np.uint16), form)
        return MatrixArgs.build(weight, form)

    vector = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    matrices = {"qkv": matrix((heads + 2 * kv_heads) * dim, hidden),
                "o": matrix(hidden, heads * dim), "gate_up": matrix(2 * intermediate, hidden),
                "down": matrix(hidden, intermediate)}
    vectors = {"input_norm": vector(hidden), "q_norm": vector(dim), "k_norm": vector(dim),
               "post_attn_norm": vector(hidden), "pre_ff_norm": vector(hidden),
               "post_ff_norm": vector(hidden)}
    inv_freq = (10000.0 ** (-np.arange(0, dim, 2) / dim)).astype(np.float32)
    return LayerArgs.build(shape, vectors, matrices, inv_freq)


@pytest.mark.parametrize("form", [native.FORM_F32, native.FORM_BF16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_layer_pre_and_post(builds, form: int, rows: int) -> None:
    rng = np.random.default_rng(rows)
    layer = _layer(rng, form)
    s = layer.shape
    x0 = rng.standard_normal((rows, s.hidden)).astype(np.float32)
    positions = np.arange(100, 100 + rows, dtype=np.int64)
    attended = rng.standard_normal((rows, s.heads * s.head_dim)).astype(np.float32)
    projections, outputs = [], []
    for kernels in builds:
        qkv = np.empty((rows, layer.width), np.float32)
        kernels.layer_pre(layer, x0, positions, qkv, np.empty((rows, s.hidden), np.float32))
        x = x0.copy()
        kernels.layer_post(layer, x, attended,
                           np.empty((rows, s.hidden + 3 * s.intermediate), np.float32))
        projections.append(qkv)
        outputs.append(x)
    _same(projections)
    _same(outputs)


@pytest.mark.parametrize("per_key", [False, True])
def test_gated_delta(builds, per_key: bool) -> None:
    rng = np.random.default_rng(int(per_key))
    b, t, hk, hv, dk, dv = 2, 9, 2, 4, 40, 24
    r = lambda *dims: rng.standard_normal(dims).astype(np.float32)  # noqa: E731
    q, k, v = r(b, t, hk, dk), r(b, t, hk, dk), r(b, t, hv, dv)
    g = rng.uniform(0.8, 1.0, (b, t, hv, dk) if per_key else (b, t, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, t, hv)).astype(np.float32)
    mask = np.ones((b, t), np.uint8)
    mask[1, :3] = 0
    ys, states = [], []
    for kernels in builds:
        state, y = r(b, hv, dv, dk) * 0 + 0.5, np.empty((b, t, hv, dv), np.float32)
        kernels.gated_delta(q, k, v, g, beta, mask, state, y, 2)
        ys.append(y)
        states.append(state)
    _same(ys)
    _same(states)


_FORWARD = """
import json, sys
import mlx.core as mx
from rewind.kernels import native
from rewind.kernels.native_forward import native_forward
from rewind.models.loader import load_model
loaded = load_model(sys.argv[1])
assert native_forward(loaded.model) is not None, "the native forward is not installed"
logits = loaded.model(mx.array([list(range(3, 90))]))
print(json.dumps({"isa": native.chosen_isa(),
                  "logits": logits[0, -4:].astype(mx.float32).tolist()}))
"""


@pytest.mark.cpu_only  # the native forward runs on the CPU backend alone
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_model_forward_gives_the_same_logits_on_both_builds(tiny_model_path,
                                                              family: str) -> None:
    """The whole native forward pass, each build in a process of its own (REWIND_NO_AVX512=1
    picks AVX2), as a server on each CPU would run it."""
    path = str(tiny_model_path(family))
    runs = {}
    for isa in ("avx2", *WIDE_ISAS):
        result = subprocess.run([sys.executable, "-c", _FORWARD, path], capture_output=True,
                                text=True, timeout=300,
                                env={**os.environ, "REWIND_KERNEL_ISA": isa})
        assert result.returncode == 0, result.stderr[-2000:]
        run = json.loads(result.stdout.strip().splitlines()[-1])
        runs[run["isa"]] = np.array(run["logits"], np.float32)
    assert list(runs) == ["avx2", *WIDE_ISAS]
    _same(list(runs.values()))
