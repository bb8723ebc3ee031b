"""A vectorizable tanh-GELU for MLX's CPU backend, swapped into Gemma 3's MLP at load time.

Why: MLX's CPU transcendental ops are scalar (exp 23 ns, tanh 29 ns per element here), so
`nn.gelu_approx` on a [512, 2048] prefill chunk costs ~45 ms of CPU per layer, ~20% of Gemma 3
270M's prefill (benchmarks/results/speed-profile.md). tanh is computed instead with the rational
approximation Eigen uses for float32 (degree 13/6 on [-7.905, 7.905], max error ~4e-7 against
`mx.tanh`), built only from multiplies, adds and one divide, which MLX runs vectorized; compiled,
the whole GELU-and-gate costs ~10 ms. The difference from `nn.gelu_approx` is at float32 rounding
level (tests/test_forward.py bounds it).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import mlx.core as mx

_CLAMP = 7.90531110763549805  # tanh(x) rounds to +-1 in float32 beyond this
_NUMERATOR = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
              5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
              -2.76076847742355e-16)  # odd polynomial in x, by powers of x^2
_DENOMINATOR = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
                1.19825839466702e-06)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def tanh_rational(x: mx.array) -> mx.array:
    x = mx.clip(x, -_CLAMP, _CLAMP)
    x2 = x * x
    numerator = mx.array(_NUMERATOR[-1], dtype=x.dtype)
    for coefficient in _NUMERATOR[-2::-1]:
        numerator = numerator * x2 + coefficient
    denominator = mx.array(_DENOMINATOR[-1], dtype=x.dtype)
    for coefficient in _DENOMINATOR[-2::-1]:
        denominator = denominator * x2 + coefficient
    return x * numerator / denominator


def gelu_tanh(x: mx.array) -> mx.array:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as nn.gelu_approx."""
    return 0.5 * x * (1.0 + tanh_rational(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


@partial(mx.compile, shapeless=True)  # fuses the ~25 elementwise ops into one pass over the chunk
def _gelu_gate(gate: mx.array, up: mx.array) -> mx.array:
    return gelu_tanh(gate) * up


def use_fast_gelu(model: Any) -> int:
    """Swap Gemma 3's MLP activation for the vectorized one, in place; returns how many MLPs.

    The class of each `gemma3_text.MLP` instance is swapped for a subclass that differs only in
    its activation, so the parameter tree, weights and names stay exactly as mlx-lm built them.
    """
    from mlx_lm.models import gemma3_text

    swapped = 0
    for module in model.modules():
        if type(module) is gemma3_text.MLP:
            module.__class__ = _FastGeluMLP
            swapped += 1
    return swapped


def _fast_gelu_mlp_call(self: Any, x: mx.array) -> mx.array:
    return self.down_proj(_gelu_gate(self.gate_proj(x), self.up_proj(x)))


def _make_mlp_class() -> type:
    from mlx_lm.models import gemma3_text

    from rewind.kernels.rebind import register_stand_in

    mlp = type("_FastGeluMLP", (gemma3_text.MLP,), {"__call__": _fast_gelu_mlp_call,
                                                    "__module__": __name__})
    # The function is gemma3_text.MLP's (to float32 rounding), which the C kernels
    # (rewind.kernels.native_forward) implement themselves: they may take this MLP.
    register_stand_in(mlp, gemma3_text.MLP)
    return mlp


_FastGeluMLP = _make_mlp_class()
