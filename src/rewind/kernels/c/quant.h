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

/* Output rows [first, first + rows) of a matrix, stored as ggml `type` blocks [rows, in]. */
typedef struct {
  const void *W;
  int type;
  int64_t first, rows;
} QPart;
#define QMAX_PARTS 3

/* y[r * ldy + part.first + o] = sum_k part.W[o][k] x[r][k] for every part, o < part.rows,
   r < m; x [m, in] float32, quantized once per block as ggml does (Q8_0 / Q8_K) before the
   int8 dot products, and all parts' rows spread over one pool job. 0, or -1 for bad sizes, -2
   when scratch cannot be allocated. */
int qmatvec_parts(const QPart *parts, int nparts, const float *x, float *y, int64_t ldy,
                  int64_t in, int64_t m, int threads);

/* AMX tiles for the products of prefill rows (quant512.h): on where want is 1, this build has
   them (AVX512-VNNI), the CPU has AMX-INT8 and Linux grants the process tile data. Returns
   whether they are on (want -1: only asks). Off until asked. */
int quant_amx(int want);

/* The activation rows above which AVX512-VNNI products take strips (rows >= 4 sets it; any
   other value only asks). The same bits either way. */
int quant_strips_above(int rows);

/* Which products take AMX where it is on: 0 the measured rule (k-quants from 16 rows), 1 all
   strips, 2 none; any other value only asks. The same bits either way. */
int quant_amx_rule(int rule);

#endif
