/* Decode attention over the paged (token-slot) KV pool, for CPUs.
 *
 * Why a compiled kernel: the torch-native path gathers every request's K/V into a
 * padded [B, Hk, L_max, D] copy per layer and then runs SDPA over it. With mixed
 * context lengths that copy is mostly padding, and it is made twice per layer per
 * step. Here each (request, KV head) pair walks its own slots through
 * req_to_token and reads every K and V row exactly once, in place: no copy, no
 * padding. Work items are spread over the OpenMP threads torch already runs (the
 * library links the same libgomp, so there is one thread pool).
 *
 * The same call first stores this step's K/V rows into the pool (what set_kv_buffer
 * does with two index_put ops per layer): each work item writes its own request's new
 * row before reading that request's slots, so no other item ever waits on it.
 *
 * Numerics: q is pre-scaled and every sum is in float32 (the scores and the
 * softmax too, also for bfloat16/float16 pools), so it is at least as precise as
 * the torch-native reference it is tested against.
 *
 * Built at first use by cpu_ops/__init__.py: cc -O3 -march=native -fopenmp. attend() has an
 * AVX2 version (WB_HAVE_AVX2, common.h) blocked for 16 registers, written where the 16-float code
 * spilled and read the KV at ~3 GB/s, and used on AVX-512 CPUs too, where it measured 1.8x the
 * 16-float version (Zen 4, 32 requests of 300 tokens, one thread: 0.63 against 1.19 ms per layer);
 * the 16-float version is left for other CPUs (numbers in docs/design.md).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { BLOCK = 16, PREFETCH_AHEAD = 8 };

/* One call's arguments, shared by every work item. */
typedef struct {
    const void *q;                 /* request b's query head hq is row b * q_stride + hq (rows of D) */
    int64_t q_stride;
    int q_dt;                      /* also the dtype of k_new, v_new and out */
    const void *k_new, *v_new;     /* this step's K/V, rows b * k_stride + h; NULL: already stored */
    int64_t k_stride, v_stride;
    const int64_t *out_loc;        /* [B] the slot each request's new K/V goes to */
    void *k_buf, *v_buf;           /* [num_slots, Hk, D]: one layer of the pool */
    int kv_dt;
    const int64_t *req_to_token;   /* [rows, r2t_stride]; request b uses row req_pool_indices[b] */
    int64_t r2t_stride;
    const int64_t *req_pool_indices, *seq_lens;
    int Hq, Hk, G;
    float scale;
    void *out;                     /* [B, Hq, D] contiguous */
    const int64_t *skip;           /* NULL, or [B]: request b attends from its slot skip[b] on, and then */
    float *part, *part_lse;        /* writes float32 rows to part and their log-sum-exp, not to out */
} Call;

/* Scratch one work item needs: queries and accumulators (nq * D floats each), one block of K rows
 * in float32 (BLOCK * nh * D) and the scores (nq * len). */
static size_t work_floats(int nq, int nh, int D, int64_t len) {
    return (size_t)nq * (size_t)D * 2 + (size_t)BLOCK * nh * D + (size_t)nq * (size_t)(len > 0 ? len : 1);
}

#ifdef WB_HAVE_AVX2
/* AVX2 version of attend() below (see common.h's WB_AVX2 for why a second one). Same two passes,
 * blocked for 16 ymm registers instead of AVX-512's 32:
 * - scores: R <= 3 query rows of one KV head against 4 tokens at a time, as 12 running dot-product
 *   vectors (+ 3 query vectors + 1 K vector = 16 registers); K is read from the pool (converted to
 *   float32 in the register) once per 3 rows, and each 4 dot products end in two horizontal adds;
 * - weighted V sum: the same R rows and 32 columns (4 vectors) at a time over every token, so the
 *   12 accumulators stay in registers for the whole sweep instead of being loaded and stored per
 *   token. Each sweep reads its own 128 (f32) or 64 (16-bit) bytes of every V row, so the pool is
 *   still read once. Slots are prefetched ahead in both passes. */
enum { TB = 4, RMAX = 3, PF_TOKENS = 16 };

static inline __attribute__((always_inline)) void
scores_tile(const float *restrict q, const int R, const int D, const void *k_buf, const int kv_dt,
            const int64_t *row, float *restrict out, const int64_t out_stride, const int n) {
    __m256 a[RMAX][TB];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) a[r][t] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 qd[RMAX];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) qd[r] = _mm256_load_ps(q + r * D + d);
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) {
            const __m256 k = load8(k_buf, row[t] + d, kv_dt);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[r][t] = _mm256_fmadd_ps(qd[r], k, a[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));   /* 4 dot products */
        if (n == TB) {
            _mm_storeu_ps(out + r * out_stride, s);
        } else {
            float tmp[TB];
            _mm_storeu_ps(tmp, s);
            for (int t = 0; t < n; t++) out[r * out_stride + t] = tmp[t];
        }
    }
}

/* out rows [R] (8 * C columns from column d0) = sum over tokens of p[r][t] * V[t]. */
static inline __attribute__((always_inline)) void
pv_tile(const float *restrict p, const int64_t len, const int R, const int C, const int D, const int d0,
        const void *v_buf, const int kv_dt, const int64_t *restrict slots, const int Hk, const int h,
        const float *inv, void *out, const int out_dt, const int64_t out_row0) {
    const int eb = kv_dt == DT_F32 ? 4 : 2;
    __m256 a[RMAX][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int cc = 0; cc < C; cc++) a[r][cc] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const int64_t ahead = t + PF_TOKENS < len ? t + PF_TOKENS : len - 1;   /* branch-free prefetch */
        const char *pf = (const char *)v_buf + ((slots[ahead] * Hk + h) * D + d0) * eb;
        __builtin_prefetch(pf, 0, 1);
        if (8 * C * eb > 64) __builtin_prefetch(pf + 64, 0, 1);
        const int64_t row = (slots[t] * Hk + h) * D + d0;
        __m256 pr[RMAX];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) pr[r] = _mm256_broadcast_ss(p + r * len + t);
#pragma GCC unroll 4
        for (int cc = 0; cc < C; cc++) {
            const __m256 v = load8(v_buf, row + 8 * cc, kv_dt);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[r][cc] = _mm256_fmadd_ps(pr[r], v, a[r][cc]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int cc = 0; cc < C; cc++)
            store8(out, (out_row0 + r) * D + d0 + 8 * cc, out_dt, _mm256_mul_ps(a[r][cc], _mm256_set1_ps(inv[r])));
}

static inline __attribute__((always_inline)) void
attend_dt(const Call *c, int b, int h0, int nh, int D, float *restrict work, const int kv_dt) {
    const int G = c->G, Hk = c->Hk, q_dt = c->q_dt;
    const int nv = D / 16, nq = nh * G, eb = kv_dt == DT_F32 ? 4 : 2;
    const int row_elems = nh * D;                           /* elements of one slot this item reads */
    const int64_t skip = c->skip != NULL ? c->skip[b] : 0;
    const int64_t *restrict slots = c->req_to_token + c->req_pool_indices[b] * c->r2t_stride + skip;
    const int64_t len = c->seq_lens[b] - skip;
    const void *k_buf = c->k_buf, *v_buf = c->v_buf;
    void *out = skip ? (void *)c->part : c->out;
    const int out_dt = skip ? DT_F32 : q_dt;
    float *restrict qv = work;                              /* [nq, D], pre-scaled; work is 64-byte aligned */
    float *restrict scores = qv + nq * D;                   /* [nq, len] */
    float inv[nq];

    if (c->k_new != NULL) {
        const int64_t dst = (c->out_loc[b] * Hk + h0) * D;
        for (int hh = 0; hh < nh; hh++)
            for (int j = 0; j < nv; j++) {
                store16(c->k_buf, dst + hh * D + 16 * j, kv_dt,
                        load16(c->k_new, (b * c->k_stride + h0 + hh) * D + 16 * j, q_dt));
                store16(c->v_buf, dst + hh * D + 16 * j, kv_dt,
                        load16(c->v_new, (b * c->v_stride + h0 + hh) * D + 16 * j, q_dt));
            }
    }
    const int64_t q_row0 = b * c->q_stride + (int64_t)h0 * G;
    const __m256 scale = _mm256_set1_ps(c->scale);
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < D; d += 8)
            _mm256_store_ps(qv + i * D + d, _mm256_mul_ps(load8(c->q, (q_row0 + i) * D + d, q_dt), scale));
    /* pass 1: scores, TB tokens at a time (a short last block repeats its last token, unused) */
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        const int n = len - t0 < TB ? (int)(len - t0) : TB;
        int64_t row[TB];
        for (int t = 0; t < TB; t++) {
            row[t] = (slots[t0 + (t < n ? t : n - 1)] * Hk + h0) * D;
            if (t0 + t + PF_TOKENS < len)
                prefetch_bytes(k_buf, (slots[t0 + t + PF_TOKENS] * Hk + h0) * D * eb, row_elems * eb);
        }
        for (int hh = 0; hh < nh; hh++) {
            const int64_t rh[TB] = {row[0] + hh * D, row[1] + hh * D, row[2] + hh * D, row[3] + hh * D};
            for (int g0 = 0; g0 < G; g0 += RMAX) {
                const int i = hh * G + g0;
                const float *q = qv + i * D;
                float *dst = scores + i * len + t0;
                switch (G - g0 < RMAX ? G - g0 : RMAX) {
                case 1: scores_tile(q, 1, D, k_buf, kv_dt, rh, dst, len, n); break;
                case 2: scores_tile(q, 2, D, k_buf, kv_dt, rh, dst, len, n); break;
                default: scores_tile(q, 3, D, k_buf, kv_dt, rh, dst, len, n); break;
                }
            }
        }
    }
    for (int i = 0; i < nq; i++) {                        /* softmax numerators, sums, 8 at a time */
        float *si = scores + i * len, m = -INFINITY, sum = 0.0f;
        const int64_t len8 = len / 8 * 8;
        __m256 mv = _mm256_set1_ps(-INFINITY), sv = _mm256_setzero_ps();
        for (int64_t t = 0; t < len8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(si + t));
        m = hmax8(mv);
        for (int64_t t = len8; t < len; t++) m = si[t] > m ? si[t] : m;
        mv = _mm256_set1_ps(m);
        for (int64_t t = 0; t < len8; t += 8) {
            const __m256 p = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(si + t), mv));
            _mm256_storeu_ps(si + t, p);
            sv = _mm256_add_ps(sv, p);
        }
        sum = hsum8(sv);
        for (int64_t t = len8; t < len; t++) {
            const float p = exp_nonpos(si[t] - m);
            si[t] = p;
            sum += p;
        }
        inv[i] = len > 0 ? 1.0f / sum : 0.0f;              /* nothing to attend to gives 0 */
        if (skip) c->part_lse[(int64_t)b * c->Hq + (int64_t)h0 * G + i] = m + logf(sum);
    }
    /* pass 2: weighted sum of V, R rows x 32 columns per sweep over the tokens */
    for (int hh = 0; hh < nh; hh++)
        for (int g0 = 0; g0 < G; g0 += RMAX) {
            const int i = hh * G + g0, R = G - g0 < RMAX ? G - g0 : RMAX;
            const float *p = scores + i * len;
            const int64_t orow = (int64_t)b * c->Hq + (int64_t)h0 * G + i;
            for (int d0 = 0; d0 < D; d0 += 32) {
                const int h = h0 + hh;
                if (D - d0 >= 32) {
                    switch (R) {
                    case 1: pv_tile(p, len, 1, 4, D, d0, v_buf, kv_dt, slots, Hk, h, inv + i, out, out_dt, orow); break;
                    case 2: pv_tile(p, len, 2, 4, D, d0, v_buf, kv_dt, slots, Hk, h, inv + i, out, out_dt, orow); break;
                    default: pv_tile(p, len, 3, 4, D, d0, v_buf, kv_dt, slots, Hk, h, inv + i, out, out_dt, orow); break;
                    }
                } else {                                   /* D % 32 == 16: the last 16 columns */
                    switch (R) {
                    case 1: pv_tile(p, len, 1, 2, D, d0, v_buf, kv_dt, slots, Hk, h, inv + i, out, out_dt, orow); break;
                    case 2: pv_tile(p, len, 2, 2, D, d0, v_buf, kv_dt, slots, Hk, h, inv + i, out, out_dt, orow); break;
                    default: pv_tile(p, len, 3, 2, D, d0, v_buf, kv_dt, slots, Hk, h, inv + i, out, out_dt, orow); break;
                    }
                }
            }
        }
}
/* attend_dt with the pool's dtype a constant, so the loads in the hot loops convert branch-free. */
static inline __attribute__((always_inline)) void
attend(const Call *c, int b, int h0, int nh, int D, float *restrict work) {
#define ATTEND_DT(dt) attend_dt(c, b, h0, nh, D, work, dt)
    FOR_EACH_DTYPE(c->kv_dt, ATTEND_DT)
#undef ATTEND_DT
}
#else
/* Request b, KV heads [h0, h0 + nh): store the new K/V rows of those heads, then their nh * G
 * query heads attend over the request's slots. Pass 1 reads each slot's K rows for those
 * heads (adjacent in the pool, so one contiguous read per slot) and scores them, BLOCK tokens
 * at a time; the softmax runs over the scores; pass 2 reads the V rows the same way. Slots
 * are prefetched ahead, since a request's slots need not be adjacent in the pool. */
static inline __attribute__((always_inline)) void
attend(const Call *c, int b, int h0, int nh, int D, float *restrict work) {
    const int G = c->G, Hk = c->Hk, kv_dt = c->kv_dt, q_dt = c->q_dt;
    const int nv = D / 16, nq = nh * G, eb = kv_dt == DT_F32 ? 4 : 2;
    const int row_elems = nh * D;                           /* elements of one slot this item reads */
    const int64_t skip = c->skip != NULL ? c->skip[b] : 0;
    const int64_t *restrict slots = c->req_to_token + c->req_pool_indices[b] * c->r2t_stride + skip;
    const int64_t len = c->seq_lens[b] - skip;
    const void *k_buf = c->k_buf, *v_buf = c->v_buf;
    v16f *qv = (v16f *)work, *acc = qv + nq * nv;           /* work is 64-byte aligned */
    v16f *kf = acc + nq * nv;                               /* [BLOCK, nh * nv]: a block of K rows */
    float *scores = (float *)(kf + BLOCK * nh * nv);        /* [nq, len] */
    float mx[nq], inv[nq];

    if (c->k_new != NULL) {
        const int64_t dst = (c->out_loc[b] * Hk + h0) * D;
        for (int hh = 0; hh < nh; hh++)
            for (int j = 0; j < nv; j++) {
                store16(c->k_buf, dst + hh * D + 16 * j, kv_dt,
                        load16(c->k_new, (b * c->k_stride + h0 + hh) * D + 16 * j, q_dt));
                store16(c->v_buf, dst + hh * D + 16 * j, kv_dt,
                        load16(c->v_new, (b * c->v_stride + h0 + hh) * D + 16 * j, q_dt));
            }
    }
    const int64_t q_row0 = b * c->q_stride + (int64_t)h0 * G;
    for (int i = 0; i < nq; i++) {
        for (int j = 0; j < nv; j++) qv[i * nv + j] = load16(c->q, (q_row0 + i) * D + 16 * j, q_dt) * c->scale;
        mx[i] = -INFINITY;
    }
    /* pass 1: scores, BLOCK tokens at a time, so that BLOCK dot products end in one reduce16 */
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? (int)(len - t0) : BLOCK;
        for (int tt = 0; tt < BLOCK; tt++) {
            if (tt < n) {
                if (t0 + tt + BLOCK < len)
                    prefetch_bytes(k_buf, (slots[t0 + tt + BLOCK] * Hk + h0) * D * eb, row_elems * eb);
                const int64_t row = (slots[t0 + tt] * Hk + h0) * D;
                for (int j = 0; j < nh * nv; j++) kf[tt * nh * nv + j] = load16(k_buf, row + 16 * j, kv_dt);
            } else {
                for (int j = 0; j < nh * nv; j++) kf[tt * nh * nv + j] = (v16f){0};
            }
        }
        for (int hh = 0; hh < nh; hh++) {
            for (int g = 0; g < G; g++) {
                const int i = hh * G + g;
                v16f d[BLOCK];
                for (int tt = 0; tt < BLOCK; tt++) {
                    const v16f *k = kf + tt * nh * nv + hh * nv;
                    v16f s = qv[i * nv] * k[0];
                    for (int j = 1; j < nv; j++) s += qv[i * nv + j] * k[j];
                    d[tt] = s;
                }
                v16f sums = reduce16(d);
                float m = mx[i], *dst = scores + i * len + t0;
                for (int tt = 0; tt < n; tt++) {
                    dst[tt] = sums[tt];
                    m = sums[tt] > m ? sums[tt] : m;
                }
                mx[i] = m;
            }
        }
    }
    for (int i = 0; i < nq; i++) {                        /* softmax numerators, sums */
        float *si = scores + i * len, m = mx[i], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            float p = exp_nonpos(si[t] - m);
            si[t] = p;
            sum += p;
        }
        inv[i] = len > 0 ? 1.0f / sum : 0.0f;
    }
    for (int i = 0; i < nq * nv; i++) acc[i] = (v16f){0};
    for (int64_t t = 0; t < len; t++) {                   /* pass 2: weighted sum of V */
        if (t + PREFETCH_AHEAD < len)
            prefetch_bytes(v_buf, (slots[t + PREFETCH_AHEAD] * Hk + h0) * D * eb, row_elems * eb);
        const int64_t row = (slots[t] * Hk + h0) * D;
        for (int hh = 0; hh < nh; hh++) {
            v16f vv[MAX_D / 16];
            for (int j = 0; j < nv; j++) vv[j] = load16(v_buf, row + hh * D + 16 * j, kv_dt);
            for (int g = 0; g < G; g++) {
                const int i = hh * G + g;
                const float p = scores[i * len + t];
                for (int j = 0; j < nv; j++) acc[i * nv + j] += p * vv[j];
            }
        }
    }
    for (int i = 0; i < nq; i++) {                        /* normalize; nothing to attend to gives 0 */
        float row[MAX_D];
        for (int j = 0; j < nv; j++) memcpy(row + 16 * j, &acc[i * nv + j], sizeof(v16f));
        for (int d = 0; d < D; d++) row[d] *= inv[i];
        const int64_t r = (int64_t)b * c->Hq + (int64_t)h0 * G + i;
        if (skip) {
            store_row(c->part, r, DT_F32, D, row);
            c->part_lse[r] = mx[i] - logf(inv[i]);
        } else {
            store_row(c->out, r, q_dt, D, row);
        }
    }
}

#endif

/* Copies of attend() with the head size fixed, so the row loops unroll and K/V rows stay in
 * registers; other sizes take the generic copy. */
static void attend_any(const Call *c, int b, int h0, int nh, int D, float *work) {
    switch (D) {
    case 64: attend(c, b, h0, nh, 64, work); break;
    case 128: attend(c, b, h0, nh, 128, work); break;
    default: attend(c, b, h0, nh, D, work); break;
    }
}

size_t wb_prefix_scratch_floats(int Rp, int D);
void wb_prefix_attend(const void *q, int q_dt, const int64_t *qrow, const int64_t *orow, int rows, const void *k_buf,
                      const void *v_buf, int kv_dt, int Hk, int h, int D, const int64_t *slots, int64_t P,
                      float scale, float *pre_out, float *pre_lse, float *work);

/* Row (b, hq) of out = the shared-prefix part and the own-token part weighted by their softmax mass. */
static void merge_rows(const Call *c, int b, int h0, int nh, int D, const float *pre_out, const float *pre_lse) {
    for (int i = 0; i < nh * c->G; i++) {
        const int64_t r = (int64_t)b * c->Hq + (int64_t)h0 * c->G + i;
        const float lp = pre_lse[r], ls = c->part_lse[r], mx = lp > ls ? lp : ls;
        const float wp = expf(lp - mx), ws = expf(ls - mx), inv = 1.0f / (wp + ws);
        float row[MAX_D];
        for (int d = 0; d < D; d++) row[d] = (pre_out[r * D + d] * wp + c->part[r * D + d] * ws) * inv;
        store_row(c->out, r, c->q_dt, D, row);
    }
}

/* out[b, hq, :] = softmax(scale * q[b, hq] . K[slots_b, hq / G]) @ V[slots_b, hq / G]
 *
 * With k_new/v_new given, this step's K/V rows are first written to the pool at out_loc[b]
 * (which must be the last of request b's seq_lens[b] slots). See Call for the layouts.
 * Work is split by request when there are enough requests to keep every thread busy (each
 * slot's K/V rows are then read whole, once), else by (request, KV head).
 * group_of/skip (NULL: none; see wb_decode_prefix_groups): the requests of group g share their
 * first skip[b] slots; those are attended once for the whole group by wb_prefix_attend (split
 * into items of query rows per KV head) before the per-request items attend over the rest and
 * merge the two parts.
 * Returns 0; -1 for shapes outside what the kernel handles (D a multiple of 16, at most
 * 256; Hq a multiple of Hk); -2 when scratch memory could not be allocated.
 */
int paged_decode_attention_grouped(const void *q, int q_dt, int64_t q_stride, const void *k_new, int64_t k_stride,
                                   const void *v_new, int64_t v_stride, const int64_t *out_loc, void *k_buf,
                                   void *v_buf, int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                                   const int64_t *req_pool_indices, const int64_t *seq_lens, int B, int Hq, int Hk,
                                   int D, float scale, void *out, const int32_t *group_of, const int64_t *skip,
                                   int n_groups, int num_threads) {
    if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || D % 16 != 0 || D > MAX_D) return -1;
    if (group_of == NULL || skip == NULL) n_groups = 0;
    Call call = {q, q_stride, q_dt, k_new, v_new, k_stride, v_stride, out_loc, k_buf, v_buf, kv_dt,
                 req_to_token, r2t_stride, req_pool_indices, seq_lens, Hq, Hk, Hq / Hk, scale, out,
                 NULL, NULL, NULL};
    const int G = call.G, nthreads = num_threads > 0 ? num_threads : 1;
    const int per_head = B < 2 * nthreads && Hk > 1;
    const int nh = per_head ? 1 : Hk;
    const int64_t items = per_head ? (int64_t)B * Hk : B;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    size_t floats = work_floats(nh * G, nh, D, max_len);

    /* Shared-prefix items: (group, KV head, block of the group's query rows). A group's members are
     * listed together (members[first[g] ...]); a block's rows are (member, q head) pairs. */
    int *first = NULL, *members = NULL, *item_g = NULL, *item_r0 = NULL, *item_r1 = NULL, *item_h = NULL;
    float *pre = NULL, *pre_out = NULL, *pre_lse = NULL;
    int n_items = 0;
    if (n_groups > 0) {
        first = calloc(n_groups + 1, sizeof(int));
        members = malloc(sizeof(int) * B);
        const int per_group = Hk * n_groups >= 3 * nthreads ? 1 : (3 * nthreads + Hk * n_groups - 1) / (Hk * n_groups);
        const int cap = n_groups * Hk * per_group;
        item_g = malloc(sizeof(int) * cap * 4);
        pre = malloc(sizeof(float) * (size_t)B * Hq * (2 * D + 2));
        if (first == NULL || members == NULL || item_g == NULL || pre == NULL) {
            free(first), free(members), free(item_g), free(pre);
            return -2;
        }
        item_r0 = item_g + cap, item_r1 = item_r0 + cap, item_h = item_r1 + cap;
        for (int b = 0; b < B; b++)
            if (group_of[b] >= 0) first[group_of[b] + 1]++;
        for (int g = 0; g < n_groups; g++) first[g + 1] += first[g];
        int fill[n_groups];
        memcpy(fill, first, sizeof fill);
        for (int b = 0; b < B; b++)
            if (group_of[b] >= 0) members[fill[group_of[b]]++] = b;
        int max_rows = 16;
        for (int g = 0; g < n_groups; g++) {
            const int rows = (first[g + 1] - first[g]) * G;
            int blocks = per_group < (rows + 15) / 16 ? per_group : (rows + 15) / 16;
            const int step = ((rows + blocks - 1) / blocks + 15) / 16 * 16;   /* rows per block, whole vectors */
            for (int h = 0; h < Hk; h++)
                for (int r0 = 0; r0 < rows; r0 += step) {
                    item_g[n_items] = g, item_h[n_items] = h, item_r0[n_items] = r0;
                    item_r1[n_items++] = r0 + step < rows ? r0 + step : rows;
                }
            max_rows = step > max_rows ? step : max_rows;
        }
        const size_t pf = wb_prefix_scratch_floats(max_rows, D) + (size_t)4 * max_rows;   /* + 2 int64 row tables */
        floats = pf > floats ? pf : floats;
        /* One buffer, [B * Hq] rows each: the shared part's outputs and log-sum-exps, then the own part's. */
        const size_t rows = (size_t)B * Hq;
        pre_out = pre, pre_lse = pre_out + rows * D;
        call.skip = skip, call.part = pre_lse + rows, call.part_lse = call.part + rows * D;
    }
    const size_t bytes = (sizeof(float) * floats + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *work = aligned_alloc(64, bytes);
        if (work == NULL) failed = 1;
        if (n_items > 0) {
#pragma omp for schedule(dynamic, 1)
            for (int w = 0; w < n_items; w++) {
                if (work == NULL) continue;
                const int g = item_g[w], h = item_h[w], r0 = item_r0[w], rows = item_r1[w] - r0;
                const int lead = members[first[g]];
                int64_t *qrow = (int64_t *)(work + wb_prefix_scratch_floats((rows + 15) / 16 * 16, D));
                int64_t *orow = qrow + rows;
                for (int j = 0; j < rows; j++) {
                    const int b = members[first[g] + (r0 + j) / G], hq = h * G + (r0 + j) % G;
                    qrow[j] = (int64_t)b * q_stride + hq;
                    orow[j] = (int64_t)b * Hq + hq;
                }
                wb_prefix_attend(q, q_dt, qrow, orow, rows, k_buf, v_buf, kv_dt, Hk, h, D,
                                 req_to_token + req_pool_indices[lead] * r2t_stride, skip[lead], scale, pre_out,
                                 pre_lse, work);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (work == NULL) continue;
            const int b = (int)(w / (items / B)), h0 = per_head ? (int)(w % Hk) : 0;
            attend_any(&call, b, h0, nh, D, work);
            if (call.skip != NULL && skip[b] > 0) merge_rows(&call, b, h0, nh, D, pre_out, pre_lse);
        }
        free(work);
    }
    free(first), free(members), free(item_g), free(pre);
    return failed ? -2 : 0;
}

/* paged_decode_attention_grouped without shared-prefix groups (the batch-1 decoder's call). */
int paged_decode_attention(const void *q, int q_dt, int64_t q_stride, const void *k_new, int64_t k_stride,
                           const void *v_new, int64_t v_stride, const int64_t *out_loc, void *k_buf,
                           void *v_buf, int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                           const int64_t *req_pool_indices, const int64_t *seq_lens, int B, int Hq, int Hk,
                           int D, float scale, void *out, int num_threads) {
    return paged_decode_attention_grouped(q, q_dt, q_stride, k_new, k_stride, v_new, v_stride, out_loc, k_buf,
                                          v_buf, kv_dt, req_to_token, r2t_stride, req_pool_indices, seq_lens, B,
                                          Hq, Hk, D, scale, out, NULL, NULL, 0, num_threads);
}

/* Scratch (floats) paged_decode_attention_head needs for a request of len tokens. */
size_t paged_decode_head_work_floats(int Hq, int Hk, int D, int64_t len) {
    return Hk > 0 ? work_floats(Hq / Hk, 1, D, len) : 0;
}

/* Request 0's KV head h alone, on the calling thread: stores that head's new K/V row, then attends
 * with its query heads. For a caller inside its own parallel region that splits the heads between
 * its threads (decode_layers.c at batch 1): the same work item paged_decode_attention runs for
 * (request 0, head h), so the result is the same bit for bit. work: paged_decode_head_work_floats
 * floats, 64-byte aligned. Returns 0, or -1 for an unsupported shape. */
int paged_decode_attention_head(const void *q, int q_dt, int64_t q_stride, const void *k_new, int64_t k_stride,
                                const void *v_new, int64_t v_stride, const int64_t *out_loc, void *k_buf,
                                void *v_buf, int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                                const int64_t *req_pool_indices, const int64_t *seq_lens, int Hq, int Hk, int D,
                                float scale, void *out, int h, float *work) {
    if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || D % 16 != 0 || D > MAX_D || h < 0 || h >= Hk) return -1;
    Call call = {q, q_stride, q_dt, k_new, v_new, k_stride, v_stride, out_loc, k_buf, v_buf, kv_dt,
                 req_to_token, r2t_stride, req_pool_indices, seq_lens, Hq, Hk, Hq / Hk, scale, out,
                 NULL, NULL, NULL};
    attend_any(&call, 0, h, 1, D, work);
    return 0;
}
