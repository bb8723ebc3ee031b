"""A GGUF's weights read in place on the CPU (`--cpu-weights gguf`, the default where a model
came from a GGUF): every architecture the converter takes, tensors of mixed storage types, the
same logits as the dequantized weights up to the int8 quantization of activations, on every
kernel build."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_convert import PROMPT, source_model, write_llamacpp_gguf

from rewind.kernels import native
from rewind.kernels.native_forward import native_forward
from rewind.models.conversion import QuantSpec, convert
from rewind.models.loader import describe_compute, load_model
from rewind.models.memory_estimate import loaded_bytes

pytestmark = [pytest.mark.cpu_only,
              pytest.mark.skipif(native.load_kernels() is None, reason="no C kernels here")]

# Every 32-value block type on some layer tensor (the tiny models' widths are not whole 256-value
# k-quant blocks: tests/test_quant_kernels.py covers those against the gguf package), F16 too.
MIXED = {"attn_q": T.Q5_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
         "ffn_gate": T.Q5_1, "ffn_up": T.F16, "ffn_down": T.Q8_0, "token_embd": T.Q8_0,
         "output": T.Q4_0}


@pytest.fixture(scope="module")
def converted(tiny_model_path, tmp_path_factory):
    """arch -> a model folder converted from a mixed-type GGUF (which stays beside it)."""
    folders = {}

    def get(arch: str, types: dict = MIXED):
        key = (arch, tuple(sorted((k, v.name) for k, v in types.items())))
        if key not in folders:
            root = tmp_path_factory.mktemp(f"gguf-{arch}")
            gguf = root / "model.gguf"
            write_llamacpp_gguf(source_model(arch, tiny_model_path, root / "source"), gguf, arch,
                                types=types)
            folders[key] = convert(gguf, root / "converted", QuantSpec(16), show_progress=False)
        return folders[key]

    return get


def last_logits(loaded) -> np.ndarray:
    return np.array(loaded.model(mx.array([PROMPT]))[0, -1].astype(mx.float32))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_in_place_gives_the_dequantized_models_logits(converted, arch):
    folder = converted(arch)
    in_place = load_model(str(folder), in_place=True)
    exact = load_model(str(folder), in_place=False)
    forward = native_forward(in_place.model)
    assert forward is not None and forward.form == "gguf"
    assert "Q5_1 x" in describe_compute(in_place.model)
    assert in_place.fingerprint == exact.fingerprint + "|gguf"
    assert loaded_bytes(in_place.model) < loaded_bytes(exact.model)
    a, b = last_logits(in_place), last_logits(exact)
    # The difference is the activations' int8 rounding (and the folder's bf16 one): a few
    # percent. A tensor in the wrong place, a missed norm shift or a wrong RoPE layout gives
    # logits unrelated to the reference (a relative difference near 1 or above).
    error = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"{arch}: relative difference {error:.4f}")
    assert error < 0.08


def test_asking_for_gguf_weights_without_a_gguf_is_an_error(tiny_model_path):
    with pytest.raises(ValueError, match="not converted from a GGUF"):
        load_model(str(tiny_model_path("llama")), in_place=True)


def test_a_tensor_the_kernels_cannot_read_falls_back_or_is_named(converted):
    folder = converted("llama", {**MIXED, "ffn_down": T.IQ4_NL})
    with pytest.raises(ValueError, match=r"blk\.\d\.ffn_down\.weight. is IQ4_NL"):
        load_model(str(folder), in_place=True)
    fallback = load_model(str(folder))  # auto: the folder's weights
    assert native_forward(fallback.model).form != "gguf"


_FORWARD = """
import json, sys
import mlx.core as mx
from rewind.kernels import native
from rewind.models.loader import load_model
loaded = load_model(sys.argv[1], in_place=True)
logits = loaded.model(mx.array([[1, 40, 41, 42, 100, 200, 300, 17, 5, 99]]))
print(json.dumps({"isa": native.chosen_isa(), "logits": logits[0, -3:].tolist()}))
"""


def test_every_kernel_build_gives_the_same_logits(converted):
    """The whole in-place forward pass in a process per build (REWIND_KERNEL_ISA)."""
    folder = str(converted("gemma3"))
    runs = {}
    for isa in native.runnable_isas():
        result = subprocess.run([sys.executable, "-c", _FORWARD, folder], capture_output=True,
                                text=True, timeout=300, env={**os.environ, "REWIND_KERNEL_ISA": isa})
        assert result.returncode == 0, result.stderr[-2000:]
        run = json.loads(result.stdout.strip().splitlines()[-1])
        runs[run["isa"]] = np.array(run["logits"], np.float32)
    assert list(runs) == list(native.runnable_isas())
    reference = runs["avx2"]
    for logits in runs.values():
        np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_the_stored_embedding_lookup_gives_mlx_lookups_bits(converted, arch):
    """The stored table's rows come in through NumPy (and Gemma's float32 scale with them): the
    same logits, bit for bit, as the MLX graph the lookup used to build, for a prompt and a
    decode step after it."""
    from mlx_lm.models.cache import make_prompt_cache

    loaded = load_model(str(converted(arch)), in_place=True)
    forward = native_forward(loaded.model)
    assert forward is not None and forward._stored_embed is not None
    stored_rows = forward._stored_embed
    runs = []
    try:
        for rows in (stored_rows, None):  # None: through MLX's lookup and multiply
            forward._stored_embed = rows
            cache = make_prompt_cache(loaded.model)
            prompt = loaded.model(mx.array([PROMPT]), cache=cache)
            step = loaded.model(mx.array([[7]]), cache=cache)
            runs.append([np.array(out[0].astype(mx.float32)) for out in (prompt, step)])
    finally:
        forward._stored_embed = stored_rows
    for numpy_lookup, mlx_lookup in zip(*runs):
        np.testing.assert_array_equal(numpy_lookup, mlx_lookup)
