/* Decode attention over a KV prefix that several requests of a batch share (cascade attention).
 *
 * Why: when a batch's requests share a system prompt, the radix cache gives them the same KV
 * slots for it, but per-request decode attention still computes each request's scores over the
 * prefix on its own: a K or V row is used by only G (query heads per KV head) rows of q between
 * loads and bfloat16 -> float32 conversions, and the kernel runs at about a third of the core's
 * FMA rate (measured: 32 requests, 512 shared + 64 own tokens, 9 q / 3 KV heads of 64, bfloat16,
 * ~31 GFLOP/s per core). Here all the group's query rows attend over the shared slots together,
 * as two small matrix products per tile of 64 tokens (scores = Q K^T, out += P V), with the K/V
 * tile converted to float32 once for every row; the requests' own tokens are attended by the
 * per-request kernel and the two partial results are merged by their log-sum-exp
 * (paged_attention.c). FlashInfer does the same on GPUs ("cascade inference").
 *
 * Layout: query rows are the vector lanes (Qt is [D, Rp], the scores [CH, Rp], the accumulator
 * [D, Rp]), so a K or V element is one broadcast reused over 16 * RV rows, the softmax's max and
 * sums are vertical, and neither K nor V needs a transpose. Numerics as in the per-request kernel:
 * q pre-scaled, every product and sum in float32, online softmax across tiles.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { CH = 64 };                    /* prefix tokens per tile */
/* Register blocks: TB tokens (scores) or DB columns (output) by RVMAX vectors of LANES rows each.
 * AVX-512 builds use 16-float vectors (8 x 8 blocks: 69 GFLOP/s on one Zen 4 core, 4 x 4: 58);
 * AVX2 builds 8-float ones, since GCC splits a 16-float vector into two ymm halves badly (the 16-float
 * code built for znver3 ran at 9 GFLOP/s). */
#if defined(WB_AVX2)
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
enum { LANES = 8, RVMAX = 1, TB = 8, DB = 8 };   /* 8 x 1 accumulators + 1 row vector: 10 of 16 ymm */
static inline vf vload(const void *base, int64_t elem, int dt) { return (vf)load8(base, elem, dt); }
static inline vf vexp(vf x) { return (vf)exp8_nonpos((__m256)x); }
#else
typedef v16f vf;
typedef int32_t vi __attribute__((vector_size(64)));
enum { LANES = 16, RVMAX = 3, TB = 8, DB = 8 };  /* 8 x 3 accumulators + 3 row vectors: 27 of 32 zmm */
static inline vf vload(const void *base, int64_t elem, int dt) { return load16(base, elem, dt); }
static inline vf vexp(vf x) { return exp16_nonpos(x); }
#endif
_Static_assert(CH % TB == 0 && 16 % DB == 0 && 16 % LANES == 0 && RVMAX <= 3, "whole register blocks");

static inline vf vmax(vf a, vf b) {
    const vi gt = (vi)(a > b);
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* Floats of scratch one item needs for up to Rp rows (Rp a multiple of 16) of head size D. */
size_t wb_prefix_scratch_floats(int Rp, int D) {
    return (size_t)2 * D * Rp + (size_t)CH * Rp + (size_t)2 * CH * D + (size_t)2 * Rp + 16;
}

/* S[t, r0 : r0 + 16 RV] = sum_d Qt[d, r] * Kf[t, d] for t < n (rounded up to TB). */
static inline __attribute__((always_inline)) void
qk_tile(const float *restrict Qt, const float *restrict Kf, float *restrict S, int Rp, int r0, int D, int n,
        const int RV) {
    for (int t0 = 0; t0 < n; t0 += TB) {
        vf a[TB][RVMAX];
#pragma GCC unroll 8
        for (int tb = 0; tb < TB; tb++)
#pragma GCC unroll 3
            for (int rv = 0; rv < RV; rv++) a[tb][rv] = (vf){0};
        for (int d = 0; d < D; d++) {
            vf qv[RVMAX];
#pragma GCC unroll 3
            for (int rv = 0; rv < RV; rv++) qv[rv] = *(const vf *)(Qt + (int64_t)d * Rp + r0 + LANES * rv);
#pragma GCC unroll 8
            for (int tb = 0; tb < TB; tb++) {
                const float k = Kf[(t0 + tb) * D + d];
#pragma GCC unroll 3
                for (int rv = 0; rv < RV; rv++) a[tb][rv] += qv[rv] * k;
            }
        }
#pragma GCC unroll 8
        for (int tb = 0; tb < TB; tb++)
#pragma GCC unroll 3
            for (int rv = 0; rv < RV; rv++) *(vf *)(S + (int64_t)(t0 + tb) * Rp + r0 + LANES * rv) = a[tb][rv];
    }
}

/* accT[d, r0 : r0 + 16 RV] += sum_{t < n} S[t, r] * Vf[t, d]. */
static inline __attribute__((always_inline)) void
pv_tile(const float *restrict S, const float *restrict Vf, float *restrict accT, int Rp, int r0, int D, int n,
        const int RV) {
    for (int d0 = 0; d0 < D; d0 += DB) {
        vf a[DB][RVMAX];
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
#pragma GCC unroll 3
            for (int rv = 0; rv < RV; rv++) a[db][rv] = *(const vf *)(accT + (int64_t)(d0 + db) * Rp + r0 + LANES * rv);
        for (int t = 0; t < n; t++) {
            vf p[RVMAX];
#pragma GCC unroll 3
            for (int rv = 0; rv < RV; rv++) p[rv] = *(const vf *)(S + (int64_t)t * Rp + r0 + LANES * rv);
#pragma GCC unroll 8
            for (int db = 0; db < DB; db++) {
                const float v = Vf[t * D + d0 + db];
#pragma GCC unroll 3
                for (int rv = 0; rv < RV; rv++) a[db][rv] += p[rv] * v;
            }
        }
#pragma GCC unroll 8
        for (int db = 0; db < DB; db++)
#pragma GCC unroll 3
            for (int rv = 0; rv < RV; rv++) *(vf *)(accT + (int64_t)(d0 + db) * Rp + r0 + LANES * rv) = a[db][rv];
    }
}

/* One work item: `rows` query rows attend over the first P slots of `slots` for KV head h.
 * Row r reads q row qrow[r] (in rows of D elements of q) and writes its normalized partial output
 * (float32) to pre_out row orow[r] and its log-sum-exp to pre_lse[orow[r]]. work: 64-byte aligned,
 * wb_prefix_scratch_floats(round_up(rows, 16), D) floats. D must be a multiple of 16. */
void wb_prefix_attend(const void *q, int q_dt, const int64_t *qrow, const int64_t *orow, int rows, const void *k_buf,
                      const void *v_buf, int kv_dt, int Hk, int h, int D, const int64_t *slots, int64_t P,
                      float scale, float *pre_out, float *pre_lse, float *work) {
    const int Rp = (rows + 15) / 16 * 16;
    float *restrict Qt = work, *restrict accT = Qt + (int64_t)D * Rp, *restrict S = accT + (int64_t)D * Rp;
    float *restrict Kf = S + (int64_t)CH * Rp, *restrict Vf = Kf + CH * D, *restrict m = Vf + CH * D;
    float *restrict s = m + Rp;
    for (int r = 0; r < Rp; r++) {
        for (int d = 0; d < D; d++) Qt[(int64_t)d * Rp + r] = r < rows ? ld(q, qrow[r] * D + d, q_dt) * scale : 0.0f;
        m[r] = -INFINITY;
        s[r] = 0.0f;
    }
    memset(accT, 0, sizeof(float) * D * Rp);
    for (int64_t t0 = 0; t0 < P; t0 += CH) {
        const int n = P - t0 < CH ? (int)(P - t0) : CH, nr = (n + TB - 1) / TB * TB;
        for (int t = 0; t < nr; t++) {
            if (t < n) {
                const int64_t row = (slots[t0 + t] * Hk + h) * D;
                for (int d = 0; d < D; d += LANES) {
                    *(vf *)(Kf + t * D + d) = vload(k_buf, row + d, kv_dt);
                    *(vf *)(Vf + t * D + d) = vload(v_buf, row + d, kv_dt);
                }
            } else {                                        /* the score tile's last block reads these */
                memset(Kf + t * D, 0, sizeof(float) * D);
            }
        }
        for (int r0 = 0; r0 < Rp; r0 += LANES * RVMAX) {
            const int rv = (Rp - r0) / LANES < RVMAX ? (Rp - r0) / LANES : RVMAX;
            if (rv == RVMAX) qk_tile(Qt, Kf, S, Rp, r0, D, n, RVMAX);
            else if (rv == 2) qk_tile(Qt, Kf, S, Rp, r0, D, n, 2);
            else qk_tile(Qt, Kf, S, Rp, r0, D, n, 1);
        }
        for (int r = 0; r < Rp; r += LANES) {               /* online softmax, LANES rows per vector */
            vf mx = *(vf *)(S + r);
            for (int t = 1; t < n; t++) mx = vmax(mx, *(vf *)(S + (int64_t)t * Rp + r));
            const vf mold = *(vf *)(m + r), mnew = vmax(mold, mx);
            const vf alpha = vexp(mold - mnew);   /* 0 on the first tile (mold = -inf) */
            vf sum = (vf){0};
            for (int t = 0; t < n; t++) {
                vf *st = (vf *)(S + (int64_t)t * Rp + r);
                const vf p = vexp(*st - mnew);
                *st = p;
                sum += p;
            }
            *(vf *)(s + r) = *(vf *)(s + r) * alpha + sum;
            *(vf *)(m + r) = mnew;
            for (int d = 0; d < D; d++) *(vf *)(accT + (int64_t)d * Rp + r) *= alpha;
        }
        for (int r0 = 0; r0 < Rp; r0 += LANES * RVMAX) {
            const int rv = (Rp - r0) / LANES < RVMAX ? (Rp - r0) / LANES : RVMAX;
            if (rv == RVMAX) pv_tile(S, Vf, accT, Rp, r0, D, n, RVMAX);
            else if (rv == 2) pv_tile(S, Vf, accT, Rp, r0, D, n, 2);
            else pv_tile(S, Vf, accT, Rp, r0, D, n, 1);
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / s[r];
        float *dst = pre_out + orow[r] * D;
        for (int d = 0; d < D; d++) dst[d] = accT[(int64_t)d * Rp + r] * inv;
        pre_lse[orow[r]] = m[r] + logf(s[r]);
    }
}

/* Groups of a decode batch's requests whose KV slot rows begin with the same slots.
 *
 * A request leads a group with the later, ungrouped requests whose first slot equals its own; of
 * those, the ones sharing at least L slots with the leader join, L chosen to maximize the rows of
 * K/V not re-read (L times the members beyond the leader), at least min_prefix, with at least
 * min_members members in all. Each request keeps one own slot at least (this step's). Writes
 * group_of[b] (-1: none) and skip[b] (the group's L, 0: none); returns the number of groups. */
int wb_decode_prefix_groups(const int64_t *req_to_token, int64_t r2t_stride, const int64_t *req_pool_indices,
                            const int64_t *seq_lens, int B, int64_t min_prefix, int min_members, int32_t *group_of,
                            int64_t *skip) {
    int64_t *lcp = malloc(sizeof(int64_t) * (B > 0 ? B : 1));
    int *cand = malloc(sizeof(int) * (B > 0 ? B : 1));
    if (lcp == NULL || cand == NULL) {
        free(lcp);
        free(cand);
        return 0;
    }
    for (int b = 0; b < B; b++) {
        group_of[b] = -1;
        skip[b] = 0;
    }
    int n_groups = 0;
    for (int lead = 0; lead < B; lead++) {
        if (group_of[lead] >= 0 || seq_lens[lead] - 1 < min_prefix) continue;
        const int64_t *row = req_to_token + req_pool_indices[lead] * r2t_stride;
        int nc = 0;
        for (int b = lead + 1; b < B; b++) {
            if (group_of[b] >= 0) continue;
            const int64_t *other = req_to_token + req_pool_indices[b] * r2t_stride;
            if (other[0] != row[0]) continue;
            const int64_t lim = (seq_lens[b] < seq_lens[lead] ? seq_lens[b] : seq_lens[lead]) - 1;
            int64_t l = 0;
            while (l < lim && other[l] == row[l]) l++;
            if (l < min_prefix) continue;
            /* insertion by descending lcp: candidate lists are short next to the slot compare above */
            int j = nc++;
            while (j > 0 && lcp[j - 1] < l) {
                lcp[j] = lcp[j - 1];
                cand[j] = cand[j - 1];
                j--;
            }
            lcp[j] = l;
            cand[j] = b;
        }
        int best = -1;
        int64_t best_gain = 0;
        for (int k = 0; k < nc; k++) {                      /* the k + 1 longest join: L = lcp[k] */
            const int64_t gain = lcp[k] * (int64_t)(k + 1);
            if (k + 2 >= min_members && gain > best_gain) {
                best_gain = gain;
                best = k;
            }
        }
        if (best < 0) continue;
        group_of[lead] = n_groups;
        skip[lead] = lcp[best];
        for (int k = 0; k <= best; k++) {
            group_of[cand[k]] = n_groups;
            skip[cand[k]] = lcp[best];
        }
        n_groups++;
    }
    free(lcp);
    free(cand);
    return n_groups;
}
