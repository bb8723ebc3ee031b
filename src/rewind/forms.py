"""A model folder's stored form: bf16, or MLX's affine quantization at some bits and group size
(q8, q4, q4g32, ...). Plain data with no imports of Rewind's or MLX's, so rewind.env can check
REWIND_DEFAULT_FORM's spelling before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass

VALID_BITS = (4, 8, 16)


@dataclass(frozen=True)
class QuantSpec:
    """How weights are stored: bits 16 = bfloat16 (no quantization), else mlx affine quantization."""

    bits: int = 16
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in VALID_BITS:
            raise ValueError(f"--q-bits must be one of {VALID_BITS}, not {self.bits}")
        if self.bits != 16 and self.group_size not in (32, 64, 128):
            raise ValueError(f"--q-group-size must be 32, 64 or 128, not {self.group_size}")

    @property
    def form(self) -> str:
        """A short name for the stored form: bf16, q8, q4 (group 64) or q4g32 (another group)."""
        if self.bits == 16:
            return "bf16"
        return f"q{self.bits}" if self.group_size == 64 else f"q{self.bits}g{self.group_size}"

    @classmethod
    def from_form(cls, form: str) -> QuantSpec:
        if form == "bf16":
            return cls(16)
        if form.startswith("q"):
            bits, _, group = form[1:].partition("g")
            if bits.isdigit() and (not group or group.isdigit()):
                return cls(int(bits), int(group) if group else 64)
        raise ValueError(f"unknown model form {form!r} (bf16, q8, q4, q4g32, ...)")
