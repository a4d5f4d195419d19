/* RMSNorm for 16-bit models on CPU: out = (x * rsqrt(mean(x^2) + eps)) * w, rounded once.
 *
 * Why: ATen runs RMSNorm on bfloat16 as a composite of about seven ops (upcast, square, sum,
 * divide, rsqrt, two products) and a decode step calls it 61 times; measured in a 32-request
 * decode step on the 2-core target, 65 us a call, 4 ms of a 38 ms step. One pass here.
 *
 * Numerics: the squares are summed in double and rsqrt is rounded once from double, so the
 * scale is correctly rounded; ATen sums in float in its own order, and the two can differ
 * in the scale's last bit, which moves about one output value in 100k by one bfloat16 ulp.
 * Neither is the reference: transformers' own bfloat16 RMSNorm rounds twice and matches
 * neither bit for bit. float32 models keep ATen's kernel, which matches transformers'
 * float32 RMSNorm exactly (the precision the token-for-token tests use).
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

static inline __attribute__((always_inline)) void rms_row(const void *x, int64_t row, const void *w, void *out,
                                                          int64_t orow, int H, float eps, int dt) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < H; i++) {
        const double v = ld(x, row + i, dt);
        ss += v * v;
    }
    const float rstd = (float)(1.0 / sqrt(ss / H + (double)eps));
#pragma omp simd
    for (int i = 0; i < H; i++) st(out, orow + i, dt, ld(x, row + i, dt) * rstd * ld(w, i, dt));
}

/* x: T rows of H elements at x_stride; w: [H]; out: [T, H] contiguous; all of dtype dt. */
void wb_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int T, int H, float eps, int dt,
                 int nthreads) {
#pragma omp parallel for PARALLEL_ROWS(T, H)
    for (int t = 0; t < T; t++) {
#define RMS_ROW(DT) rms_row(x, (int64_t)t * x_stride, w, out, (int64_t)t * H, H, eps, DT)
        FOR_EACH_DTYPE(dt, RMS_ROW)
#undef RMS_ROW
    }
}
