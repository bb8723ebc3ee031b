/* GGUF (ggml) quantized weights read in place: the block layouts, and the products of cpu_kernels.c's
   Matrix parts whose form is one of them (quant.c). */
#ifndef REWIND_QUANT_H
#define REWIND_QUANT_H
#include <stdint.h>

/* A weight form >= FORM_GGML is the ggml type (form - FORM_GGML), rows stored as ggml blocks. */
#define FORM_GGML 100
enum {
  GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
  GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
};

/* Elements and bytes of one block of `type`; 0 for a type the kernels do not read. */
int64_t ggml_block_elements(int type);
int64_t ggml_block_bytes(int type);

/* y[r * ldy + o] = sum_k W[o][k] x[r][k] for o < out, r < m: W [out, in] in ggml `type` blocks,
   x [m, in] float32, quantized per block as ggml does (Q8_0 / Q8_1 / Q8_K) before int8 dot
   products. 0, or -1 for bad sizes, -2 when scratch cannot be allocated. */
int qmatvec(const void *W, int type, const float *x, float *y, int64_t out, int64_t in,
            int64_t ldy, int64_t m, int threads);

#endif
