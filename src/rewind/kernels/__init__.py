"""Rewind's compute kernels and the one seam through which the engine reaches them.

C kernels for the CPU (`c/`: the layer pass, attention, the gated delta rule, built with the
system compiler at first use by `native`), a CUDA kernel for the gated delta rule, and the
Python around them: the backbone pass (`native_forward`), the output head (`fast_head`), bf16
Linear and Embedding modules (`native_linear`, `stored_embedding`), attention and the gated
delta rule inside MLX's layers (`cpu_attention`, `gated_delta`). `backend.select()` picks the
backend once per process; `backend.prepare(model)` sets a model up and returns its
`ModelKernels`, which the runner is handed (rewind.engine.runner).
"""
