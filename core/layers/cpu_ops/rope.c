/* Rotary embedding in place, for CPUs: the Llama block's q/k rotation in one pass.
 *
 * Why: the torch version is six ops (a reshape, a flip, two products, a sum, and a copy);
 * at decode batch sizes they cost their dispatch, not their arithmetic, and at prefill
 * sizes they make several passes over q and k. Measured on the 2-core target, bfloat16:
 * 47 -> 20 us at 32 tokens, 670 -> 208 us at 1264 tokens.
 *
 * Numerics follow the torch reference op by op, including where it rounds to the model
 * dtype (bfloat16/float16) between steps, so the fused ops round the same values the
 * same way: the result is bit-identical. No fused multiply-add: the reference does not
 * contract either.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

static inline __attribute__((always_inline)) void rope_row(void *x, int64_t base_row, int H, int D,
                                                           const void *cos_t, const void *sin_t, int64_t cs_row,
                                                           int dt) {
    const int half = D / 2;
    for (int h = 0; h < H; h++) {
        const int64_t base = base_row + (int64_t)h * D;
        float lo[256], hi[256];        /* D <= 512, checked by the caller */
        for (int i = 0; i < half; i++) {
            lo[i] = ld(x, base + i, dt);
            hi[i] = ld(x, base + half + i, dt);
        }
#pragma omp simd
        for (int i = 0; i < half; i++) {   /* first half: x1 * cos + x2 * (-sin) */
            float a = rnd(lo[i] * ld(cos_t, cs_row + i, dt), dt), b = rnd(hi[i] * ld(sin_t, cs_row + i, dt), dt);
            st(x, base + i, dt, a + b);
        }
#pragma omp simd
        for (int i = 0; i < half; i++) {   /* second half: x2 * cos + x1 * sin */
            float a = rnd(hi[i] * ld(cos_t, cs_row + half + i, dt), dt);
            float b = rnd(lo[i] * ld(sin_t, cs_row + half + i, dt), dt);
            st(x, base + half + i, dt, a + b);
        }
    }
}

/* In place: heads [0, H) of each row, x[t, h] = x * cos[t] + rotate_half(x) * sin[t], where
 * rotate_half(x) = (-x2, x1) and here the sign lives in `sin` (its first half negated; see
 * rotary_embedding.py). Each product and the sum round to dt, as the torch ops do.
 * x: row t starts at t * x_stride, head h at + h * D; cos/sin: row t at t * cs_stride, dtype dt. */
void wb_rope_inplace(void *x, int64_t x_stride, const void *cos_t, const void *sin_t, int64_t cs_stride, int T,
                     int H, int D, int dt, int nthreads) {
#pragma omp parallel for PARALLEL_ROWS(T, H * D)
    for (int t = 0; t < T; t++) {
#define ROPE_ROW(DT) rope_row(x, (int64_t)t * x_stride, H, D, cos_t, sin_t, (int64_t)t * cs_stride, DT)
        FOR_EACH_DTYPE(dt, ROPE_ROW)
#undef ROPE_ROW
    }
}
