/* A batch-invariant linear for --enable-deterministic-inference: out = x @ W.T (+ bias) (+ res),
 * where every output element is computed by the same instructions whatever M (the rows of x), which
 * rows share its tile, and which thread runs it.
 *
 * Why: a GEMM library picks its kernel, its blocking and (for small M) a matrix-vector path by the
 * shape, and each choice may sum the K products in another order; then one prompt's hidden states
 * change in the last bit with the batch it is in, and greedy decoding can take another token. The
 * engine's own fast paths differ the same way (gemv.c sums a batch-1 row with two accumulators, more
 * rows with one). Here each element out[m, n] is one 8-lane FMA chain over k in order (a masked
 * load for the K tail), its lanes summed in a fixed tree, then + bias, then + res, in float32.
 * No reassociation: the file is built without -ffast-math and the FMAs are explicit.
 *
 * Speed: tiles of 4 rows of x by 2 rows of W (8 accumulators, 4 x vectors and one W vector in 16
 * ymm registers); the threads split N in whole blocks of NB weight rows, and each block is reused
 * from cache by every 4-row tile of x before the next, so a prefill streams the weights once per
 * call rather than once per 4 rows. bfloat16 weights are widened as they are read (exact), so a
 * bfloat16 weight gives the float32 result on the same values.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

enum { BI_NB = 32 };   /* weight rows a thread keeps in cache while every tile of x passes over them */

static inline __attribute__((always_inline)) __m256 bi_wload(const void *w, int64_t i, int WBF) {
    if (!WBF) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 bi_wload_tail(const void *w, int64_t i, int rem, __m256i mask, int WBF) {
    if (!WBF) return _mm256_maskload_ps((const float *)w + i, mask);
    uint16_t t[8] = {0};
    memcpy(t, (const uint16_t *)w + i, (size_t)rem * sizeof(uint16_t));
    return bi_wload(t, 0, 1);
}

/* lanes 0..7 summed as ((0+4)+(2+6)) + ((1+5)+(3+7)): one fixed tree for every element */
static inline float bi_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* out[m0 + m, n + r] for m < MM, r < R: one accumulator per element, the same chain for each. */
static inline __attribute__((always_inline)) void
bi_tile(const float *restrict x, int64_t ldx, const void *restrict w, int64_t ldw, const float *restrict bias,
        const float *restrict res, int64_t ldr, float *restrict out, int64_t ldo, int64_t n, int64_t K,
        __m256i mask, const int R, const int MM, const int WBF) {
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++) acc[r][m] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
        for (int r = 0; r < R; r++) {
            const __m256 wv = bi_wload(w, (n + r) * ldw + k, WBF);
            for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    if (K8 < K) {
        __m256 xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm256_maskload_ps(x + m * ldx + K8, mask);
        for (int r = 0; r < R; r++) {
            const __m256 wv = bi_wload_tail(w, (n + r) * ldw + K8, (int)(K - K8), mask, WBF);
            for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    for (int m = 0; m < MM; m++)
        for (int r = 0; r < R; r++) {
            float s = bi_hsum(acc[r][m]);
            if (bias) s += bias[n + r];
            if (res) s += res[m * ldr + n + r];
            out[m * ldo + n + r] = s;
        }
}

/* Weight rows [n0, n1) against every row of x, 4 rows of x at a time. */
static void bi_block(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                     const float *res, int64_t ldr, float *out, int64_t ldo, int64_t M, int64_t n0, int64_t n1,
                     int64_t K) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K & 7)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int MM = M - m0 < 4 ? (int)(M - m0) : 4;
        const float *xm = x + m0 * ldx;
        const float *rm = res ? res + m0 * ldr : NULL;
        float *om = out + m0 * ldo;
#define BI_RUN(R, MMC, WBF)                                                                \
    for (; n + (R) <= n1; n += (R)) bi_tile(xm, ldx, w, ldw, bias, rm, ldr, om, ldo, n, K, mask, R, MMC, WBF)
#define BI_M(MMC, WBF)    \
    case MMC:             \
        BI_RUN(2, MMC, WBF); \
        BI_RUN(1, MMC, WBF); \
        break;
        int64_t n = n0;
        if (wdt == 1) {
            switch (MM) { BI_M(1, 1) BI_M(2, 1) BI_M(3, 1) default: BI_RUN(2, 4, 1); BI_RUN(1, 4, 1); }
        } else {
            switch (MM) { BI_M(1, 0) BI_M(2, 0) BI_M(3, 0) default: BI_RUN(2, 4, 0); BI_RUN(1, 4, 0); }
        }
#undef BI_M
#undef BI_RUN
    }
}

int wb_bi_linear_available(void) { return 1; }

/* x: [M, K] float32 at row stride ldx; w: [N, K] float32 (wdt 0) or bfloat16 (wdt 1) at row stride
 * ldw; bias: [N] float32 or NULL; res: [M, N] float32 at row stride ldr or NULL; out: [M, N] float32
 * at row stride ldo (not aliasing x or res). */
void wb_bi_linear(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                  const float *res, int64_t ldr, float *out, int64_t ldo, int64_t M, int64_t N, int64_t K,
                  int nthreads) {
    const int64_t blocks = (N + BI_NB - 1) / BI_NB;
    int nt = nthreads < 1 ? 1 : nthreads;
    if ((int64_t)nt > blocks) nt = (int)blocks;
    if (M * N * K < 65536) nt = 1;   /* the fork costs more than it saves */
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * BI_NB, n1 = n0 + BI_NB < N ? n0 + BI_NB : N;
        bi_block(x, ldx, w, ldw, wdt, bias, res, ldr, out, ldo, M, n0, n1, K);
    }
}
#else
int wb_bi_linear_available(void) { return 0; }
void wb_bi_linear(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                  const float *res, int64_t ldr, float *out, int64_t ldo, int64_t M, int64_t N, int64_t K,
                  int nthreads) {
    (void)x, (void)ldx, (void)w, (void)ldw, (void)wdt, (void)bias, (void)res, (void)ldr, (void)out, (void)ldo;
    (void)M, (void)N, (void)K, (void)nthreads;
}
#endif

/* The router of a mixture-of-experts layer under the flag: for each token t, the softmax of its E
 * logits and its top k experts. Scalar code in one fixed order per row (max, then the sum of the
 * exponentials from expert 0 to E-1, then one division per kept expert), so a token's weights and
 * ids depend on its own logits only: torch's softmax runs a vector body and a scalar tail whose
 * split moves with the tensor's size, and the two exponentials may differ in the last bit.
 * Ties in the top k go to the lower expert id. renorm: the kept weights divided by their sum
 * (taken in rank order). logits: [T, E] float32 rows at stride ld; weights [T, k] float32; ids
 * [T, k] int64. Needs no AVX2, so it is built on every CPU. */
#include <math.h>

void wb_bi_topk_softmax(const float *logits, int64_t ld, int64_t T, int64_t E, int64_t k, int renorm,
                        float *weights, int64_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * ld;
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        float mx = l[0];
        for (int64_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += expf(l[e] - mx);
        for (int64_t j = 0; j < k; j++) {   /* selection: k is small (2-8) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
            w[j] = expf(l[best] - mx) / sum;
        }
        if (renorm) {
            float kept = 0.0f;
            for (int64_t j = 0; j < k; j++) kept += w[j];
            for (int64_t j = 0; j < k; j++) w[j] /= kept;
        }
    }
}
