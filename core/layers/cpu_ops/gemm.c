/* x @ W.T for many rows of x (batched decode, prefill chunks) on a weight packed once into panels,
 * float32 or bfloat16 storage, float32 sums.
 *
 * Why: at 8-512 rows a linear is compute-bound, and reaching the FMA peak takes a register-blocked
 * micro-kernel: MR rows of x by NR output columns of accumulators, each weight vector loaded once
 * per MR rows and each x element broadcast once per NR columns. torch's bfloat16 GEMM on a CPU
 * without bfloat16 arithmetic (AVX2) runs at a fraction of its float32 rate; here a bfloat16 weight
 * is widened to float32 in registers (exact: bfloat16 is float32's top half) and multiplied with the
 * same FMAs, so it computes as fast as float32 and reads half the bytes.
 *
 * Packed layout (wb_gemm_pack): the N output columns in panels of NR (the last zero-padded); panel
 * p holds, for each k in order, the NR weights w[p*NR + j, k]. float32: NR floats per k. bfloat16:
 * NR/2 32-bit words per k, word j = w[p*NR + j + NR/2, k] << 16 | w[p*NR + j, k], so one load gives
 * both halves: a shift left by 16 widens the low columns, masking off the low 16 bits the high ones.
 *
 * Blocking: threads split the panels (contiguous runs, as gemv.c splits its rows). Above SMALL_M
 * rows a thread walks K in blocks of about 256 (the panel's block stays in L1 while every row block
 * of x passes over it), accumulating into out across K blocks, and rows of x in blocks of MC so
 * x's block stays in L2; up to SMALL_M rows (decode) each panel takes its whole K at once.
 * The sums are float32 in a fixed order for a given K blocking: a result does not depend on the
 * number of threads, nor on which rows share a call as long as the calls are on the same side of
 * SMALL_M (not batch-invariant across it: --enable-deterministic-inference has its own kernels).
 *
 * AVX2 + FMA: MR 6 x NR 16 (12 ymm accumulators, 2 weight vectors, 1 broadcast). Built where the
 * CPU has AVX-512F: MR 12 x NR 32 (24 zmm accumulators). Elsewhere: a plain loop (Python does not
 * choose this kernel there; wb_gemm_available() says 0).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define NR 32
#define MR 12
#define GEMM_VEC 2
typedef __m512 vf;
#define VW 16
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf v_bcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline void v_wide(const uint32_t *p, vf *lo, vf *hi) {
    const __m512i v = _mm512_loadu_si512((const void *)p);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NR 16
#define MR 6
#define GEMM_VEC 1
typedef __m256 vf;
#define VW 8
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf v_bcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline void v_wide(const uint32_t *p, vf *lo, vf *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_and_ps(_mm256_castsi256_ps(v), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
}
#else
#define NR 16
#define MR 4
#define GEMM_VEC 0
#endif

enum { KC_TARGET = 256, MC = 144, SMALL_M = 64 };

int wb_gemm_available(void) { return GEMM_VEC; }
int wb_gemm_panel_width(void) { return NR; }

/* Elements (of the weight's dtype) the packed copy of an [N, K] weight takes. */
int64_t wb_gemm_packed_elems(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* w: [N, K] at row stride ldw (elements), float32 (wdt 0) or bfloat16 (wdt 1) -> the panels above. */
void wb_gemm_pack(const void *w, int64_t ldw, int wdt, int64_t N, int64_t K, void *packed) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 20))
    for (int64_t p = 0; p < panels; p++) {
        if (wdt == 0) {
            const float *src = (const float *)w;
            float *dst = (float *)packed + p * K * NR;
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < NR; j++) {
                    const int64_t n = p * NR + j;
                    dst[k * NR + j] = n < N ? src[n * ldw + k] : 0.0f;
                }
        } else {
            const uint16_t *src = (const uint16_t *)w;
            uint32_t *dst = (uint32_t *)packed + p * K * (NR / 2);
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < NR / 2; j++) {
                    const int64_t n = p * NR + j, n2 = n + NR / 2;
                    const uint32_t lo = n < N ? src[n * ldw + k] : 0, hi = n2 < N ? src[n2 * ldw + k] : 0;
                    dst[k * (NR / 2) + j] = hi << 16 | lo;
                }
        }
    }
}

/* One output tile's epilogue, done in scalars: tile[m][j] (+ bias) (+ res) or + out, for the
 * `cols` valid columns of a panel. */
static void tile_store_scalar(const float *tile, int MM, int cols, int first, const float *bias, const float *res,
                              int64_t ldr, float *out, int64_t ldo) {
    for (int m = 0; m < MM; m++)
        for (int j = 0; j < cols; j++) {
            float s = tile[m * NR + j];
            if (first) {
                if (bias) s += bias[j];
                if (res) s += res[m * ldr + j];
            } else {
                s += out[m * ldo + j];
            }
            out[m * ldo + j] = s;
        }
}

#if GEMM_VEC
/* One row's epilogue: a0/a1 are its NR sums; cols == NR stores vectors, else through tile[]. */
static inline __attribute__((always_inline)) void row_out(vf a0, vf a1, int first, const float *bias,
                                                          const float *res, float *o, int cols, float *tile) {
    if (cols != NR) {
        v_store(tile, a0);
        v_store(tile + VW, a1);
        return;
    }
    if (first) {
        if (bias) a0 = v_add(a0, v_load(bias)), a1 = v_add(a1, v_load(bias + VW));
        if (res) a0 = v_add(a0, v_load(res)), a1 = v_add(a1, v_load(res + VW));
    } else {
        a0 = v_add(a0, v_load(o)), a1 = v_add(a1, v_load(o + VW));
    }
    v_store(o, a0);
    v_store(o + VW, a1);
}

/* MM (<= MR) rows of x from x (row stride ldx) times one panel's kc weights (wp, at the block's
 * first k): out[m, 0 .. cols) = sums, plus bias and res on the first K block (first), else plus
 * out itself. MM and WBF are constants at each call; the accumulators are named variables (an
 * array of them made GCC store every one to the stack on each k step). */
static inline __attribute__((always_inline)) void micro(const float *restrict x, int64_t ldx, const void *restrict wp,
                                                        int64_t kc, int first, const float *bias, const float *res,
                                                        int64_t ldr, float *out, int64_t ldo, int cols, int MM,
                                                        int WBF) {
#define DECL(i) vf c##i##a = v_zero(), c##i##b = v_zero();
#define STEP(i)                                                  \
    if (MM > i) {                                                \
        const vf xv = v_bcast(x + i * ldx + k);                  \
        c##i##a = v_fma(w0, xv, c##i##a);                        \
        c##i##b = v_fma(w1, xv, c##i##b);                        \
    }
#define OUT(i) \
    if (MM > i) row_out(c##i##a, c##i##b, first, bias, res ? res + i * ldr : res, out + i * ldo, cols, tile + i * NR);
    DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5)
#if MR == 12
    DECL(6) DECL(7) DECL(8) DECL(9) DECL(10) DECL(11)
#endif
    for (int64_t k = 0; k < kc; k++) {
        vf w0, w1;
        if (WBF) {
            v_wide((const uint32_t *)wp + k * (NR / 2), &w0, &w1);
        } else {
            w0 = v_load((const float *)wp + k * NR);
            w1 = v_load((const float *)wp + k * NR + VW);
        }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
#if MR == 12
        STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
#endif
    }
    float tile[MR * NR];
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
#if MR == 12
    OUT(6) OUT(7) OUT(8) OUT(9) OUT(10) OUT(11)
#endif
#undef DECL
#undef STEP
#undef OUT
    if (cols != NR) tile_store_scalar(tile, MM, cols, first, bias, res, ldr, out, ldo);
}

static void micro_any(const float *x, int64_t ldx, const void *wp, int wdt, int64_t kc, int first, const float *bias,
                      const float *res, int64_t ldr, float *out, int64_t ldo, int cols, int MM) {
#define CASE(MMC)                                                                              \
    case MMC:                                                                                  \
        if (wdt == 1) micro(x, ldx, wp, kc, first, bias, res, ldr, out, ldo, cols, MMC, 1);    \
        else micro(x, ldx, wp, kc, first, bias, res, ldr, out, ldo, cols, MMC, 0);             \
        break;
    switch (MM) {
#if MR == 12
        CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7)
#endif
        CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
    }
#undef CASE
}
#else
static void micro_any(const float *x, int64_t ldx, const void *wp, int wdt, int64_t kc, int first, const float *bias,
                      const float *res, int64_t ldr, float *out, int64_t ldo, int cols, int MM) {
    float tile[MR * NR] = {0};
    for (int m = 0; m < MM; m++)
        for (int64_t k = 0; k < kc; k++)
            for (int j = 0; j < NR; j++) {
                float wv;
                if (wdt == 1) {
                    const uint32_t word = ((const uint32_t *)wp)[k * (NR / 2) + j % (NR / 2)];
                    wv = bf16_to_f32(j < NR / 2 ? (uint16_t)word : (uint16_t)(word >> 16));
                } else {
                    wv = ((const float *)wp)[k * NR + j];
                }
                tile[m * NR + j] += x[m * ldx + k] * wv;
            }
    tile_store_scalar(tile, MM, cols, first, bias, res, ldr, out, ldo);
}
#endif

/* Panels [p0, p1) of the output for all M rows, on the calling thread. */
static void panels(const float *x, int64_t ldx, const void *packed, int wdt, const float *bias, const float *res,
                   int64_t ldr, float *out, int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    /* Decode-sized batches (M <= SMALL_M) take each panel's whole K in one pass: the weight then
     * streams in address order, panel after panel, which the hardware prefetcher follows, and the
     * panel (K x NR, tens of KB) serves the few row blocks from L2. */
    const int64_t kblocks = M <= SMALL_M ? 1 : (K + KC_TARGET - 1) / KC_TARGET;
    const int64_t kc_len = (K + kblocks - 1) / kblocks;
    const size_t esz = wdt == 1 ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t m1 = m0 + MC < M ? m0 + MC : M;
        for (int64_t k0 = 0; k0 < K; k0 += kc_len) {
            const int64_t kc = K - k0 < kc_len ? K - k0 : kc_len;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n = p * NR;
                const int cols = N - n < NR ? (int)(N - n) : NR;
                const char *wp = (const char *)packed + ((size_t)p * K + (size_t)k0) * NR * esz;
                for (int64_t m = m0; m < m1; m += MR) {
                    const int MM = m1 - m < MR ? (int)(m1 - m) : MR;
                    micro_any(x + m * ldx + k0, ldx, wp, wdt, kc, k0 == 0, bias ? bias + n : NULL,
                              res ? res + m * ldr + n : NULL, ldr, out + m * ldo + n, ldo, cols, MM);
                }
            }
        }
    }
}

/* x: [M, K] float32 at row stride ldx; packed: wb_gemm_pack's copy of an [N, K] weight of dtype wdt
 * (ldw unused: gemv's signature, so cpu_ops' wrapper serves both); bias: [N] float32 or NULL; res:
 * [M, N] float32 at row stride ldr or NULL; out: [M, N] float32 at row stride ldo (may be res itself:
 * each element is read before it is written). Threads take contiguous runs of panels. */
void wb_gemm(const float *x, int64_t ldx, const void *packed, int64_t ldw, int wdt, const float *bias,
             const float *res, int64_t ldr, float *out, int64_t ldo, int M, int64_t N, int64_t K, int nthreads) {
    (void)ldw;
    const int64_t np = (N + NR - 1) / NR;
    /* a thread per ~256K multiply-adds at least: below that the fork costs more than it saves */
    int64_t most = ((int64_t)M * N * K) / 262144;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (nt > most) nt = most < 1 ? 1 : (int)most;
    if (nt > np) nt = (int)np;
    if (nt == 1) {
        panels(x, ldx, packed, wdt, bias, res, ldr, out, ldo, M, N, K, 0, np);
        return;
    }
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        const int64_t p0 = np * t / T, p1 = np * (t + 1) / T;
        if (p0 < p1) panels(x, ldx, packed, wdt, bias, res, ldr, out, ldo, M, N, K, p0, p1);
    }
}
