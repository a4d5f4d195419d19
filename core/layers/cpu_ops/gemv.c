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
 * Blocks of R weight rows at a time with one 8-float accumulator per (row, x row): M=1 takes
 * 8 rows (8 independent FMA chains), M=2..3 four rows, M=4 two, so the accumulators and one
 * weight vector fit the 16 ymm registers. The K tail (K not a multiple of 8) is one masked load
 * (bfloat16: a zero-padded copy). The rows are split between threads in whole blocks.
 * M > 4 runs in groups of 4 rows of x (correct, but oneDNN is the faster path there).
 * Widening bfloat16 is exact, so a bfloat16 weight gives bit for bit the float32 result on the
 * same values.
 */
#include <stdint.h>
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
    __m256 acc[8][4];
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

/* Rows [n0, n1) of the output for MM (1..4) rows of x; wdt: the weight's dtype code (common.h). */
static void rows(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                 const float *res, int64_t ldr, float *out, int64_t ldo, int MM, int64_t n0, int64_t n1, int64_t K) {
    const __m256i mask = tail_mask((int)(K & 7));
    int64_t n = n0;
#define RUN(R, MMC, WBF) \
    for (; n + (R) <= n1; n += (R)) block(x, ldx, w, ldw, bias, res, ldr, out, ldo, n, K, mask, R, MMC, WBF)
#define ALL_M(WBF)                                          \
    switch (MM) {                                           \
    case 1: RUN(8, 1, WBF); RUN(1, 1, WBF); break;          \
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
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int MM = M - m0 < 4 ? M - m0 : 4;
        const float *xm = x + m0 * ldx;
        const float *rm = res ? res + m0 * ldr : res;
        float *om = out + m0 * ldo;
        if (nt == 1) {
            rows(xm, ldx, w, ldw, wdt, bias, rm, ldr, om, ldo, MM, 0, N, K);
            continue;
        }
        const int64_t blocks = (N + 7) / 8;
#pragma omp parallel num_threads(nt)
        {
#ifdef _OPENMP
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
            const int t = 0, T = 1;
#endif
            int64_t n0 = blocks * t / T * 8, n1 = blocks * (t + 1) / T * 8;
            if (n1 > N) n1 = N;
            if (n0 < n1) rows(xm, ldx, w, ldw, wdt, bias, rm, ldr, om, ldo, MM, n0, n1, K);
        }
    }
}

