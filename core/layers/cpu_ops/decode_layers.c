/* Every decoder layer of a Llama-family model for one decode token (or a few tokens of one request:
 * a speculative verify pass), in one call: float32 arithmetic and residual stream, the projection
 * weights float32 or bfloat16 (gemv.c widens them as it reads; a bfloat16 model streams half the
 * bytes per step; its norm weights and biases are passed as float32 copies).
 *
 * Why: at batch 1 a step's arithmetic is small (a 135M model streams ~540 MB of weights, ~30 ms
 * on one core of the 2-core AVX2 target) but the op-by-op path pays torch's dispatch and
 * Python's call overhead ~15 times per layer: about 10 ms of a 40 ms step went to norms, rope,
 * residual adds, views and the attention call's argument checks (`workbench bench model
 * --profile`, docs/design.md). Here Python calls once per step and C runs, per layer:
 *
 *   h = rms_norm(x, w_in); qkv = W_qkv h (+ b); rotate q and k; store k, v in the pool;
 *   a = attention(q, pool); x = W_o a (+ b) + x;
 *   h = rms_norm(x, w_post); gu = W_gu h (+ b); x = W_down (silu(gate) * up) (+ b) + x
 *
 * each stage the library's own kernel (gemv.c, rope.c, rms_norm.c, paged_attention.c), so the
 * numerics are those of the op-by-op CPU path with the compiled kernels, except RMSNorm: ATen's
 * float32 kernel sums in float, rms_norm.c in double (the scale may differ in its last bit).
 * The greedy-token tests against transformers run through this path at batch 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"

void wb_gemv(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias, const float *res,
             int64_t ldr, float *out, int64_t ldo, int M, int64_t N, int64_t K, int nthreads);
void wb_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int T, int H, float eps, int dt,
                 int nthreads);
void wb_rope_inplace(void *x, int64_t x_stride, const void *cos_t, const void *sin_t, int64_t cs_stride, int T,
                     int H, int D, int dt, int nthreads);
int paged_extend_attention(const void *q, int q_dt, int64_t q_stride, const void *k_buf, const void *v_buf,
                           int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                           const int64_t *req_pool_indices, const int64_t *prefix_lens, const int64_t *extend_lens,
                           const int64_t *extend_starts, int B, int Hq, int Hk, int D, float scale, void *out,
                           int num_threads);
int paged_decode_attention(const void *q, int q_dt, int64_t q_stride, const void *k_new, int64_t k_stride,
                           const void *v_new, int64_t v_stride, const int64_t *out_loc, void *k_buf,
                           void *v_buf, int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                           const int64_t *req_pool_indices, const int64_t *seq_lens, int B, int Hq, int Hk,
                           int D, float scale, void *out, int num_threads);

void wb_gemv_rows(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt, const float *bias,
                  const float *res, int64_t ldr, float *out, int64_t ldo, int M, int64_t n0, int64_t n1, int64_t K,
                  uint16_t *xb);
void wb_gemv_share(int64_t N, int t, int T, int64_t *n0, int64_t *n1);
int64_t wb_gemv_scratch_elems(int64_t K);
size_t paged_decode_head_work_floats(int Hq, int Hk, int D, int64_t len);
int paged_decode_attention_head(const void *q, int q_dt, int64_t q_stride, const void *k_new, int64_t k_stride,
                                const void *v_new, int64_t v_stride, const int64_t *out_loc, void *k_buf,
                                void *v_buf, int kv_dt, const int64_t *req_to_token, int64_t r2t_stride,
                                const int64_t *req_pool_indices, const int64_t *seq_lens, int Hq, int Hk, int D,
                                float scale, void *out, int h, float *work);

/* The pointers of one layer, in this order (a row of the int64 table Python builds once). */
enum { W_IN, W_QKV, B_QKV, W_O, B_O, W_POST, W_GU, B_GU, W_DOWN, B_DOWN, K_BUF, V_BUF, PER_LAYER };

/* silu(g) * u = g * u / (1 + exp(-g)), with exp taken of -|g| only (exp_nonpos) so it cannot
 * overflow and the loop vectorizes: sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static void silu_mul_range(const float *restrict gu, float *restrict out, int64_t I, int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) {
        const float g = gu[i];
        const float e = exp_nonpos(g >= 0.0f ? -g : g);
        const float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        out[i] = g * sig * gu[I + i];
    }
}

/* One decode token (T = 1) on nthreads > 1 threads, every layer inside ONE parallel region.
 *
 * Why: the op-by-op loop below opens a parallel region per GEMV and per attention call, about 6
 * per layer, 180 a step, and norms and rope run on one thread while the others wait for the next
 * fork. Forking a team costs more than a barrier inside a running one, and at batch 1 on two
 * threads the step (11.1 ms here) was far from what its 270 MB of bfloat16 weights take to stream
 * on two cores (7.7-10 ms), while one thread ran at its stream rate. Here the team is forked once
 * and each layer has 5 barriers:
 *
 *   every thread: h = rms_norm(x) (its own copy: 576 floats cost less than a barrier)
 *   its rows of qkv = W_qkv h                                                      | barrier
 *   its KV heads: rotate their q and k heads, store k/v, attend -> att             | barrier
 *   its rows of x = W_o att + x                                                    | barrier
 *   every thread: h = rms_norm(x); its rows r of gate and up, act[r] = silu(gate) * up  | barrier
 *   its rows of x = W_down act + x                                                 | barrier
 *
 * Every element is computed by the same code as in the loop below (same per-row sums, the same
 * attention work item per KV head), so the two give the same bits. Returns 0 or -2 (no memory). */
static int decode_one_token_team(float *x, const int64_t *layers, int L, int w_dt, int H, int Hq, int Hk, int D,
                                 int64_t I, float eps, const float *cos_t, const float *sin_t, int kv_dt,
                                 const int64_t *out_loc, const int64_t *req_to_token, int64_t r2t_stride,
                                 const int64_t *req_pool_index, const int64_t *seq_len, float scale, int nthreads) {
    const int64_t nqkv = (int64_t)(Hq + 2 * Hk) * D, nq = (int64_t)Hq * D, nkv = (int64_t)Hk * D;
    const int G = Hq / Hk;
    float *shared = malloc(sizeof(float) * (nqkv + nq + 3 * I));
    if (shared == NULL) return -2;
    float *qkv = shared, *att = qkv + nqkv, *gu = att + nq, *act = gu + 2 * I;
    const int64_t kmax = H > I ? (H > nq ? H : nq) : (I > nq ? I : nq);
    const size_t xb_bytes = ((size_t)wb_gemv_scratch_elems(kmax) * sizeof(uint16_t) + 63) / 64 * 64;
    const size_t work_bytes = (paged_decode_head_work_floats(Hq, Hk, D, seq_len[0]) * sizeof(float) + 63) / 64 * 64;
    const size_t h_bytes = ((size_t)H * sizeof(float) + 63) / 64 * 64;
    int failed = 0;   /* shared: a thread without scratch sets it before the first barrier */
#pragma omp parallel num_threads(nthreads) shared(failed)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        char *mine = aligned_alloc(64, h_bytes + xb_bytes + work_bytes);
        int ok = mine != NULL;
        /* every thread must reach every barrier, so a thread without scratch stops only after the
         * first one, where all learn of it */
#pragma omp atomic update
        failed |= !ok;
#pragma omp barrier
        int any_failed;
#pragma omp atomic read
        any_failed = failed;
        if (!any_failed) {
            float *h = (float *)mine;
            uint16_t *xb = xb_bytes ? (uint16_t *)(mine + h_bytes) : NULL;
            float *work = (float *)(mine + h_bytes + xb_bytes);
            int64_t q0, q1, o0, o1, i0, i1;
            wb_gemv_share(nqkv, t, T, &q0, &q1);
            wb_gemv_share(H, t, T, &o0, &o1);
            wb_gemv_share(I, t, T, &i0, &i1);
            const int hk0 = (int)((int64_t)Hk * t / T), hk1 = (int)((int64_t)Hk * (t + 1) / T);
            for (int l = 0; l < L; l++) {
                const int64_t *p = layers + (int64_t)l * PER_LAYER;
#define F(i) ((const float *)(intptr_t)p[i])
#define W(i) ((const void *)(intptr_t)p[i])
                void *k_buf = (void *)(intptr_t)p[K_BUF], *v_buf = (void *)(intptr_t)p[V_BUF];
                wb_rms_norm(x, H, F(W_IN), h, 1, H, eps, 0, 1);
                wb_gemv_rows(h, H, W(W_QKV), H, w_dt, F(B_QKV), NULL, 0, qkv, nqkv, 1, q0, q1, H, xb);
#pragma omp barrier
                if (hk1 > hk0) {
                    wb_rope_inplace(qkv + (int64_t)hk0 * G * D, nqkv, cos_t, sin_t, D, 1, (hk1 - hk0) * G, D, 0, 1);
                    wb_rope_inplace(qkv + nq + (int64_t)hk0 * D, nqkv, cos_t, sin_t, D, 1, hk1 - hk0, D, 0, 1);
                }
                for (int hk = hk0; hk < hk1; hk++)
                    paged_decode_attention_head(qkv, 0, nqkv / D, qkv + nq, nqkv / D, qkv + nq + nkv, nqkv / D,
                                                out_loc, k_buf, v_buf, kv_dt, req_to_token, r2t_stride,
                                                req_pool_index, seq_len, Hq, Hk, D, scale, att, hk, work);
#pragma omp barrier
                wb_gemv_rows(att, nq, W(W_O), nq, w_dt, F(B_O), x, H, x, H, 1, o0, o1, nq, xb);
#pragma omp barrier
                wb_rms_norm(x, H, F(W_POST), h, 1, H, eps, 0, 1);
                if (i1 > i0) {
                    const float *b_gu = F(B_GU);
                    wb_gemv_rows(h, H, W(W_GU), H, w_dt, b_gu, NULL, 0, gu, 2 * I, 1, i0, i1, H, xb);
                    wb_gemv_rows(h, H, W(W_GU), H, w_dt, b_gu, NULL, 0, gu, 2 * I, 1, I + i0, I + i1, H, xb);
                    silu_mul_range(gu, act, I, i0, i1);
                }
#pragma omp barrier
                wb_gemv_rows(act, I, W(W_DOWN), I, w_dt, F(B_DOWN), x, H, x, H, 1, o0, o1, I, xb);
#pragma omp barrier
#undef F
#undef W
            }
        }
        free(mine);
    }
    free(shared);
    return failed ? -2 : 0;
}

/* x: [T, H] the residual streams of T consecutive tokens of ONE request (T = 1: a decode step; more:
 * a speculative verify pass or a short prompt piece), updated in place to the last layer's output
 * (before the final norm). layers: L rows of PER_LAYER pointers (0 for no bias); the four projection
 * weights of dtype w_dt (float32 or bfloat16), everything else float32. cos/sin: [T, D]
 * rope rows (signed-sin layout, see rope.c). The pool: kv_dt; out_loc [T] the slots this pass's K/V
 * go to; req_to_token, its row req_pool_index[0] and seq_len[0] (these T tokens included).
 * T = 1 attends with paged_decode_attention (which stores the K/V row itself); T > 1 stores the T
 * K/V rows, then attends causally with paged_extend_attention.
 * Returns 0, or the first failing attention call's code. */
int wb_decode_layers(float *x, int T, const int64_t *layers, int L, int w_dt, int H, int Hq, int Hk, int D, int64_t I,
                     float eps, const float *cos_t, const float *sin_t, int kv_dt, const int64_t *out_loc,
                     const int64_t *req_to_token, int64_t r2t_stride, const int64_t *req_pool_index,
                     const int64_t *seq_len, float scale, int nthreads) {
    if (T == 1 && nthreads > 1 && Hk > 0 && Hq % Hk == 0 && D % 16 == 0 && D <= MAX_D)
        return decode_one_token_team(x, layers, L, w_dt, H, Hq, Hk, D, I, eps, cos_t, sin_t, kv_dt, out_loc,
                                     req_to_token, r2t_stride, req_pool_index, seq_len, scale, nthreads);
    const int64_t nqkv = (int64_t)(Hq + 2 * Hk) * D, nq = (int64_t)Hq * D, nkv = (int64_t)Hk * D;
    float *buf = malloc(sizeof(float) * T * (H + nqkv + nq + 3 * I));
    if (buf == NULL) return -2;
    float *h = buf, *qkv = h + (int64_t)T * H, *att = qkv + T * nqkv, *gu = att + T * nq, *act = gu + T * 2 * I;
    const int64_t prefix = seq_len[0] - T, start = 0, ext = T;
    int rc = 0;
    for (int l = 0; l < L && rc == 0; l++) {
        const int64_t *p = layers + (int64_t)l * PER_LAYER;
#define F(i) ((const float *)(intptr_t)p[i])
#define W(i) ((const void *)(intptr_t)p[i])
        void *k_buf = (void *)(intptr_t)p[K_BUF], *v_buf = (void *)(intptr_t)p[V_BUF];
        wb_rms_norm(x, H, F(W_IN), h, T, H, eps, 0, nthreads);
        wb_gemv(h, H, W(W_QKV), H, w_dt, F(B_QKV), NULL, 0, qkv, nqkv, T, nqkv, H, nthreads);
        wb_rope_inplace(qkv, nqkv, cos_t, sin_t, D, T, Hq + Hk, D, 0, nthreads);
        if (T == 1) {
            rc = paged_decode_attention(qkv, 0, nqkv / D, qkv + nq, nqkv / D, qkv + nq + nkv, nqkv / D, out_loc,
                                        k_buf, v_buf, kv_dt, req_to_token, r2t_stride, req_pool_index, seq_len, 1,
                                        Hq, Hk, D, scale, att, nthreads);
        } else {
            for (int t = 0; t < T; t++)
                for (int hk = 0; hk < Hk; hk++) {
                    const int64_t row = out_loc[t] * Hk + hk;
                    store_row(k_buf, row, kv_dt, D, qkv + t * nqkv + nq + (int64_t)hk * D);
                    store_row(v_buf, row, kv_dt, D, qkv + t * nqkv + nq + nkv + (int64_t)hk * D);
                }
            rc = paged_extend_attention(qkv, 0, nqkv / D, k_buf, v_buf, kv_dt, req_to_token, r2t_stride,
                                        req_pool_index, &prefix, &ext, &start, 1, Hq, Hk, D, scale, att, nthreads);
        }
        wb_gemv(att, nq, W(W_O), nq, w_dt, F(B_O), x, H, x, H, T, H, nq, nthreads);
        wb_rms_norm(x, H, F(W_POST), h, T, H, eps, 0, nthreads);
        wb_gemv(h, H, W(W_GU), H, w_dt, F(B_GU), NULL, 0, gu, 2 * I, T, 2 * I, H, nthreads);
        for (int t = 0; t < T; t++) silu_mul_range(gu + t * 2 * I, act + t * I, I, 0, I);
        wb_gemv(act, I, W(W_DOWN), I, w_dt, F(B_DOWN), x, H, x, H, T, H, I, nthreads);
#undef F
#undef W
    }
    free(buf);
    return rc;
}
