/* Helpers shared by the CPU kernels: dtype codes, conversions, 16-float vectors, exp, prefetch.
 * Included by the .c files of this folder (static inline: each file gets its own copy). */
#ifndef WORKBENCH_CPU_OPS_COMMON_H
#define WORKBENCH_CPU_OPS_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { MAX_D = 256 };

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* ---- scalars: one element of dtype dt <-> float32 ---- */
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

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;   /* branch-free: it vectorizes */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

static inline float rnd(float f, int dt) {       /* f rounded to dtype dt, as a float (exact) */
    if (dt == DT_BF16) {
        uint32_t u = (uint32_t)f32_to_bf16(f) << 16;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    if (dt == DT_F16) return (float)(_Float16)f;
    return f;
}

static inline void st(void *p, int64_t i, int dt, float f) {
    if (dt == DT_F32) ((float *)p)[i] = f;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else ((_Float16 *)p)[i] = (_Float16)f;
}

/* Row loops written once and stamped out per dtype (dt a constant), so that loads, stores and
 * roundings inline branch-free and the loops vectorize. */
#define FOR_EACH_DTYPE(dt, call) \
    switch (dt) { case DT_F32: call(DT_F32); break; case DT_BF16: call(DT_BF16); break; default: call(DT_F16); }

/* Rows are spread over threads only when there is enough work to pay for the fork. */
#define PARALLEL_ROWS(T, width) if ((int64_t)(T) * (width) >= 65536) num_threads(nthreads)

static inline void store_row(void *base, int64_t row, int dt, int D, const float *restrict src) {
    for (int i = 0; i < D; i++) st(base, row * D + i, dt, src[i]);
}

/* exp(x) for x <= 0 (scores minus their row max), written so the compiler can vectorize
 * it: 2^n * p(r) with r in [-ln2/2, ln2/2] and a degree-6 polynomial; relative error
 * about 2e-7, below float32's own rounding of the scores. Underflows to 0 below -87. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* round to nearest by the 1.5 * 2^23 trick: unlike roundf it vectorizes */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666666666666666f + r * (0.041666666666666664f
              + r * (0.008333333333333333f + r * 0.001388888888888889f)))));
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* 16 floats: GCC vector extensions, so the same code becomes AVX-512, AVX2 or SSE as -march allows. */
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2), may_alias));   /* unaligned loads */
typedef _Float16 v16h __attribute__((vector_size(32), aligned(2), may_alias));
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

static inline v16f load16(const void *base, int64_t elem, int dt) {   /* 16 elements from base[elem] */
    if (dt == DT_F32) return *(const v16f_u *)((const float *)base + elem);
    if (dt == DT_BF16) {
        v16u32 w = __builtin_convertvector(*(const v16u16 *)((const uint16_t *)base + elem), v16u32) << 16;
        return (v16f)w;
    }
    return __builtin_convertvector(*(const v16h *)((const _Float16 *)base + elem), v16f);
}

/* 16 float32 values to base[elem] in dtype `dt` (bfloat16: round to nearest even, as torch's .to does). */
static inline void store16(void *base, int64_t elem, int dt, v16f f) {
    if (dt == DT_F32) {
        *(v16f_u *)((float *)base + elem) = f;
    } else if (dt == DT_BF16) {
        v16u32 u = (v16u32)f;
        v16u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        v16u32 is_nan = (v16u32)((u & 0x7fffffffu) > 0x7f800000u);
        v16u32 quiet = (u >> 16) | 0x40u;
        *(v16u16 *)((uint16_t *)base + elem) = __builtin_convertvector((rounded & ~is_nan) | (quiet & is_nan), v16u16);
    } else {
        *(v16h *)((_Float16 *)base + elem) = __builtin_convertvector(f, v16h);
    }
}

/* Lane t of the result is the sum of all 16 lanes of v[t]: a transpose-and-add tree (45 ops for 16
 * sums, against ~8 per sum reduced one by one). The tree leaves lane l holding input bitrev4(l), so
 * the inputs are taken in bit-reversed order. */
static inline v16f reduce16(const v16f *v) {
    static const int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    v16f a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) {
        v16f x = v[rev[2 * j]], y = v[rev[2 * j + 1]];
        a[j] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

static inline void prefetch_bytes(const void *base, int64_t byte_offset, int nbytes) {
    const char *p = (const char *)base + byte_offset;
    for (int off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* exp(x) for x <= 0 on 16 lanes at once (the vector form of exp_nonpos); -inf gives exactly 0. */
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16f exp16_nonpos(v16f x) {
    const v16i is_neg_inf = x == -INFINITY;
    x = (v16f)(((v16i)x & ~(v16i)(x < -87.0f)) | ((v16i)((v16f){0} - 87.0f) & (v16i)(x < -87.0f)));
    const v16f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const v16f r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    const v16f p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666666666666666f + r * (0.041666666666666664f
                   + r * (0.008333333333333333f + r * 0.001388888888888889f)))));
    const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return (v16f)((v16i)(p * (v16f)e) & ~is_neg_inf);
}

static inline float hsum16(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

static inline float hmax16(v16f v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

#endif
