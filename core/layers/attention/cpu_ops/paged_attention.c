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
 * Numerics: q is pre-scaled and every sum is in float32 (the scores and the
 * softmax too, also for bfloat16/float16 pools), so it is at least as precise as
 * the torch-native reference it is tested against.
 *
 * Built at first use by cpu_ops/__init__.py: cc -O3 -march=native -fopenmp.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);   /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void store_row(void *base, int64_t row, int dt, int D, const float *restrict src) {
    if (dt == DT_F32) {
        memcpy((float *)base + row * D, src, sizeof(float) * (size_t)D);
    } else if (dt == DT_BF16) {
        uint16_t *dst = (uint16_t *)base + row * D;
        for (int i = 0; i < D; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *dst = (_Float16 *)base + row * D;
        for (int i = 0; i < D; i++) dst[i] = (_Float16)src[i];
    }
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
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef _Float16 v16h __attribute__((vector_size(32)));

static inline v16f load16(const void *base, int64_t elem, int dt) {   /* 16 elements from base[elem] */
    v16f f;
    if (dt == DT_F32) {
        memcpy(&f, (const float *)base + elem, sizeof f);
    } else if (dt == DT_BF16) {
        v16u16 h;
        memcpy(&h, (const uint16_t *)base + elem, sizeof h);
        v16u32 w = __builtin_convertvector(h, v16u32) << 16;
        memcpy(&f, &w, sizeof f);
    } else {
        v16h h;
        memcpy(&h, (const _Float16 *)base + elem, sizeof h);
        f = __builtin_convertvector(h, v16f);
    }
    return f;
}

static inline float hsum16(v16f v) {
    v8f s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline void prefetch_bytes(const void *base, int64_t byte_offset, int nbytes) {
    const char *p = (const char *)base + byte_offset;
    for (int off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

enum { MAX_D = 256, PREFETCH_AHEAD = 8 };

/* Scratch one work item needs: queries and accumulators (nq * D floats each) and scores (nq * len). */
static size_t work_floats(int nq, int D, int64_t len) {
    return (size_t)nq * (size_t)D * 2 + (size_t)nq * (size_t)(len > 0 ? len : 1);
}

/* One request, KV heads [h0, h0 + nh): their nh * G query heads attend over the request's
 * `len` slots. Pass 1 reads each slot's K rows for those heads (adjacent in the pool, so
 * one contiguous read per slot) and scores them; the softmax runs over the scores; pass 2
 * reads the V rows the same way. Slots are prefetched a few tokens ahead, since a
 * request's slots need not be adjacent in the pool. */
static inline __attribute__((always_inline)) void
attend(const void *q, int q_dt, int64_t q_row0, const void *k_buf, const void *v_buf, int kv_dt,
       const int64_t *restrict slots, int64_t len, int Hk, int h0, int nh, int G, int D, float scale, void *out,
       int64_t out_row0, float *restrict work) {
    const int nv = D / 16, nq = nh * G, eb = kv_dt == DT_F32 ? 4 : 2;
    const int row_elems = nh * D;                           /* elements of one slot this item reads */
    v16f *qv = (v16f *)work, *acc = qv + nq * nv;           /* work is 64-byte aligned */
    float *scores = (float *)(acc + nq * nv);               /* [nq, len] */
    float mx[nq], inv[nq];

    for (int i = 0; i < nq; i++) {
        for (int j = 0; j < nv; j++) qv[i * nv + j] = load16(q, (q_row0 + i) * D + 16 * j, q_dt) * scale;
        mx[i] = -INFINITY;
    }
    for (int64_t t = 0; t < len; t++) {                   /* pass 1: scores, row maxima */
        if (t + PREFETCH_AHEAD < len)
            prefetch_bytes(k_buf, (slots[t + PREFETCH_AHEAD] * Hk + h0) * D * eb, row_elems * eb);
        const int64_t row = (slots[t] * Hk + h0) * D;
        for (int hh = 0; hh < nh; hh++) {
            v16f kv[MAX_D / 16];
            for (int j = 0; j < nv; j++) kv[j] = load16(k_buf, row + hh * D + 16 * j, kv_dt);
            for (int g = 0; g < G; g++) {
                const int i = hh * G + g;
                v16f s = qv[i * nv] * kv[0];
                for (int j = 1; j < nv; j++) s += qv[i * nv + j] * kv[j];
                float sc = hsum16(s);
                scores[i * len + t] = sc;
                mx[i] = sc > mx[i] ? sc : mx[i];
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
        store_row(out, out_row0 + i, q_dt, D, row);
    }
}

/* Copies of attend() with the head size fixed, so the row loops unroll and K/V rows stay in
 * registers; other sizes take the generic copy. */
#define ATTEND_ARGS q, q_dt, q_row0, k_buf, v_buf, kv_dt, slots, len, Hk, h0, nh, G
static void attend_any(const void *q, int q_dt, int64_t q_row0, const void *k_buf, const void *v_buf,
                       int kv_dt, const int64_t *slots, int64_t len, int Hk, int h0, int nh, int G, int D,
                       float scale, void *out, int64_t out_row0, float *work) {
    switch (D) {
    case 64: attend(ATTEND_ARGS, 64, scale, out, out_row0, work); break;
    case 128: attend(ATTEND_ARGS, 128, scale, out, out_row0, work); break;
    default: attend(ATTEND_ARGS, D, scale, out, out_row0, work); break;
    }
}
#undef ATTEND_ARGS

/* out[b, hq, :] = softmax(scale * q[b, hq] . K[slots_b, hq / G]) @ V[slots_b, hq / G]
 *
 * q:   rows of D elements; request b's head hq is row b * q_batch_stride_rows + hq
 * k_buf, v_buf: [num_slots, Hk, D] (one layer of the pool)
 * req_to_token: [rows, r2t_stride] slot table; request b uses row req_pool_indices[b],
 *               its first seq_lens[b] entries
 * out: [B, Hq, D] contiguous, dtype of q
 * Work is split by request when there are enough requests to keep every thread busy (each
 * slot's K/V rows are then read whole, once), else by (request, KV head).
 * Returns 0; -1 for shapes outside what the kernel handles (D a multiple of 16, at most
 * 256; Hq a multiple of Hk); -2 when scratch memory could not be allocated.
 */
int paged_decode_attention(const void *q, int q_dt, int64_t q_batch_stride_rows, const void *k_buf,
                           const void *v_buf, int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                           const int64_t *req_pool_indices, const int64_t *seq_lens, int B, int Hq, int Hk,
                           int D, float scale, void *out, int num_threads) {
    if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || D % 16 != 0 || D > MAX_D) return -1;
    const int G = Hq / Hk;
    const int per_head = B < 2 * (num_threads > 0 ? num_threads : 1) && Hk > 1;
    const int nh = per_head ? 1 : Hk;
    const int64_t items = per_head ? (int64_t)B * Hk : B;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const size_t bytes = (sizeof(float) * work_floats(nh * G, D, max_len) + 63) / 64 * 64;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *work = aligned_alloc(64, bytes);
        if (work == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (work == NULL) continue;
            const int b = (int)(w / (items / B)), h0 = per_head ? (int)(w % Hk) : 0;
            const int64_t *slots = req_to_token + req_pool_indices[b] * r2t_stride;
            attend_any(q, q_dt, b * q_batch_stride_rows + (int64_t)h0 * G, k_buf, v_buf, kv_dt, slots, seq_lens[b],
                   Hk, h0, nh, G, D, scale, out, (int64_t)b * Hq + (int64_t)h0 * G, work);
        }
        free(work);
    }
    return failed ? -2 : 0;
}
