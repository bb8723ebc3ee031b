"""A GGUF's weights as the file stores them, for the CPU kernels to read in place.

`rewind serve --model file.gguf` (and `default`, a Q4_K_M GGUF) used to run from a bf16 copy of
the dequantized tensors: 536 MB for Gemma 3 270M, where its file holds ~240 MB of blocks that
llama.cpp computes with directly. Here each weight is a NumPy view of the memory-mapped file:
block-quantized tensors as their bytes (rewind/kernels/c/quant.c reads them), F32 and BF16 as
their values, F16 widened to float32 (the kernels read no f16). Nothing is dequantized, so the
only copy is the file's pages in the page cache, shared with any other process reading it.

Names are mlx-lm's (`model.layers.0.self_attn.q_proj`), so the kernels need not know GGUF's.
Two of llama.cpp's conventions stay as stored and are described instead of undone: Gemma's norm
weights hold 1 + w (what Gemma multiplies by), and the llama architecture's q/k rows are in
GGML's interleaved RoPE layout (`interleaved_rope`: the kernels then rotate pairs of adjacent
values, which gives the same attention).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from rewind.kernels.stored import StoredMatrix, StoredWeights
from rewind.models.gguf_file import GgufError, GgufFile
from rewind.models.gguf_import import GEMMA_ARCHITECTURES, check_architecture, hf_tensor_name

# ggml types the kernels read as blocks (rewind.kernels.native.GGML_TYPES has the same ids).
BLOCK_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                         GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
                         GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                         GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16})


class NotInPlace(GgufError):
    """A GGUF with a tensor the kernels cannot read as stored (e.g. Q3_K, IQ4_XS)."""


def _matrix(gguf: GgufFile, name: str) -> StoredMatrix:
    tensor = gguf.tensors[name]
    if len(tensor.dims) != 2:
        raise NotInPlace(f"{gguf.path}: tensor {name!r} has {len(tensor.dims)} dimensions")
    rows, cols = tensor.numpy_shape
    raw = gguf.raw(tensor)
    if tensor.qtype in BLOCK_TYPES:
        return StoredMatrix(raw, tensor.qtype.name, rows, cols)
    if tensor.qtype == GGMLQuantizationType.BF16:
        return StoredMatrix(raw.view(np.uint16).reshape(rows, cols), "BF16", rows, cols)
    if tensor.qtype == GGMLQuantizationType.F32:
        return StoredMatrix(raw, "F32", rows, cols)
    if tensor.qtype == GGMLQuantizationType.F16:
        return StoredMatrix(np.ascontiguousarray(raw, dtype=np.float32), "F32", rows, cols)
    raise NotInPlace(f"{gguf.path}: tensor {name!r} is {tensor.qtype.name}, which the CPU "
                     f"kernels do not read in place")


def _vector(gguf: GgufFile, name: str) -> np.ndarray:
    tensor = gguf.tensors[name]
    if tensor.qtype not in FLOAT_TYPES:
        raise NotInPlace(f"{gguf.path}: 1-D tensor {name!r} is {tensor.qtype.name}")
    raw = gguf.raw(tensor)
    if tensor.qtype == GGMLQuantizationType.BF16:
        raw = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(raw.reshape(-1), dtype=np.float32)


def stored_weights(path: Path | str) -> StoredWeights:
    """The GGUF at `path`, every tensor a view of its mapped bytes (the arrays keep the mapping
    alive). NotInPlace names the first tensor the kernels cannot read as stored."""
    gguf = GgufFile(path)
    arch = check_architecture(gguf)
    weights = StoredWeights(Path(path), arch, interleaved_rope=arch == "llama",
                            norms_plus_one=arch in GEMMA_ARCHITECTURES)
    for name, tensor in gguf.tensors.items():
        if name in ("rope_freqs.weight",):
            continue
        hf_name = hf_tensor_name(name, arch).removesuffix(".weight")
        if len(tensor.dims) == 1:
            weights.vectors[hf_name] = _vector(gguf, name)
        else:
            weights.matrices[hf_name] = _matrix(gguf, name)
    return weights
