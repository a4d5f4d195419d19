/* The machine's arithmetic peak and memory read bandwidth, measured (core/layers/cpu_ops/peak.py).
 *
 * Compute: register-only loops, one instruction kind each, with enough independent accumulators to
 * cover the instruction's latency on every port that executes it (12 ymm / 24 zmm chains), so the loop
 * runs at the issue rate and touches no memory. Every function is compiled for its own target with
 * __attribute__((target)), so one library holds all the paths and the caller picks by /proc/cpuinfo's
 * flags; a path the compiler cannot emit reports -1.
 *
 *   kind 0: fp32 FMA, AVX2 + FMA (8 lanes)        2 flops per lane
 *   kind 1: fp32 FMA, AVX-512F (16 lanes)         2 flops per lane
 *   kind 2: bf16 dot product, vdpbf16ps (AVX512_BF16, 16 fp32 lanes of two bf16 pairs): 4 flops per lane
 *   kind 3: AMX tdpbf16ps on 16x16 fp32 tiles (16 x 32 bf16 operands): 16 * 16 * 32 * 2 flops per tile op
 *
 * Bandwidth: a streaming read (sums of 32-byte vectors) over a buffer far larger than the caches,
 * mmap'd on 2 MiB boundaries and madvise'd for or against transparent huge pages, touched by the
 * threads that read it so each thread's pages are its own.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__clang__)
#define WB_CAN_BF16 (__clang_major__ >= 9)
#define WB_CAN_AMX (__clang_major__ >= 12)
#elif defined(__GNUC__)
#define WB_CAN_BF16 (__GNUC__ >= 10)
#define WB_CAN_AMX (__GNUC__ >= 11)
#else
#define WB_CAN_BF16 0
#define WB_CAN_AMX 0
#endif

static volatile float wb_peak_sink; /* results land here, so no loop is optimized away */

static double wb_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* c = c * a + b with a < 1 converges to b / (1 - a): no overflow, no denormals, however long it runs */
#define FMA12(op, c, a, b)                                                                         \
    c##0 = op(c##0, a, b); c##1 = op(c##1, a, b); c##2 = op(c##2, a, b); c##3 = op(c##3, a, b);     \
    c##4 = op(c##4, a, b); c##5 = op(c##5, a, b); c##6 = op(c##6, a, b); c##7 = op(c##7, a, b);     \
    c##8 = op(c##8, a, b); c##9 = op(c##9, a, b); c##10 = op(c##10, a, b); c##11 = op(c##11, a, b);

__attribute__((target("avx2,fma"))) static float fp32_avx2(int64_t iters, float seed) {
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f * seed);
    __m256 c0 = _mm256_set1_ps(seed), c1 = _mm256_add_ps(c0, b), c2 = _mm256_add_ps(c1, b);
    __m256 c3 = _mm256_add_ps(c2, b), c4 = _mm256_add_ps(c3, b), c5 = _mm256_add_ps(c4, b);
    __m256 c6 = _mm256_add_ps(c5, b), c7 = _mm256_add_ps(c6, b), c8 = _mm256_add_ps(c7, b);
    __m256 c9 = _mm256_add_ps(c8, b), c10 = _mm256_add_ps(c9, b), c11 = _mm256_add_ps(c10, b);
    for (int64_t i = 0; i < iters; i++) {
        FMA12(_mm256_fmadd_ps, c, a, b)
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                             _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[7];
}

__attribute__((target("avx512f"))) static float fp32_avx512(int64_t iters, float seed) {
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f * seed);
    __m512 c0 = _mm512_set1_ps(seed), c1 = _mm512_add_ps(c0, b), c2 = _mm512_add_ps(c1, b);
    __m512 c3 = _mm512_add_ps(c2, b), c4 = _mm512_add_ps(c3, b), c5 = _mm512_add_ps(c4, b);
    __m512 c6 = _mm512_add_ps(c5, b), c7 = _mm512_add_ps(c6, b), c8 = _mm512_add_ps(c7, b);
    __m512 c9 = _mm512_add_ps(c8, b), c10 = _mm512_add_ps(c9, b), c11 = _mm512_add_ps(c10, b);
    __m512 d0 = _mm512_add_ps(c11, b), d1 = _mm512_add_ps(d0, b), d2 = _mm512_add_ps(d1, b);
    __m512 d3 = _mm512_add_ps(d2, b), d4 = _mm512_add_ps(d3, b), d5 = _mm512_add_ps(d4, b);
    __m512 d6 = _mm512_add_ps(d5, b), d7 = _mm512_add_ps(d6, b), d8 = _mm512_add_ps(d7, b);
    __m512 d9 = _mm512_add_ps(d8, b), d10 = _mm512_add_ps(d9, b), d11 = _mm512_add_ps(d10, b);
    for (int64_t i = 0; i < iters; i++) {
        FMA12(_mm512_fmadd_ps, c, a, b)
        FMA12(_mm512_fmadd_ps, d, a, b)
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(d4, d5), _mm512_add_ps(d6, d7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(d8, d9), _mm512_add_ps(d10, d11)));
    return _mm512_reduce_add_ps(s);
}

#if WB_CAN_BF16
/* acc += x0*y0 + x1*y1 per lane: the sums grow by 2e-4 a step, far from overflow in any run */
#define DP12(c, x, y)                                                                              \
    c##0 = _mm512_dpbf16_ps(c##0, x, y); c##1 = _mm512_dpbf16_ps(c##1, x, y);                      \
    c##2 = _mm512_dpbf16_ps(c##2, x, y); c##3 = _mm512_dpbf16_ps(c##3, x, y);                      \
    c##4 = _mm512_dpbf16_ps(c##4, x, y); c##5 = _mm512_dpbf16_ps(c##5, x, y);                      \
    c##6 = _mm512_dpbf16_ps(c##6, x, y); c##7 = _mm512_dpbf16_ps(c##7, x, y);                      \
    c##8 = _mm512_dpbf16_ps(c##8, x, y); c##9 = _mm512_dpbf16_ps(c##9, x, y);                      \
    c##10 = _mm512_dpbf16_ps(c##10, x, y); c##11 = _mm512_dpbf16_ps(c##11, x, y);

__attribute__((target("avx512f,avx512bf16"))) static float bf16_dp(int64_t iters, float seed) {
    const __m512 v = _mm512_set1_ps(0.01f * seed);
    const __m512bh x = _mm512_cvtne2ps_pbh(v, v), y = _mm512_cvtne2ps_pbh(v, v);
    /* distinct starting sums: equal ones would let the compiler merge the chains into one */
    const __m512 b = _mm512_set1_ps(0.5f);
    __m512 c0 = _mm512_set1_ps(seed), c1 = _mm512_add_ps(c0, b), c2 = _mm512_add_ps(c1, b);
    __m512 c3 = _mm512_add_ps(c2, b), c4 = _mm512_add_ps(c3, b), c5 = _mm512_add_ps(c4, b);
    __m512 c6 = _mm512_add_ps(c5, b), c7 = _mm512_add_ps(c6, b), c8 = _mm512_add_ps(c7, b);
    __m512 c9 = _mm512_add_ps(c8, b), c10 = _mm512_add_ps(c9, b), c11 = _mm512_add_ps(c10, b);
    __m512 d0 = _mm512_add_ps(c11, b), d1 = _mm512_add_ps(d0, b), d2 = _mm512_add_ps(d1, b);
    __m512 d3 = _mm512_add_ps(d2, b), d4 = _mm512_add_ps(d3, b), d5 = _mm512_add_ps(d4, b);
    __m512 d6 = _mm512_add_ps(d5, b), d7 = _mm512_add_ps(d6, b), d8 = _mm512_add_ps(d7, b);
    __m512 d9 = _mm512_add_ps(d8, b), d10 = _mm512_add_ps(d9, b), d11 = _mm512_add_ps(d10, b);
    for (int64_t i = 0; i < iters; i++) {
        DP12(c, x, y)
        DP12(d, x, y)
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(d4, d5), _mm512_add_ps(d6, d7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(d8, d9), _mm512_add_ps(d10, d11)));
    return _mm512_reduce_add_ps(s);
}
#endif

#if WB_CAN_AMX
#define WB_ARCH_REQ_XCOMP_PERM 0x1023
#define WB_XFEATURE_XTILEDATA 18

struct wb_tilecfg {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed));

/* Four 16x16 fp32 accumulator tiles fed by two A and two B tiles of 16 x 32 bf16 (64-byte rows). */
__attribute__((target("amx-tile,amx-bf16"))) static float amx_bf16(int64_t iters, float seed) {
    struct wb_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _Alignas(64) uint16_t ab[16 * 32];
    _Alignas(64) float c[16 * 16];
    for (int i = 0; i < 16 * 32; i++) ab[i] = (uint16_t)(0x3c00 + (i & 7) + (seed > 1.0f)); /* ~0.008 */
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64);
    _tile_loadd(7, ab, 64);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float s = 0.0f;
    _tile_stored(0, c, 64);
    s += c[0];
    _tile_stored(1, c, 64);
    s += c[1];
    _tile_stored(2, c, 64);
    s += c[2];
    _tile_stored(3, c, 64);
    s += c[3];
    _tile_release();
    return s;
}
#endif

/* Flops one thread does per loop iteration of `kind`; 0 for a kind this build cannot run. */
double wb_peak_flops_per_iter(int kind) {
    switch (kind) {
    case 0: return 12.0 * 8 * 2;
    case 1: return 24.0 * 16 * 2;
    case 2: return WB_CAN_BF16 ? 24.0 * 16 * 4 : 0.0;
    case 3: return WB_CAN_AMX ? 4.0 * 16 * 16 * 32 * 2 : 0.0;
    default: return 0.0;
    }
}

/* Linux hands out the AMX tile state only on request, once per process; 1 when granted. */
int wb_peak_amx_permit(void) {
#if WB_CAN_AMX && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, WB_ARCH_REQ_XCOMP_PERM, WB_XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

static float run_kind(int kind, int64_t iters, float seed) {
    switch (kind) {
    case 0: return fp32_avx2(iters, seed);
    case 1: return fp32_avx512(iters, seed);
#if WB_CAN_BF16
    case 2: return bf16_dp(iters, seed);
#endif
#if WB_CAN_AMX
    case 3: return amx_bf16(iters, seed);
#endif
    default: return 0.0f;
    }
}

static double wb_thread_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* `threads` threads each run `iters` iterations of `kind` at once. *wall: from a barrier before to a
 * barrier after; *cpu: the longest CPU time one thread spent in its loop, which a neighbour's load
 * does not stretch (a descheduled thread's clock stops), so rate = work / cpu is the cores' own.
 * 0 on success, -1 for a kind this build lacks. The caller only asks for kinds the CPU's flags
 * allow (an unsupported instruction faults). */
int wb_peak_compute(int kind, int threads, int64_t iters, double *wall, double *cpu) {
    if (wb_peak_flops_per_iter(kind) <= 0.0) return -1;
    double t0 = 0.0, t1 = 0.0, worst = 0.0;
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total) reduction(max : worst)
    {
#pragma omp barrier
#pragma omp master
        t0 = wb_now();
        const double c0 = wb_thread_cpu();
        total += run_kind(kind, iters, 1.0f + 0.001f * (float)omp_get_thread_num());
        const double c = wb_thread_cpu() - c0;
        worst = c > worst ? c : worst;
#pragma omp barrier
#pragma omp master
        t1 = wb_now();
    }
    wb_peak_sink = total;
    *wall = t1 - t0;
    *cpu = worst;
    return 0;
}

static int64_t anon_huge_kb(void) { /* the process's transparent huge pages, kB (-1: unknown) */
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1;
    char line[256];
    long long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lld kB", &kb) == 1) break;
    fclose(f);
    return kb;
}

typedef uint64_t wb_v4u __attribute__((vector_size(32)));

/* One streaming read of `per * threads` bytes of buf, `per` bytes a thread; *wall and *cpu as in
 * wb_peak_compute. */
static void read_pass(const char *buf, int64_t per, int threads, double *wall, double *cpu) {
    double t0 = 0.0, t1 = 0.0, worst = 0.0;
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total) reduction(max : worst)
    {
        const wb_v4u *p = (const wb_v4u *)(buf + per * omp_get_thread_num());
        const int64_t n = per / (int64_t)sizeof(wb_v4u);
        wb_v4u s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
#pragma omp barrier
#pragma omp master
        t0 = wb_now();
        const double c0 = wb_thread_cpu();
        for (int64_t i = 0; i + 4 <= n; i += 4) {
            s0 += p[i];
            s1 += p[i + 1];
            s2 += p[i + 2];
            s3 += p[i + 3];
        }
        const wb_v4u s = s0 + s1 + s2 + s3;
        total += s[0] + s[1] + s[2] + s[3];
        const double c = wb_thread_cpu() - c0;
        worst = c > worst ? c : worst;
#pragma omp barrier
#pragma omp master
        t1 = wb_now();
    }
    wb_peak_sink = (float)total;
    *wall = t1 - t0;
    *cpu = worst;
}

/* Streaming reads of a `bytes` buffer (rounded down to 1 KiB a thread), madvise'd for (huge = 1) or
 * against (0) transparent huge pages and first written by `threads` threads, each its own slice.
 * Then `passes` reads of the whole buffer by one thread and `passes` by `threads` threads; out[0..3]
 * get the fastest pass's seconds: one thread wall, one thread CPU, all threads wall, all threads CPU
 * (the slowest thread's). *huge_kb: how much the process's huge pages grew while the buffer was
 * written (-1: unknown). 0 on success, -1 when the buffer cannot be mapped. */
int wb_peak_read_bw(int64_t bytes, int huge, int threads, int passes, double *out, int64_t *huge_kb) {
    const int64_t align = 2 << 20;
    const int64_t per = (bytes / threads) & ~(int64_t)1023;
    const int64_t used = per * threads;
    if (per <= 0) return -1;
    char *raw = mmap(NULL, (size_t)(used + align), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return -1;
    char *buf = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
#ifdef MADV_HUGEPAGE
    madvise(buf, (size_t)used, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
    const int64_t before = anon_huge_kb();
#pragma omp parallel num_threads(threads)
    memset(buf + per * omp_get_thread_num(), 1 + omp_get_thread_num(), (size_t)per);
    const int64_t after = anon_huge_kb();
    *huge_kb = (before >= 0 && after >= 0) ? after - before : -1;
    for (int i = 0; i < 4; i++) out[i] = 1e30;
    for (int pass = 0; pass < passes; pass++) {
        for (int all = 0; all < 2; all++) {
            double wall, cpu;
            read_pass(buf, all ? per : used, all ? threads : 1, &wall, &cpu);
            if (wall < out[2 * all]) out[2 * all] = wall;
            if (cpu < out[2 * all + 1]) out[2 * all + 1] = cpu;
        }
    }
    munmap(raw, (size_t)(used + align));
    return 0;
}
