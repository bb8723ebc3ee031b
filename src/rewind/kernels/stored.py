"""Weights as a file stores them, the form in which the CPU kernels read a model in place.

rewind.models.gguf_weights fills these from a GGUF; rewind.kernels.native_forward and
rewind.kernels.fast_head read them. Plain NumPy arrays (views of the mapped file), so the kernels
need not know the file format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rewind.kernels import native


@dataclass(frozen=True)
class StoredMatrix:
    """A weight [rows, cols] as stored: `data` holds float32 values, bf16 bits (uint16) or, for a
    block type, each row's blocks as bytes [rows, bytes]; `ggml_type` names the storage."""

    data: np.ndarray
    ggml_type: str  # "F32", "BF16" or a block type such as "Q4_K"
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class StoredWeights:
    """Every 2-D weight of a model by its mlx-lm name (without `.weight`), and the 1-D ones
    (norms, as the model multiplies by them) as float32."""

    source: Path
    architecture: str
    matrices: dict[str, StoredMatrix] = field(default_factory=dict)
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    interleaved_rope: bool = False  # q/k rows in GGML's layout (llama): rotate adjacent pairs
    norms_plus_one: bool = False  # the norm vectors already hold 1 + w (Gemma)

    @property
    def nbytes(self) -> int:
        return (sum(m.nbytes for m in self.matrices.values())
                + sum(v.nbytes for v in self.vectors.values()))

    def types(self) -> dict[str, int]:
        """How many matrices of each storage type: what `rewind serve` reports at load."""
        counts: dict[str, int] = {}
        for matrix in self.matrices.values():
            counts[matrix.ggml_type] = counts.get(matrix.ggml_type, 0) + 1
        return dict(sorted(counts.items()))


def kernel_form(ggml_type: str) -> int:
    """The kernels' weight form for a storage type ("F32", "BF16" or a ggml block type)."""
    if ggml_type == "F32":
        return native.FORM_F32
    if ggml_type == "BF16":
        return native.FORM_BF16
    return native.FORM_GGML + native.GGML_TYPES[ggml_type]
