"""Linear attention's short depthwise convolution as shifted multiply-adds, on CUDA.

mlx-lm's Qwen 3.5 / Qwen3-Next layers run a depthwise `nn.Conv1d` (kernel 4, one filter per
channel) over each chunk's inputs plus the 3 kept from before. On CUDA, MLX runs every
convolution through cuDNN, which builds an execution plan for each new input shape: a prompt
chunk of a length not seen before (every cached turn's tail is one) paid for a plan before its
first token. Four shifted slices multiplied by one weight column each, summed in float32, are
the same sum, as one fused elementwise kernel whose shape is only an argument.

Decode steps (one output row) keep cuDNN: their shape never changes, so their plan is built
once, and one call is fewer launches than the fused kernel's inputs.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from rewind.kernels.rebind import register_stand_in


@mx.compile
def _shifted_sum(x: mx.array, weight: mx.array) -> mx.array:
    """x [B, T, C], weight [C, K, 1] -> [B, T - K + 1, C]: sum over j of x[:, j + t] * w[:, j]."""
    kernel = weight.shape[1]
    rows = x.shape[1] - kernel + 1
    wide = x.astype(mx.float32)
    columns = weight[:, :, 0].astype(mx.float32)
    out = wide[:, 0:rows] * columns[:, 0]
    for j in range(1, kernel):
        out = out + wide[:, j:j + rows] * columns[:, j]
    return out.astype(x.dtype)


class ShiftedDepthwiseConv1d(nn.Conv1d):
    """An `nn.Conv1d` with groups == channels, stride 1, no padding or dilation: the same
    parameters, computed as shifted multiply-adds for inputs longer than the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        kernel = self.weight.shape[1]
        if x.shape[1] <= kernel:
            return super().__call__(x)
        out = _shifted_sum(x, self.weight)
        if "bias" in self:
            out = out + self.bias
        return out


register_stand_in(ShiftedDepthwiseConv1d, nn.Conv1d)


def takes(conv: Any) -> bool:
    """Whether `conv` is a depthwise Conv1d this class computes."""
    if type(conv) is not nn.Conv1d:
        return False
    channels, _, per_group = conv.weight.shape
    return (conv.groups == channels and per_group == 1 and conv.stride == 1
            and conv.padding == 0 and conv.dilation == 1)


def use_in_model(model: Any) -> int:
    """Every depthwise Conv1d of `model` computes as shifted multiply-adds; returns how many."""
    changed = 0
    for _, module in model.named_modules():
        if takes(module):
            module.__class__ = ShiftedDepthwiseConv1d
            changed += 1
    return changed
