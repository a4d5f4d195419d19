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
 * contract either. (Not here, after trying: RMSNorm, whose mean of squares matches ATen's
 * bit for bit only in ATen's summation order, and one ulp there changes bfloat16 greedy
 * tokens; SiLU-and-mul, which is exp-bound and no faster compiled.)
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float ld(const void *p, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return (float)((const _Float16 *)p)[i];
}

static inline uint16_t to_bf16_bits(float f) {   /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;   /* branch-free: it vectorizes */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* f rounded to dtype dt, returned as float (exact for bf16/f16 values). */
static inline float rnd(float f, int dt) {
    if (dt == DT_BF16) {
        uint32_t u = (uint32_t)to_bf16_bits(f) << 16;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    if (dt == DT_F16) return (float)(_Float16)f;
    return f;
}

static inline void st(void *p, int64_t i, int dt, float f) {
    if (dt == DT_F32) ((float *)p)[i] = f;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = to_bf16_bits(f);
    else ((_Float16 *)p)[i] = (_Float16)f;
}

/* Rows are spread over threads only when there is enough work to pay for the fork. */
#define PARALLEL_ROWS(T, width) if ((int64_t)(T) * (width) >= 65536) num_threads(nthreads)

/* The row loops are written once and stamped out per dtype (dt a constant), so that the
 * loads, stores and roundings inline branch-free and the loops vectorize. */
#define FOR_EACH_DTYPE(dt, call) \
    switch (dt) { case DT_F32: call(DT_F32); break; case DT_BF16: call(DT_BF16); break; default: call(DT_F16); }

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
