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

/* The pointers of one layer, in this order (a row of the int64 table Python builds once). */
enum { W_IN, W_QKV, B_QKV, W_O, B_O, W_POST, W_GU, B_GU, W_DOWN, B_DOWN, K_BUF, V_BUF, PER_LAYER };

/* silu(g) * u = g * u / (1 + exp(-g)), with exp taken of -|g| only (exp_nonpos) so it cannot
 * overflow and the loop vectorizes: sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below. */
static void silu_mul(const float *restrict gu, float *restrict out, int64_t I) {
#pragma omp simd
    for (int64_t i = 0; i < I; i++) {
        const float g = gu[i];
        const float e = exp_nonpos(g >= 0.0f ? -g : g);
        const float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        out[i] = g * sig * gu[I + i];
    }
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
        for (int t = 0; t < T; t++) silu_mul(gu + t * 2 * I, act + t * I, I);
        wb_gemv(act, I, W(W_DOWN), I, w_dt, F(B_DOWN), x, H, x, H, T, H, I, nthreads);
#undef F
#undef W
    }
    free(buf);
    return rc;
}
