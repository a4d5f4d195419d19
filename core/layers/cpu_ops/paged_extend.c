/* Extend (prefill) attention over the paged KV pool, for CPUs: causal, with cached prefixes.
 *
 * Why: per request, torch's CPU flash-attention kernel reaches ~30 GFLOP/s on this model's
 * shapes (head_dim 64, 9 query heads over 3 KV heads), so prefill attention took a third of
 * a prefill pass. A request with a cached prefix also needed its whole K/V gathered first.
 *
 * How: this pass's K/V are already in the pool; every key, prefix or new, is read through
 * req_to_token. A work item is one (request, KV head, block of QB new tokens); its QB * G
 * query rows sweep the keys 16 at a time. Each key block is transposed once into KT[D][16],
 * so a query row's 16 scores are D multiply-adds with the query element broadcast (no
 * horizontal sums), and then an online softmax (running max and sum per row) folds the
 * block's V rows into the row's accumulator. Keys past a row's own position are masked.
 * All arithmetic is float32.
 *
 * Two builds of the block loop: 8-float AVX2 intrinsics blocked for 16 registers (WB_HAVE_AVX2,
 * common.h), written for AVX2-only CPUs, where the 16-float code spilled and ran 7x slower than torch
 * SDPA, and used on AVX-512 CPUs too, where it measured 5-25% faster than the 16-float code (Zen 4,
 * 9 q / 3 KV heads of 64: a 544-token prompt 2.5 against 3.2 ms per layer); 16-float vectors for
 * other CPUs (numbers in docs/design.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#ifndef WB_HAVE_AVX2
/* QB new tokens per work item; KB keys per block (one vector lane each, so 16); RG query rows per
 * pass (6: the most whose accumulators stay in AVX-512 registers; measured best of 4, 6, 8). */
enum { QB = 16, KB = 16, RG = 6 };
#else
/* AVX2 (16 ymm registers): KB = 16 keys are two 8-lane vectors, and RG = 6 rows x 2 vectors = 12
 * accumulators, plus 2 loaded operands and a broadcast, fit the 16 registers in both the score pass
 * and the V pass (which walks D two vectors at a time, so its accumulators fit too). */
enum { QB = 16, KB = 16, RG = 6 };
#endif

typedef struct {
    const void *q;                   /* token t's query head hq is row t * q_stride + hq (rows of D) */
    int64_t q_stride;
    int q_dt;                        /* also out's dtype */
    const void *k_buf, *v_buf;       /* [num_slots, Hk, D]: one layer of the pool */
    int kv_dt;
    const int64_t *req_to_token;     /* [rows, r2t_stride] */
    int64_t r2t_stride;
    const int64_t *req_pool_indices, *prefix_lens, *extend_lens, *extend_starts;   /* per request */
    int Hq, Hk, G;
    float scale;
    void *out;                       /* [T, Hq, D] contiguous */
} ExtendCall;

typedef struct { int r, h; int64_t i0, keys; } Item;   /* request, KV head, first new token, keys it reads */

static int by_keys_desc(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->keys, y = ((const Item *)b)->keys;
    return (x < y) - (x > y);
}

#ifdef WB_HAVE_AVX2
/* The same algorithm with 8-float vectors (see common.h's WB_AVX2 for why). Differences from the
 * v16f version, each to stay in the 16 ymm registers or off the shuffle port:
 * - K is transposed in registers, 8x8 blocks (24 shuffles each), straight from the pool, instead of
 *   element by element through a float buffer;
 * - the V pass does not keep a row's whole accumulator (D / 8 vectors) in registers: it walks D two
 *   vectors at a time for RG rows (12 accumulators), loading and storing acc once per key block;
 * - the block's probabilities go through a small buffer and are broadcast from it (a lane of a
 *   register cannot be broadcast on AVX2 without a shuffle). */
/* Every loop over the RG rows is unrolled, so that the per-row vectors are registers, not stack arrays. */
#define UNROLL_RG _Pragma("GCC unroll 8")
static inline __attribute__((always_inline)) void
extend_block_dt(const ExtendCall *c, Item it, int D, float *restrict work, const int kv_dt) {
    const int G = c->G, Hk = c->Hk, h = it.h;
    const int64_t prefix = c->prefix_lens[it.r], ext = c->extend_lens[it.r], t0 = c->extend_starts[it.r];
    const int nt = ext - it.i0 < QB ? (int)(ext - it.i0) : QB;       /* new tokens in this block */
    const int64_t *slots = c->req_to_token + c->req_pool_indices[it.r] * c->r2t_stride;
    const int64_t kend = prefix + it.i0 + nt;                          /* keys [0, kend) are visible to some row */
    float *restrict qv = work;                                         /* [rows, D], pre-scaled */
    float *restrict acc = qv + QB * G * D;                             /* [rows, D] */
    float *restrict kt = acc + QB * G * D;                             /* [D, KB]: K transposed */
    float *restrict vb = kt + D * KB;                                  /* [KB, D]: the block's V rows */
    float *m = vb + KB * D, *l = m + QB * G;                           /* running max and sum per row */
    float pb[RG][KB] __attribute__((aligned(32)));                     /* this pass's probabilities */
    const __m256 scale = _mm256_set1_ps(c->scale);

    for (int ii = 0; ii < nt; ii++)
        for (int g = 0; g < G; g++) {
            const int row = ii * G + g;
            const int64_t src = (t0 + it.i0 + ii) * c->q_stride + (int64_t)h * G + g;
            for (int d = 0; d < D; d += 8) {
                _mm256_store_ps(qv + row * D + d, _mm256_mul_ps(load8(c->q, src * D + d, c->q_dt), scale));
                _mm256_store_ps(acc + row * D + d, _mm256_setzero_ps());
            }
            m[row] = -INFINITY;
            l[row] = 0.0f;
        }
    const __m256 lane_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lane_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    for (int64_t kb = 0; kb < kend; kb += KB) {
        const int nk = kend - kb < KB ? (int)(kend - kb) : KB;
        int64_t rows[KB];
        for (int j = 0; j < KB; j++) rows[j] = j < nk ? (slots[kb + j] * Hk + h) * D : -1;
        for (int half = 0; half < KB / 8; half++)                      /* K: gather + transpose, 8x8 blocks */
            for (int d = 0; d < D; d += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; j++) {
                    const int64_t row = rows[half * 8 + j];
                    r[j] = row >= 0 ? load8(c->k_buf, row + d, kv_dt) : _mm256_setzero_ps();
                }
                transpose8(r);
                for (int j = 0; j < 8; j++) _mm256_store_ps(kt + (d + j) * KB + half * 8, r[j]);
            }
        for (int j = 0; j < nk; j++)                                   /* V rows, as float32 */
            for (int d = 0; d < D; d += 8) _mm256_store_ps(vb + j * D + d, load8(c->v_buf, rows[j] + d, kv_dt));
        /* Rows come token by token, so the rows that see none of this block are a prefix. */
        int first = 0;
        while (first < nt && prefix + it.i0 + first < kb) first++;
        for (int row0 = first * G; row0 < nt * G; row0 += RG) {
            const int nr = nt * G - row0 < RG ? nt * G - row0 : RG;
            const float *qr[RG];
            UNROLL_RG
            for (int i = 0; i < RG; i++) qr[i] = qv + (row0 + (i < nr ? i : 0)) * D;
            __m256 s0[RG], s1[RG];
            UNROLL_RG
            for (int i = 0; i < RG; i++) s0[i] = s1[i] = _mm256_setzero_ps();
            for (int d = 0; d < D; d++) {                              /* scores: RG rows x 16 keys */
                const __m256 k0 = _mm256_load_ps(kt + d * KB), k1 = _mm256_load_ps(kt + d * KB + 8);
                UNROLL_RG
                for (int i = 0; i < RG; i++) {
                    const __m256 qd = _mm256_broadcast_ss(qr[i] + d);
                    s0[i] = _mm256_fmadd_ps(qd, k0, s0[i]);
                    s1[i] = _mm256_fmadd_ps(qd, k1, s1[i]);
                }
            }
            float alpha[RG];
            UNROLL_RG
            for (int i = 0; i < RG; i++) {
                if (i >= nr) {                                         /* unused rows: zeros, no NaN work */
                    _mm256_store_ps(pb[i], _mm256_setzero_ps());
                    _mm256_store_ps(pb[i] + 8, _mm256_setzero_ps());
                    alpha[i] = 0.0f;
                    continue;
                }
                const int row = row0 + i;
                const int64_t pos = prefix + it.i0 + row / G;             /* this row's token sees keys [0, pos] */
                const float visible = (float)(pos - kb + 1 < nk ? pos - kb + 1 : nk);
                const __m256 x0 = _mm256_blendv_ps(neg_inf, s0[i], _mm256_cmp_ps(lane_lo, _mm256_set1_ps(visible), _CMP_LT_OQ));
                const __m256 x1 = _mm256_blendv_ps(neg_inf, s1[i], _mm256_cmp_ps(lane_hi, _mm256_set1_ps(visible), _CMP_LT_OQ));
                const float m_new = fmaxf(m[row], hmax8(_mm256_max_ps(x0, x1)));
                alpha[i] = exp_nonpos(m[row] - m_new);     /* ~1e-38 on the first block (m = -inf): acc, l are 0 */
                const __m256 mv = _mm256_set1_ps(m_new);
                const __m256 p0 = exp8_nonpos(_mm256_sub_ps(x0, mv)), p1 = exp8_nonpos(_mm256_sub_ps(x1, mv));
                _mm256_store_ps(pb[i], p0);
                _mm256_store_ps(pb[i] + 8, p1);
                l[row] = l[row] * alpha[i] + hsum8(_mm256_add_ps(p0, p1));
                m[row] = m_new;
            }
            float *ar[RG];
            UNROLL_RG
            for (int i = 0; i < RG; i++) ar[i] = acc + (row0 + (i < nr ? i : 0)) * D;
            for (int d = 0; d < D; d += 16) {                          /* acc = acc * alpha + P V, 16 columns at a time */
                __m256 a0[RG], a1[RG];
                UNROLL_RG
                for (int i = 0; i < RG; i++) {
                    const __m256 al = _mm256_set1_ps(alpha[i]);
                    a0[i] = _mm256_mul_ps(_mm256_load_ps(ar[i] + d), al);
                    a1[i] = _mm256_mul_ps(_mm256_load_ps(ar[i] + d + 8), al);
                }
                for (int j = 0; j < nk; j++) {
                    const __m256 v0 = _mm256_load_ps(vb + j * D + d), v1 = _mm256_load_ps(vb + j * D + d + 8);
                    UNROLL_RG
                    for (int i = 0; i < RG; i++) {
                        const __m256 p = _mm256_broadcast_ss(&pb[i][j]);
                        a0[i] = _mm256_fmadd_ps(p, v0, a0[i]);
                        a1[i] = _mm256_fmadd_ps(p, v1, a1[i]);
                    }
                }
                UNROLL_RG
                for (int i = 0; i < RG; i++)
                    if (i < nr) {
                        _mm256_store_ps(ar[i] + d, a0[i]);
                        _mm256_store_ps(ar[i] + d + 8, a1[i]);
                    }
            }
        }
    }
    for (int ii = 0; ii < nt; ii++)
        for (int g = 0; g < G; g++) {
            const int row = ii * G + g;
            const __m256 inv = _mm256_set1_ps(1.0f / l[row]);          /* every row sees its own key: l > 0 */
            const int64_t dst = ((t0 + it.i0 + ii) * c->Hq + (int64_t)h * G + g) * D;
            for (int d = 0; d < D; d += 8) store8(c->out, dst + d, c->q_dt, _mm256_mul_ps(_mm256_load_ps(acc + row * D + d), inv));
        }
}
/* extend_block_dt with the pool's dtype a constant, so the K/V loads convert branch-free. */
static inline __attribute__((always_inline)) void
extend_block(const ExtendCall *c, Item it, int D, float *restrict work) {
#define EXTEND_DT(dt) extend_block_dt(c, it, D, work, dt)
    FOR_EACH_DTYPE(c->kv_dt, EXTEND_DT)
#undef EXTEND_DT
}
#else
static inline __attribute__((always_inline)) void
extend_block(const ExtendCall *c, Item it, int D, float *restrict work) {
    const int G = c->G, Hk = c->Hk, nv = D / 16, h = it.h;
    const int64_t prefix = c->prefix_lens[it.r], ext = c->extend_lens[it.r], t0 = c->extend_starts[it.r];
    const int nt = ext - it.i0 < QB ? (int)(ext - it.i0) : QB;       /* new tokens in this block */
    const int64_t *slots = c->req_to_token + c->req_pool_indices[it.r] * c->r2t_stride;
    const int64_t kend = prefix + it.i0 + nt;                          /* keys [0, kend) are visible to some row */
    v16f *qv = (v16f *)work;                                           /* [rows, nv] */
    v16f *acc = qv + QB * G * nv;                                      /* [rows, nv] */
    v16f *kt = acc + QB * G * nv;                                      /* [D] vectors of 16 keys: K transposed */
    v16f *vb = kt + D;                                                 /* [KB, nv]: the block's V rows */
    float *m = (float *)(vb + KB * nv), *l = m + QB * G;               /* running max and sum per row */
    float kf[KB * MAX_D] __attribute__((aligned(64)));

    for (int ii = 0; ii < nt; ii++)
        for (int g = 0; g < G; g++) {
            const int row = ii * G + g;
            const int64_t src = (t0 + it.i0 + ii) * c->q_stride + (int64_t)h * G + g;
            for (int j = 0; j < nv; j++) {
                qv[row * nv + j] = load16(c->q, src * D + 16 * j, c->q_dt) * c->scale;
                acc[row * nv + j] = (v16f){0};
            }
            m[row] = -INFINITY;
            l[row] = 0.0f;
        }
    const v16f lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t kb = 0; kb < kend; kb += KB) {
        const int nk = kend - kb < KB ? (int)(kend - kb) : KB;
        for (int j = 0; j < KB; j++) {                                 /* gather + transpose the block */
            if (j < nk) {
                const int64_t row = (slots[kb + j] * Hk + h) * D;
                for (int v = 0; v < nv; v++) {
                    *(v16f *)(kf + j * D + 16 * v) = load16(c->k_buf, row + 16 * v, c->kv_dt);
                    vb[j * nv + v] = load16(c->v_buf, row + 16 * v, c->kv_dt);
                }
            } else {
                for (int v = 0; v < nv; v++) {
                    *(v16f *)(kf + j * D + 16 * v) = (v16f){0};
                    vb[j * nv + v] = (v16f){0};
                }
            }
        }
        for (int d = 0; d < D; d++)
            for (int j = 0; j < KB; j++) kt[d][j] = kf[j * D + d];
        /* Rows come token by token, so the rows that see none of this block are a prefix. */
        int first = 0;
        while (first < nt && prefix + it.i0 + first < kb) first++;
        for (int row0 = first * G; row0 < nt * G; row0 += RG) {
            const int nr = nt * G - row0 < RG ? nt * G - row0 : RG;
            v16f s[RG], p[RG];
            for (int i = 0; i < RG; i++) s[i] = (v16f){0};
            /* RG rows at once: independent accumulators hide the multiply-add latency, and each
             * column of K^T is loaded once for all of them. */
            for (int d = 0; d < D; d++) {
                const v16f kd = kt[d];
                for (int i = 0; i < RG; i++) s[i] += ((const float *)(qv + (row0 + (i < nr ? i : 0)) * nv))[d] * kd;
            }
            float alpha[RG];
            for (int i = 0; i < nr; i++) {
                const int row = row0 + i;
                const int64_t pos = prefix + it.i0 + row / G;             /* this row's token sees keys [0, pos] */
                const int visible = pos - kb + 1 < nk ? (int)(pos - kb + 1) : nk;
                const v16i keep = lane < (float)visible;
                const v16f si = (v16f)(((v16i)s[i] & keep) | ((v16i)((v16f){0} - INFINITY) & ~keep));
                const float m_new = fmaxf(m[row], hmax16(si));
                alpha[i] = exp_nonpos(m[row] - m_new);     /* ~1e-38 on the first block (m = -inf): acc, l are 0 */
                p[i] = exp16_nonpos(si - m_new);
                l[row] = l[row] * alpha[i] + hsum16(p[i]);
                m[row] = m_new;
            }
            v16f a[RG][MAX_D / 16];
            for (int i = 0; i < RG; i++)
                for (int v = 0; v < nv; v++) a[i][v] = i < nr ? acc[(row0 + i) * nv + v] * alpha[i] : (v16f){0};
            for (int j = 0; j < nk; j++)
                for (int v = 0; v < nv; v++) {
                    const v16f vj = vb[j * nv + v];
                    for (int i = 0; i < RG; i++) a[i][v] += p[i][j] * vj;
                }
            for (int i = 0; i < nr; i++)
                for (int v = 0; v < nv; v++) acc[(row0 + i) * nv + v] = a[i][v];
        }
    }
    for (int ii = 0; ii < nt; ii++)
        for (int g = 0; g < G; g++) {
            const int row = ii * G + g;
            const float inv = 1.0f / l[row];                           /* every row sees its own key: l > 0 */
            const int64_t dst = ((t0 + it.i0 + ii) * c->Hq + (int64_t)h * G + g) * D;
            for (int v = 0; v < nv; v++) store16(c->out, dst + 16 * v, c->q_dt, acc[row * nv + v] * inv);
        }
}

#endif

static void extend_block_any(const ExtendCall *c, Item it, int D, float *work) {
    switch (D) {
    case 64: extend_block(c, it, 64, work); break;
    case 128: extend_block(c, it, 128, work); break;
    default: extend_block(c, it, D, work); break;
    }
}

/* out[t, hq] = causal attention of new token t (position prefix_r + i) over request r's keys
 * [0, prefix_r + i], all read from the pool through req_to_token. Shapes as in
 * paged_decode_attention. Returns 0; -1 for unsupported shapes; -2 when memory ran out. */
int paged_extend_attention(const void *q, int q_dt, int64_t q_stride, const void *k_buf, const void *v_buf,
                           int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                           const int64_t *req_pool_indices, const int64_t *prefix_lens, const int64_t *extend_lens,
                           const int64_t *extend_starts, int B, int Hq, int Hk, int D, float scale, void *out,
                           int num_threads) {
    if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || D % 16 != 0 || D > MAX_D) return -1;
    const ExtendCall call = {q, q_stride, q_dt, k_buf, v_buf, kv_dt, req_to_token, r2t_stride, req_pool_indices,
                             prefix_lens, extend_lens, extend_starts, Hq, Hk, Hq / Hk, scale, out};
    int64_t n_items = 0;
    for (int r = 0; r < B; r++) n_items += (extend_lens[r] + QB - 1) / QB * Hk;
    Item *items = malloc(sizeof(Item) * (size_t)(n_items > 0 ? n_items : 1));
    if (items == NULL) return -2;
    /* Costliest blocks first (the last blocks of the longest contexts), so the dynamic schedule
     * ends with small ones and the threads finish together. */
    int64_t k = 0;
    for (int r = 0; r < B; r++)
        for (int64_t i0 = (extend_lens[r] - 1) / QB * QB; i0 >= 0; i0 -= QB)
            for (int h = 0; h < Hk; h++) items[k++] = (Item){r, h, i0, prefix_lens[r] + i0 + QB};
    qsort(items, (size_t)n_items, sizeof(Item), by_keys_desc);
    const int G = Hq / Hk;
    const size_t bytes = (sizeof(float) * ((size_t)QB * G * D * 2 + (size_t)D * 16 + (size_t)KB * D
                          + 2 * (size_t)QB * G) + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *work = aligned_alloc(64, bytes);
        if (work == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_items; w++)
            if (work != NULL) extend_block_any(&call, items[w], D, work);
        free(work);
    }
    free(items);
    return failed ? -2 : 0;
}
