/* x @ W.T for a few float32 rows of x (decode at batch 1-4) on the plain row-major [N, K] weight,
 * float32 or bfloat16 (widened to float32 as it is read: the sums are float32 either way).
 *
 * Why: at M=1 a linear is a matrix-vector product, bound by how fast the weight streams from
 * memory (2 flops per 4-byte weight). oneDNN's packed path (torch.ops.mkldnn._linear_pointwise)
 * reaches ~10 GFLOP/s there on the 2-core AVX2 target, a fraction of the bandwidth; this kernel
 * reads each weight row once with several rows in flight sharing each load of x (docs/design.md
 * has the numbers). A bfloat16 weight is half the bytes, so on a CPU without bfloat16 arithmetic
 * (AVX2: oneDNN has no bfloat16 GEMM there and torch's fallback is slower than float32) it still
 * streams at the bandwidth and a batch-1 step reads half as much.
 *
 * Shape: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) (+ res[m, n]) for m < M, n < N.
 * One row of x (M=1, batch-1 decode) reads each weight row start to end before the next, so the
 * weight is one stream in address order (rows_seq). More rows of x take blocks of R weight rows
 * with one 8-float accumulator per (row, x row): M=2..3 four rows, M=4 two, so the accumulators
 * and one weight vector fit the 16 ymm registers. The K tail (K not a multiple of 8) is one masked load
 * (bfloat16: a zero-padded copy). The rows are split between threads in whole blocks.
 * M > 4 runs in groups of 4 rows of x (correct, but oneDNN is the faster path there).
 * Widening bfloat16 is exact, so a bfloat16 weight gives bit for bit the float32 result on the
 * same values. Built for a CPU with AVX512_BF16, bfloat16 weights take a dot-product path instead
 * (rows_dp below: x rounded to bfloat16, float32 sums); wb_gemv_bf16_rounds_x() says which.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* lanes [0, rem) set: the mask for the last, partial, 8-float vector of a row */
static inline __m256i tail_mask(int rem) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), idx);
}

/* 8 weights from w[i], float32 (WBF 0) or bfloat16 (WBF 1, widened: bf16 is float32's top half). */
static inline __attribute__((always_inline)) __m256 wload(const void *w, int64_t i, int WBF) {
    if (!WBF) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The last rem (< 8) weights from w[i], zeros after them. */
static inline __m256 wload_tail(const void *w, int64_t i, int rem, __m256i mask, int WBF) {
    if (!WBF) return _mm256_maskload_ps((const float *)w + i, mask);
    uint16_t t[8] = {0};
    memcpy(t, (const uint16_t *)w + i, (size_t)rem * sizeof(uint16_t));
    return wload(t, 0, 1);
}

/* The 4 horizontal sums of a[0..3] as one 4-float vector. */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

static inline float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* R weight rows from row n, MM rows of x: writes out[m, n .. n+R). R and MM are constants at
 * every call, so the loops unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void block(const float *restrict x, int64_t ldx,
                                                        const void *restrict w, int64_t ldw,
                                                        const float *restrict bias, const float *restrict res,
                                                        int64_t ldr, float *restrict out, int64_t ldo,
                                                        int64_t n, int64_t K, __m256i mask, int R, int MM,
                                                        int WBF) {
    __m256 acc[4][4];   /* R <= 4: one row of x takes rows_seq */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++) acc[r][m] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
        for (int r = 0; r < R; r++) {
            const __m256 wv = wload(w, (n + r) * ldw + k, WBF);
            for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    if (K8 < K) {
        __m256 xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm256_maskload_ps(x + m * ldx + K8, mask);
        for (int r = 0; r < R; r++) {
            const __m256 wv = wload_tail(w, (n + r) * ldw + K8, (int)(K - K8), mask, WBF);
            for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    for (int m = 0; m < MM; m++) {
        float *o = out + m * ldo + n;
        int r = 0;
        for (; r + 4 <= R; r += 4) {
            __m128 s = hsum4x8(acc[r][m], acc[r + 1][m], acc[r + 2][m], acc[r + 3][m]);
            if (bias) s = _mm_add_ps(s, _mm_loadu_ps(bias + n + r));
            if (res) s = _mm_add_ps(s, _mm_loadu_ps(res + m * ldr + n + r));
            _mm_storeu_ps(o + r, s);
        }
        for (; r < R; r++) {
            float s = hsum8f(acc[r][m]);
            if (bias) s += bias[n + r];
            if (res) s += res[m * ldr + n + r];
            o[r] = s;
        }
    }
}

/* One x row against rows [n0, n1), each row read start to end before the next: the weight streams
 * in address order, which the hardware prefetcher follows. Blocks of 8 rows read 8 rows side by side
 * instead, and with the model's short rows (K = 576: 2.3 KB of float32) that pattern streamed at
 * ~16 GB/s on one core of the AVX-512 EPYC against ~22 this way (docs/design.md). Two accumulators
 * (even and odd 8-float steps) keep two FMA chains in flight. */
static inline __attribute__((always_inline)) void rows_seq(const float *restrict x, const void *restrict w,
                                                           int64_t ldw, const float *restrict bias,
                                                           const float *restrict res, float *restrict out, int64_t n0,
                                                           int64_t n1, int64_t K, __m256i mask, int WBF) {
    const int64_t K8 = K & ~(int64_t)7, K16 = K & ~(int64_t)15;
    for (int64_t n = n0; n < n1; n++) {
        const int64_t base = n * ldw;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k < K16; k += 16) {
            a0 = _mm256_fmadd_ps(wload(w, base + k, WBF), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(wload(w, base + k + 8, WBF), _mm256_loadu_ps(x + k + 8), a1);
        }
        if (k < K8) a0 = _mm256_fmadd_ps(wload(w, base + k, WBF), _mm256_loadu_ps(x + k), a0);
        if (K8 < K)
            a1 = _mm256_fmadd_ps(wload_tail(w, base + K8, (int)(K - K8), mask, WBF), _mm256_maskload_ps(x + K8, mask), a1);
        float s = hsum8f(_mm256_add_ps(a0, a1));
        if (bias) s += bias[n];
        if (res) s += res[n];
        out[n] = s;
    }
}

/* Rows [n0, n1) of the output for MM (1..4) rows of x; wdt: the weight's dtype code (common.h). */
static void rows(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                 const float *res, int64_t ldr, float *out, int64_t ldo, int MM, int64_t n0, int64_t n1, int64_t K) {
    const __m256i mask = tail_mask((int)(K & 7));
    if (MM == 1) {   /* batch 1: one stream (rows_seq); widened bfloat16 the same order, so bit for bit */
        if (wdt == 1)
            rows_seq(x, w, ldw, bias, res, out, n0, n1, K, mask, 1);
        else
            rows_seq(x, w, ldw, bias, res, out, n0, n1, K, mask, 0);
        return;
    }
    int64_t n = n0;
#define RUN(R, MMC, WBF) \
    for (; n + (R) <= n1; n += (R)) block(x, ldx, w, ldw, bias, res, ldr, out, ldo, n, K, mask, R, MMC, WBF)
#define ALL_M(WBF)                                          \
    switch (MM) {                                           \
    case 2: RUN(4, 2, WBF); RUN(1, 2, WBF); break;          \
    case 3: RUN(4, 3, WBF); RUN(1, 3, WBF); break;          \
    default: RUN(2, 4, WBF); RUN(1, 4, WBF); break;         \
    }
    if (wdt == 1) {
        ALL_M(1)
    } else {
        ALL_M(0)
    }
#undef ALL_M
#undef RUN
}

int wb_gemv_f32_available(void) { return 1; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* bfloat16 weights on a CPU with AVX512_BF16 (e.g. Zen 4, Sapphire Rapids): each x row is rounded
 * to bfloat16 once (as a bfloat16 model's activations are anyway) and VDPBF16PS multiplies 32
 * weight/x pairs into 16 float32 sums per instruction, where widening each weight costs two more
 * instructions per 16 and leaves the stream compute-bound on one core (measured: slower than
 * oneDNN's own bfloat16 GEMM there). The sums are float32, as in oneDNN's bfloat16 path. */
#define HAVE_BF16_DP 1

/* R weight rows from row n against MM bfloat16 x rows (xb, row stride ldxb, zero-padded to a
 * multiple of 32): out[m, n .. n+R). */
static inline __attribute__((always_inline)) void block_dp(const uint16_t *restrict xb, int64_t ldxb,
                                                           const uint16_t *restrict w, int64_t ldw,
                                                           const float *restrict bias, const float *restrict res,
                                                           int64_t ldr, float *restrict out, int64_t ldo, int64_t n,
                                                           int64_t K, __mmask32 tail, int R, int MM) {
    __m512 acc[4][4];   /* R <= 4: one row of x takes rows_dp_seq */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t k = 0; k < K32; k += 32) {
        __m512i xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm512_loadu_si512((const void *)(xb + m * ldxb + k));
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + (n + r) * ldw + k));
            for (int m = 0; m < MM; m++)
                acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)wv, (__m512bh)xv[m]);
        }
    }
    if (K32 < K) {   /* the last K % 32 weights: a masked load, zeros beyond (x is zero-padded) */
        __m512i xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm512_loadu_si512((const void *)(xb + m * ldxb + K32));
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_maskz_loadu_epi16(tail, (const void *)(w + (n + r) * ldw + K32));
            for (int m = 0; m < MM; m++)
                acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)wv, (__m512bh)xv[m]);
        }
    }
    for (int m = 0; m < MM; m++)
        for (int r = 0; r < R; r++) {
            float s = _mm512_reduce_add_ps(acc[r][m]);
            if (bias) s += bias[n + r];
            if (res) s += res[m * ldr + n + r];
            out[m * ldo + n + r] = s;
        }
}

/* One x row against rows [n0, n1), each row read start to end before the next: the weight is then
 * read in address order, one stream the hardware prefetcher follows. */
static void rows_dp_seq(const uint16_t *xb, const uint16_t *w, int64_t ldw, const float *bias, const float *res,
                        float *out, int64_t n0, int64_t n1, int64_t K, __mmask32 tail) {
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * ldw;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
               a3 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 128 <= K32; k += 128) {
#define DP(a, o) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(wr + k + o)), \
                                      (__m512bh)_mm512_loadu_si512((const void *)(xb + k + o)))
            DP(a0, 0);
            DP(a1, 32);
            DP(a2, 64);
            DP(a3, 96);
        }
        for (; k < K32; k += 32) DP(a0, 0);
#undef DP
        if (K32 < K)
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void *)(wr + K32)),
                                  (__m512bh)_mm512_loadu_si512((const void *)(xb + K32)));
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        if (bias) sum += bias[n];
        if (res) sum += res[n];
        out[n] = sum;
    }
}

static void rows_dp(const uint16_t *xb, int64_t ldxb, const uint16_t *w, int64_t ldw, const float *bias,
                    const float *res, int64_t ldr, float *out, int64_t ldo, int MM, int64_t n0, int64_t n1, int64_t K) {
    const __mmask32 tail = (__mmask32)((1ull << (K & 31)) - 1);
    if (MM == 1) {
        rows_dp_seq(xb, w, ldw, bias, res, out, n0, n1, K, tail);
        return;
    }
    int64_t n = n0;
#define RUN(R, MMC) for (; n + (R) <= n1; n += (R)) block_dp(xb, ldxb, w, ldw, bias, res, ldr, out, ldo, n, K, tail, R, MMC)
    switch (MM) {
    case 2: RUN(4, 2); RUN(1, 2); break;
    case 3: RUN(4, 3); RUN(1, 3); break;
    default: RUN(2, 4); RUN(1, 4); break;
    }
#undef RUN
}

/* MM rows of x (row stride ldx) -> bfloat16 (round to nearest even), row stride ldxb, zeros to ldxb. */
static void x_to_bf16(const float *x, int64_t ldx, int MM, int64_t K, uint16_t *xb, int64_t ldxb) {
    for (int m = 0; m < MM; m++) {
        for (int64_t k = 0; k < ldxb; k += 16) {
            const int64_t left = K - k;
            const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(mk, x + m * ldx + k);
            _mm256_storeu_si256((__m256i *)(xb + m * ldxb + k), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}
#endif

#else   /* no AVX2 + FMA: a plain loop, so the library still builds; Python does not dispatch here */

static void rows(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                 const float *res, int64_t ldr, float *out, int64_t ldo, int MM, int64_t n0, int64_t n1, int64_t K) {
    for (int m = 0; m < MM; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float wv;
                if (wdt == 1) {
                    uint32_t u = (uint32_t)((const uint16_t *)w)[n * ldw + k] << 16;
                    memcpy(&wv, &u, sizeof wv);
                } else {
                    wv = ((const float *)w)[n * ldw + k];
                }
                s += x[m * ldx + k] * wv;
            }
            if (bias) s += bias[n];
            if (res) s += res[m * ldr + n];
            out[m * ldo + n] = s;
        }
}

int wb_gemv_f32_available(void) { return 0; }
#endif

/* The bfloat16 copy of up to 4 rows of x the VDPBF16PS path reads: its row stride (K rounded up to
 * 32) and the elements a caller's scratch needs; 0 where bfloat16 weights are widened instead. */
static int64_t xb_stride(int64_t K) { return (K + 31) & ~(int64_t)31; }

int64_t wb_gemv_scratch_elems(int64_t K) {
#ifdef HAVE_BF16_DP
    return 4 * xb_stride(K);
#else
    (void)K;
    return 0;
#endif
}

/* Rows [n0, n1) of out for MM (<= 4) rows of x; xb: their bfloat16 copy (ldxb apart) when the weight
 * takes the VDPBF16PS path, else NULL. */
static void rows_any(const float *xm, int64_t ldx, const uint16_t *xb, int64_t ldxb, const void *w, int64_t ldw,
                     int wdt, const float *bias, const float *rm, int64_t ldr, float *om, int64_t ldo, int MM,
                     int64_t n0, int64_t n1, int64_t K) {
#ifdef HAVE_BF16_DP
    if (xb != NULL) {
        rows_dp(xb, ldxb, w, ldw, bias, rm, ldr, om, ldo, MM, n0, n1, K);
        return;
    }
#else
    (void)xb, (void)ldxb;
#endif
    rows(xm, ldx, w, ldw, wdt, bias, rm, ldr, om, ldo, MM, n0, n1, K);
}

/* Rows [n0, n1) of the output on the calling thread only, for a caller that runs its own parallel
 * region and splits the rows itself (decode_layers.c; wb_gemv_share gives a thread its part).
 * Arguments as wb_gemv's; xb: wb_gemv_scratch_elems(K) uint16 of the caller's (NULL when that is 0).
 * Each output element is the same sum whichever thread computes it, so the split never changes
 * a result. */
void wb_gemv_rows(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                  const float *res, int64_t ldr, float *out, int64_t ldo, int M, int64_t n0, int64_t n1, int64_t K,
                  uint16_t *xb) {
    const int64_t ldxb = xb_stride(K);
#ifndef HAVE_BF16_DP
    xb = NULL;
#endif
    if (wdt != 1) xb = NULL;
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int MM = M - m0 < 4 ? M - m0 : 4;
#ifdef HAVE_BF16_DP
        if (xb) x_to_bf16(x + m0 * ldx, ldx, MM, K, xb, ldxb);
#endif
        rows_any(x + m0 * ldx, ldx, xb, ldxb, w, ldw, wdt, bias, res ? res + m0 * ldr : res, ldr, out + m0 * ldo,
                 ldo, MM, n0, n1, K);
    }
}

/* Thread t of T's part of N output rows: a contiguous run of whole 8-row blocks. */
void wb_gemv_share(int64_t N, int t, int T, int64_t *n0, int64_t *n1) {
    const int64_t blocks = (N + 7) / 8;
    *n0 = blocks * t / T * 8;
    *n1 = blocks * (t + 1) / T * 8;
    if (*n1 > N) *n1 = N;
    if (*n0 > *n1) *n0 = *n1;
}

/* x: [M, K] float32 at row stride ldx; w: [N, K] at row stride ldw (elements), float32 (wdt 0) or
 * bfloat16 (wdt 1); bias: [N] float32 or NULL; res: [M, N] float32 at row stride ldr or NULL; out:
 * [M, N] float32 at row stride ldo (may be res itself: each element is read before it is written).
 * Threads take contiguous runs of 8-row blocks. */
void wb_gemv(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias, const float *res,
             int64_t ldr, float *out, int64_t ldo, int M, int64_t N, int64_t K, int nthreads) {
    /* a thread per ~64K weights at least: below that the fork costs more than it saves */
    int64_t most = (N * K) / 65536;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (nt > most) nt = most < 1 ? 1 : (int)most;
    const int64_t ldxb = xb_stride(K);
    uint16_t *xb = NULL;
#ifdef HAVE_BF16_DP
    if (wdt == 1) xb = aligned_alloc(64, (size_t)wb_gemv_scratch_elems(K) * sizeof(uint16_t));
#endif
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int MM = M - m0 < 4 ? M - m0 : 4;
        const float *xm = x + m0 * ldx;
        const float *rm = res ? res + m0 * ldr : res;
        float *om = out + m0 * ldo;
#ifdef HAVE_BF16_DP
        if (xb) x_to_bf16(xm, ldx, MM, K, xb, ldxb);
#endif
        if (nt == 1) {
            rows_any(xm, ldx, xb, ldxb, w, ldw, wdt, bias, rm, ldr, om, ldo, MM, 0, N, K);
            continue;
        }
#pragma omp parallel num_threads(nt)
        {
#ifdef _OPENMP
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
            const int t = 0, T = 1;
#endif
            int64_t n0, n1;
            wb_gemv_share(N, t, T, &n0, &n1);
            if (n0 < n1) rows_any(xm, ldx, xb, ldxb, w, ldw, wdt, bias, rm, ldr, om, ldo, MM, n0, n1, K);
        }
    }
    free(xb);
}

/* 1 when bfloat16 weights take the VDPBF16PS path (x rounded to bfloat16), 0 when they are widened
 * (the float32 result on the same values, bit for bit). */
int wb_gemv_bf16_rounds_x(void) {
#ifdef HAVE_BF16_DP
    return 1;
#else
    return 0;
#endif
}

