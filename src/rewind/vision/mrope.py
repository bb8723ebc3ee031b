"""Multimodal rotary positions (mrope) inside mlx-lm's language models.

Qwen2-VL, Qwen2.5-VL and Qwen 3.5 rotate each token by three positions (temporal, height, width):
the frequency bands of a head are split into three sections (`mrope_section`), each rotated by
one of the three. A text token has the same value in all three, so for text this is the plain
1-D RoPE mlx-lm's text classes compute from `cache.offset`; image tokens take their grid
coordinates, and the text after an image continues from the largest position in it, so it sits
at `index + delta` with a (negative) delta per prompt.

mlx-lm's attention calls `self.rope(x, offset=cache.offset)` and has no way to take position ids.
`install_mrope(model, ...)` replaces each full-attention layer's rope with `MultimodalRoPE`,
which rotates by the positions the engine gives for the current call (rewind.engine.positions)
and, when none are given, by `offset + arange(L)` in all three (exactly the 1-D positions). The
frequencies, section layout and rotation are mlx-vlm's (`MRoPERotaryEmbedding`, the class its
own Qwen language models use), so the numbers are those of mlx-vlm's models; everything else
(weights, caches, batching, the prompt cache) stays mlx-lm's.

The CPU kernels (rewind.kernels.native_forward) rotate by the cache offset, so a model that gets
mrope runs MLX's own layers (rewind.models.loader.use_mlx_layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from rewind.engine.positions import RopePositions, install_positions_holder


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class MultimodalRoPE(nn.Module):
    """A drop-in for mlx-lm's `rope(x, offset)` that rotates by 3-D positions [3, B, L]."""

    def __init__(self, rotary_dim: int, base: float, mrope_section: Sequence[int], style: str,
                 holder: RopePositions) -> None:
        super().__init__()
        from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

        # Private (underscore) attributes stay out of the parameter tree: no weights change.
        self._rotary = MRoPERotaryEmbedding(rotary_dim, base=base, mrope_section=mrope_section,
                                            style=style)
        self._key = (rotary_dim, float(base), tuple(mrope_section), style)
        self._holder = holder
        self.rotary_dim = rotary_dim

    def _positions(self, x: mx.array, offset: Any) -> mx.array:
        batch, length = x.shape[0], x.shape[-2]
        steps = mx.arange(length, dtype=mx.int32)
        if isinstance(offset, mx.array) and offset.ndim > 0:  # a batch cache: one per row
            one = offset.astype(mx.int32)[:, None] + steps[None]
        else:
            one = mx.broadcast_to((steps + int(offset))[None], (batch, length))
        return mx.broadcast_to(one[None], (3, batch, length))

    def cos_sin(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        given = self._holder.current
        if given is None:
            return self._rotary(x, self._positions(x, offset))
        # The same for every layer of this call: computed once.
        memo = self._holder.memo.get(self._key)
        if memo is None:
            memo = self._holder.memo[self._key] = self._rotary(x, given)
        return memo

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        # x: [B, heads, L, head_dim]; cos/sin: [B, L, rotary_dim].
        cos, sin = self.cos_sin(x, offset)
        cos, sin = cos[:, None].astype(x.dtype), sin[:, None].astype(x.dtype)
        rotary = x[..., :self.rotary_dim]
        out = (rotary * cos + _rotate_half(rotary) * sin).astype(x.dtype)
        if self.rotary_dim < x.shape[-1]:
            out = mx.concatenate([out, x[..., self.rotary_dim:]], axis=-1)
        return out


def install_mrope(model: Any, layers: Sequence[Any], mrope_section: Sequence[int],
                  style: str) -> RopePositions:
    """Replace the rope of every layer in `layers` that has one (full attention; linear-attention
    layers have no positions) with a MultimodalRoPE; idempotent. Returns the model's holder."""
    from rewind.models.loader import is_cpu_backend, use_mlx_layers

    holder = install_positions_holder(model)
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        rope = getattr(attention, "rope", None)
        if rope is None or isinstance(rope, MultimodalRoPE):
            continue
        if not isinstance(rope, nn.RoPE) or rope.traditional or rope.scale != 1.0:
            raise ValueError(f"cannot put multimodal positions on a {type(rope).__name__} rope "
                             "(expected mlx's plain RoPE)")
        attention.rope = MultimodalRoPE(int(rope.dims), float(rope.base), mrope_section, style,
                                        holder)
    if is_cpu_backend():  # the C kernels rotate by the cache offset, not these positions
        use_mlx_layers(model)  # (a GPU runs MLX's layers already: nothing to undo there)
    return holder
