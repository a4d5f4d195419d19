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

/* ---- 8-float (AVX2 + FMA + F16C) helpers ----
 * Why a second width: the 16-float code above was tuned for AVX-512's 32 zmm registers. Built for
 * AVX2 (16 ymm registers), every v16f is two ymm registers, so its register blocking needs twice
 * the registers there are and GCC spills the accumulators to the stack (measured on AMD znver3:
 * extend 7x slower than torch SDPA). WB_AVX2 selects kernels written for 8-float vectors with
 * blocking that fits 16 registers; AVX-512 builds (and non-x86 builds) keep the v16f code. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The 8-float helpers exist wherever AVX2 does (AVX-512 CPUs too: the per-request decode attention
 * uses them there, measured faster than its 16-float code); WB_AVX2 marks builds without AVX-512. */
#define WB_HAVE_AVX2 1
#if !defined(__AVX512F__)
#define WB_AVX2 1
#endif
#include <immintrin.h>

typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2), may_alias));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline __m256 load8(const void *base, int64_t elem, int dt) {   /* 8 elements from base[elem] */
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)base + elem);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + elem));
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* 8 float32 values to base[elem] in dtype dt (bfloat16: round to nearest even; NaN stays NaN). */
static inline void store8(void *base, int64_t elem, int dt, __m256 f) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)base + elem, f);
    } else if (dt == DT_BF16) {
        const v8u32 u = (v8u32)f;
        const v8u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const v8u32 is_nan = (v8u32)((u & 0x7fffffffu) > 0x7f800000u);
        const v8u32 quiet = (u >> 16) | 0x40u;
        *(v8u16 *)((uint16_t *)base + elem) = __builtin_convertvector((rounded & ~is_nan) | (quiet & is_nan), v8u16);
    } else {
        _mm_storeu_si128((__m128i *)((_Float16 *)base + elem), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
}

/* exp(x) for x <= 0 on 8 lanes (exp16_nonpos's formula); -inf gives exactly 0. */
static inline __m256 exp8_nonpos(__m256 x) {
    const __m256 is_neg_inf = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(0.001388888888888889f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.008333333333333333f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.041666666666666664f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.16666666666666666f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(is_neg_inf, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* r[k] becomes column k of the 8x8 block whose rows were r[0..7] (24 shuffles). */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

#endif
