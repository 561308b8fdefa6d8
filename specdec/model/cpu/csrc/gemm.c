/* Small-M float32 GEMM for CPU verification forwards: y[M][N] = x[M][K] @ w[N][K]^T (+ bias).
 *
 * Why a kernel of our own: a target forward over 1..16 new positions should cost what streaming
 * the weights once costs, because the arithmetic (M * N * K multiply-adds, M <= 16) is small next
 * to reading N * K floats from memory. MKL's fp32 kernels do not get there on the 2-core machines
 * we measure on: SmolLM2-135M's 211 linear layers took 43 ms for one row and 63 ms for nine (about
 * 12 GB/s), where this kernel takes 19-20 ms for both (about 28 GB/s, memory-bound).
 *
 * Layout: the weight is repacked once into panels of 16 output features, wp[N/16][K][16], so the
 * inner loop reads one contiguous 64-byte vector of weights per k and multiplies it into M
 * accumulators (one per input row) with a broadcast of x[m][k]. Weights stream from memory exactly
 * once per call whatever M is; no horizontal reductions; the accumulators stay in registers.
 *
 * Prefetch: for 2-16 rows the loop asks for the weights 24 cache lines (1.5 KB) ahead, with the
 * non-temporal hint (__builtin_prefetch locality 0): the weights are read once per forward and never
 * again before they are evicted, so they should not push the interpreter's and the KV cache's data
 * out of the caches. Measured on an AMD EPYC (2 cores, 211 SmolLM2 layers, median of 9): 9 rows
 * 25.2-25.9 -> 18.8-19.5 ms; one row is as fast without (the hardware prefetcher keeps up), so
 * one row does not prefetch.
 *
 * Several rows (a batch of several sequences' verifies, a prefill): each panel takes the rows in
 * groups of ROWS_AT_ONCE, so it is read from memory once and from the caches for the other groups.
 * The same 211 layers, stock (MKL) against this kernel (2 cores, AMD EPYC, median of 5): 24 rows
 * 87.5 / 40.2 ms, 32 rows 105.3 / 52.5, 64 rows 138.9-166.2 / 85.6-88.1, 256 rows 419.2 / 321.0,
 * 1024 rows 1576 / 1276: faster than the stock kernel at every row count measured.
 *
 * Numerics: every output y[m][n] is one multiply-add chain over k = 0..K-1 in order, whatever
 * M is and whatever the other rows hold, so a row's result is bit-identical whether it is computed
 * alone (a decode step), among the positions of a verification pass or in a prefill. That is what
 * keeps the target's verify logits equal to its own decode logits.
 *
 * Built at run time with -march=native (specdec/model/cpu/gemm_kernel.py): plain C with GCC vector extensions,
 * which the compiler maps to AVX-512, AVX2 or whatever the CPU has. OpenMP splits the panels over
 * the calling thread's team (the same libgomp that torch uses, so no second thread pool).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 16
#define SG_MAX_ROWS (1 << 20) /* rows per call: far past any forward's positions */
#define AHEAD 24 /* weight vectors (cache lines) prefetched ahead of the multiply */
typedef float vec __attribute__((vector_size(LANES * 4)));                 /* aligned: packed panels */
typedef float vec_u __attribute__((vector_size(LANES * 4), aligned(4)));   /* unaligned: x, y, bias */

/* Whether a call of M rows through a K x N weight opens a parallel region (an OpenMP `if` clause).
 * A small layer is done sooner by the calling thread than a team's fork and join take, and where
 * the cores are shared (a client, a coordinator and a target on two cores) a team thread that waits
 * at the join holds a core another process needed: a tiny model's layers then spent most of their
 * time at the barrier. Weights of 64K values or more, or a call of 1M multiply-adds or more, still
 * split (every layer of a real model, and the head). Each output is computed by the same code
 * whichever thread runs it, so the choice changes no bit. */
static inline int sg_parallel(long M, long K, long N) { return K * N >= (1L << 16) || M * K * N >= (1L << 20); }

/* The CPU's own vector: 16 floats with AVX-512, 8 without. A panel's 16 lanes are NH of them. Without
 * AVX-512 a compiler has no register for a 16-float vector: a kernel written on `vec` kept every
 * accumulator on the stack (a store and a reload per multiply-add, and partial-width copies between
 * them). Written on `vw` the accumulators stay in registers. Each lane's arithmetic is unchanged. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NH (LANES / VW)
typedef float vw __attribute__((vector_size(VW * 4)));
/* Rows through a panel at a time: their accumulators (rows x NH, times the panels side by side) must
 * fit the vector registers with the weight vectors, a broadcast and a product (32 registers with
 * AVX-512, 16 without). */
#define ROWS_AT_ONCE (VW == 16 ? 16 : 5)

/* NP panels (pstride floats apart) for MM input rows; out[p * MM + m] gets panel p's row m. One row
 * leaves one addition chain per lane, which waits on the adder's latency rather than on memory: 1 and 2
 * rows run 4 and 2 panels side by side (separate chains, each output still summed in k order). */
#define PANEL(MM, NP)                                                                                 \
    static void panel_##MM##_##NP(const float *restrict x, int ldx, const float *restrict wp, size_t pstride, \
                                  int K, vec *restrict out) {                                         \
        vw acc[NP][MM][NH];                                                                            \
        for (int p = 0; p < NP; p++)                                                                   \
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++)                                      \
                for (int h = 0; h < NH; h++) acc[p][m][h] = (vw){0};                                   \
        for (int k = 0; k < K; k++) {                                                                  \
            _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) {                                     \
                const float *w = wp + p * pstride + (size_t)k * LANES;                                 \
                if (MM > 1) __builtin_prefetch((const void *)(w + AHEAD * LANES), 0, 0);               \
                _Pragma("GCC unroll 2") for (int h = 0; h < NH; h++) {                                 \
                    vw wh = *(const vw *)(w + h * VW);                                                 \
                    _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) acc[p][m][h] += x[(size_t)m * ldx + k] * wh; \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int p = 0; p < NP; p++)                                                                   \
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++)                                      \
                for (int h = 0; h < NH; h++) __builtin_memcpy((float *)&out[p * MM + m] + h * VW, &acc[p][m][h], sizeof(vw)); \
    }

PANEL(1, 4) PANEL(2, 2)
PANEL(1, 1) PANEL(2, 1) PANEL(3, 1) PANEL(4, 1) PANEL(5, 1) PANEL(6, 1) PANEL(7, 1) PANEL(8, 1)
PANEL(9, 1) PANEL(10, 1) PANEL(11, 1) PANEL(12, 1) PANEL(13, 1) PANEL(14, 1) PANEL(15, 1) PANEL(16, 1)

typedef void (*panel_fn)(const float *, int, const float *, size_t, int, vec *);
static const panel_fn PANELS[LANES + 1] = {
    0, panel_1_1, panel_2_1, panel_3_1, panel_4_1, panel_5_1, panel_6_1, panel_7_1, panel_8_1,
    panel_9_1, panel_10_1, panel_11_1, panel_12_1, panel_13_1, panel_14_1, panel_15_1, panel_16_1};

int sg_max_rows(void) { return SG_MAX_ROWS; }

/* w[N][K] (row-major, as nn.Linear stores it) -> wp[ceil(N/16)][K][16], the last panel zero-padded. */
void sg_pack(const float *w, int N, int K, float *wp) {
    int panels = (N + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < LANES; j++) {
                int n = p * LANES + j;
                wp[((size_t)p * K + k) * LANES + j] = n < N ? w[(size_t)n * K + k] : 0.0f;
            }
}

/* Output features of panel p that exist (16, or fewer in the last panel). */
static int width_of(int p, int N) { return N - p * LANES < LANES ? N - p * LANES : LANES; }

static void store_rows(const vec *out, int rows, int width, const float *bias, int p, int N, float *y) {
    for (int m = 0; m < rows; m++) {
        float *dst = y + (size_t)m * N + (size_t)p * LANES;
        if (width == LANES) {
            vec r = out[m];
            if (bias) r += *(const vec_u *)(bias + (size_t)p * LANES);
            *(vec_u *)dst = r;
        } else {
            for (int j = 0; j < width; j++) dst[j] = out[m][j] + (bias ? bias[p * LANES + j] : 0.0f);
        }
    }
}

/* y[M][N] = x[M][K] @ w^T + bias, for 1 <= M <= SG_MAX_ROWS; x and y row-major and contiguous; bias
 * may be NULL. Rows go through each panel ROWS_AT_ONCE at a time, so a panel (K * 64 bytes: 36 KB for
 * K = 576) is read from memory once and from the core's caches for the other groups.
 * Returns 0, or -1 (and writes nothing) for a row count or size outside the kernel's range. */
int sg_linear(const float *x, int M, int K, const float *wp, int N, const float *bias, float *y) {
    if (M < 1 || M > SG_MAX_ROWS || K < 0 || N < 0) return -1;
    int panels = (N + LANES - 1) / LANES;
    int np = M == 1 ? 4 : M == 2 ? 2 : 1, groups = (panels + np - 1) / np;
    size_t pstride = (size_t)K * LANES;
#pragma omp parallel for schedule(static) if (sg_parallel(M, K, N))
    for (int q = 0; q < groups; q++) {
        int p0 = q * np, pn = panels - p0 < np ? panels - p0 : np;
        for (int g = 0; g < M; g += ROWS_AT_ONCE) {
            int rows = M - g < ROWS_AT_ONCE ? M - g : ROWS_AT_ONCE;
            const float *xg = x + (size_t)g * K;
            vec out[LANES];
            if (pn == 4 && rows == 1) panel_1_4(xg, K, wp + p0 * pstride, pstride, K, out);
            else if (pn == 2 && rows == 2) panel_2_2(xg, K, wp + p0 * pstride, pstride, K, out);
            else
                for (int i = 0; i < pn; i++) PANELS[rows](xg, K, wp + (p0 + i) * pstride, 0, K, out + i * rows);
            for (int i = 0; i < pn; i++)
                store_rows(out + i * rows, rows, width_of(p0 + i, N), bias, p0 + i, N, y + (size_t)g * N);
        }
    }
    return 0;
}

/* ---- Compact weights: bf16, f16, int8 blocks and 4-bit blocks, expanded inside the kernel ----------
 *
 * Why: a decode step reads every weight once, so its time is the weights' bytes over the memory's
 * bandwidth. Held as fp32 that is 4 bytes a weight; as bf16/f16 2, as int8 blocks 1.125 and as 4-bit
 * blocks 0.75 (a scale and a minimum per 32 weights). The kernel reads the compact panel and expands
 * each vector of 16 weights in registers, so only the compact bytes cross the memory bus.
 *
 * Formats (the layout stays the panel one: 16 output features side by side for each k):
 *   SG_BF16  wp uint16 [P][K][16]    w = bits << 16
 *   SG_F16   wp _Float16 [P][K][16]  w = (float) h
 *   SG_Q8    wp int8 [P][K][16], scale [P][KB][16]                 w = q * d   (GGUF Q8_0, or int8 per 32)
 *   SG_Q4    wp uint8 [P][ceil(K/2)][16], scale, min [P][KB][16]   w = q * d + m, q in 0..15, the byte of
 *            pair j holding k = 2j in its low nibble and k = 2j + 1 in its high one  (GGUF Q4_1 and Q4_0)
 * where KB = ceil(K / 32): one scale (and minimum) per output feature and block of 32 along k.
 *
 * Numerics: as in the fp32 kernel, each output is one multiply-add chain in k order, whatever M is;
 * the weight a row sees is the same expression of the same bytes in every path. Up to 16 rows the
 * weights are expanded in registers; past 16 rows each panel is expanded once into a buffer in the
 * core's cache and the rows run through it ROWS_AT_ONCE at a time (the expansion is then paid once per panel,
 * not once per 16 rows, so a prefill costs what the fp32 kernel's does). These functions contract
 * a * b + c into fused multiply-adds (the fp32 kernel above does not, to keep its results as they
 * were): both paths are compiled alike, so a row's result is bit-identical alone or in a batch.
 *
 * One output row at a time leaves a single addition chain per panel, which waits on the adder's
 * latency rather than on memory; 1 and 2 rows therefore run 4 and 2 panels side by side (separate
 * chains, each output still summed in k order).
 */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

enum { SG_F32 = 0, SG_BF16 = 1, SG_F16 = 2, SG_Q8 = 3, SG_Q4 = 4 };
#define QK 32 /* weights per scale block along k */

typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* The integer vectors one `vw` of weights widens from. */
typedef uint16_t u16v __attribute__((vector_size(VW * 2)));
typedef _Float16 f16v __attribute__((vector_size(VW * 2)));
typedef int8_t i8v __attribute__((vector_size(VW)));
typedef uint8_t u8v __attribute__((vector_size(VW)));
typedef int32_t i32v __attribute__((vector_size(VW * 4)));
typedef uint32_t u32v __attribute__((vector_size(VW * 4)));

/* VW bytes -> VW int32. GCC's __builtin_convertvector does this one byte at a time (GCC 12), so
 * the CPU's widening loads are named where the compiler has them. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline i32v widen_i8(const char *p) { return (i32v)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline i32v widen_u8(const char *p) { return (i32v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline i32v widen_i8(const char *p) { return (i32v)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline i32v widen_u8(const char *p) { return (i32v)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline i32v widen_i8(const char *p) { return __builtin_convertvector(*(const i8v *)p, i32v); }
static inline i32v widen_u8(const char *p) { return __builtin_convertvector(*(const u8v *)p, i32v); }
#endif

/* Bytes of one k step of one panel (Q4: of one pair of k steps). */
static size_t step_bytes(int fmt) {
    return fmt == SG_F32 ? 64 : fmt == SG_BF16 || fmt == SG_F16 ? 32 : 16;
}

/* Bytes of one panel's weights. */
static size_t panel_bytes(int fmt, int K) {
    return step_bytes(fmt) * (size_t)(fmt == SG_Q4 ? (K + 1) / 2 : K);
}

/* Part h (lanes h * VW ..) of the 16 weights of step k of a panel, as floats (for SG_Q4: of the pair
 * holding k, low nibble when k is even); d and m are that part's scales and minimums. */
static inline vw expand(int fmt, const char *restrict w, int k, int h, vw d, vw m) {
    switch (fmt) {
    case SG_BF16: return (vw)(__builtin_convertvector(*(const u16v *)(w + (size_t)k * 32 + h * VW * 2), u32v) << 16);
    case SG_F16: return __builtin_convertvector(*(const f16v *)(w + (size_t)k * 32 + h * VW * 2), vw);
    case SG_Q8: return __builtin_convertvector(widen_i8(w + (size_t)k * 16 + h * VW), vw) * d;
    case SG_Q4: {
        i32v v = widen_u8(w + (size_t)(k >> 1) * 16 + h * VW);
        v = (k & 1) ? v >> 4 : v & 15;
        return __builtin_convertvector(v, vw) * d + m;
    }
    default: return *(const vw *)(w + (size_t)k * 64 + h * VW * 4);
    }
}

/* NP panels (pstride bytes apart, scales sstride floats apart) for MM rows, weights expanded in registers. */
#define CPANEL(FMT, MM, NP)                                                                                      \
    static void cpanel_##FMT##_##MM##_##NP(const float *restrict x, int ldx, const char *restrict wp, size_t pstride, \
                                           const float *restrict sc, const float *restrict mn, size_t sstride, int K,   \
                                           vec *restrict out) {                                                       \
        vw acc[NP][MM][NH];                                                                                           \
        for (int p = 0; p < NP; p++)                                                                                   \
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) for (int h = 0; h < NH; h++) acc[p][m][h] = (vw){0}; \
        for (int k0 = 0; k0 < K; k0 += QK) {                                                                           \
            int k1 = K - k0 < QK ? K : k0 + QK;                                                                        \
            vw d[NP][NH], mi[NP][NH];                                                                                  \
            for (int p = 0; p < NP; p++)                                                                               \
                for (int h = 0; h < NH; h++) {                                                                         \
                    size_t at = p * sstride + (size_t)(k0 / QK) * LANES + h * VW;                                      \
                    d[p][h] = FMT == SG_Q8 || FMT == SG_Q4 ? *(const vw *)(sc + at) : (vw){0};                         \
                    mi[p][h] = FMT == SG_Q4 ? *(const vw *)(mn + at) : (vw){0};                                       \
                }                                                                                                      \
            /* SG_Q4 steps over whole pairs; an odd K's last k (the low nibble of its pair) is taken below */          \
            int kend = FMT == SG_Q4 ? k1 - ((k1 - k0) & 1) : k1;                                                        \
            for (int k = k0; k < kend; k += FMT == SG_Q4 ? 2 : 1) {                                                   \
                if (MM > 1) __builtin_prefetch(wp + (size_t)k * step_bytes(FMT) / (FMT == SG_Q4 ? 2 : 1) + AHEAD * 64, 0, 0); \
                _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++) _Pragma("GCC unroll 2") for (int h = 0; h < NH; h++) { \
                    if (FMT == SG_Q4) { /* one load and widening for the pair k, k + 1 */                              \
                        i32v v = widen_u8(wp + p * pstride + (size_t)(k >> 1) * 16 + h * VW); \
                        vw w = __builtin_convertvector(v & 15, vw) * d[p][h] + mi[p][h];                               \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) acc[p][m][h] += x[(size_t)m * ldx + k] * w; \
                        w = __builtin_convertvector(v >> 4, vw) * d[p][h] + mi[p][h];                                  \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) acc[p][m][h] += x[(size_t)m * ldx + k + 1] * w; \
                    } else {                                                                                           \
                        vw w = expand(FMT, wp + p * pstride, k, h, d[p][h], mi[p][h]);                                 \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) acc[p][m][h] += x[(size_t)m * ldx + k] * w; \
                    }                                                                                                  \
                }                                                                                                      \
            }                                                                                                          \
            if (kend < k1)                                                                                             \
                for (int p = 0; p < NP; p++)                                                                           \
                    for (int h = 0; h < NH; h++) {                                                                     \
                        vw w = expand(FMT, wp + p * pstride, kend, h, d[p][h], mi[p][h]);                              \
                        _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) acc[p][m][h] += x[(size_t)m * ldx + kend] * w; \
                    }                                                                                                  \
        }                                                                                                              \
        for (int p = 0; p < NP; p++)                                                                                   \
            _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) for (int h = 0; h < NH; h++)                          \
                __builtin_memcpy((float *)&out[p * MM + m] + h * VW, &acc[p][m][h], sizeof(vw));                       \
    }

#define CPANELS(FMT)                                                                                              \
    CPANEL(FMT, 1, 4) CPANEL(FMT, 2, 2) CPANEL(FMT, 1, 1) CPANEL(FMT, 2, 1) CPANEL(FMT, 3, 1) CPANEL(FMT, 4, 1)     \
    CPANEL(FMT, 5, 1) CPANEL(FMT, 6, 1) CPANEL(FMT, 7, 1) CPANEL(FMT, 8, 1) CPANEL(FMT, 9, 1) CPANEL(FMT, 10, 1)   \
    CPANEL(FMT, 11, 1) CPANEL(FMT, 12, 1) CPANEL(FMT, 13, 1) CPANEL(FMT, 14, 1) CPANEL(FMT, 15, 1) CPANEL(FMT, 16, 1)

/* The macro pastes the format's number into the names: spell the formats as literals. */
CPANELS(0) CPANELS(1) CPANELS(2) CPANELS(3) CPANELS(4)

typedef void (*cpanel_fn)(const float *, int, const char *, size_t, const float *, const float *, size_t, int, vec *);
#define CTABLE(FMT)                                                                                               \
    {0, cpanel_##FMT##_1_1, cpanel_##FMT##_2_1, cpanel_##FMT##_3_1, cpanel_##FMT##_4_1, cpanel_##FMT##_5_1,            \
     cpanel_##FMT##_6_1, cpanel_##FMT##_7_1, cpanel_##FMT##_8_1, cpanel_##FMT##_9_1, cpanel_##FMT##_10_1,              \
     cpanel_##FMT##_11_1, cpanel_##FMT##_12_1, cpanel_##FMT##_13_1, cpanel_##FMT##_14_1, cpanel_##FMT##_15_1,          \
     cpanel_##FMT##_16_1}
static const cpanel_fn CPANELS1[5][LANES + 1] = {CTABLE(0), CTABLE(1), CTABLE(2), CTABLE(3), CTABLE(4)};
static const cpanel_fn CPANELS_1x4[5] = {cpanel_0_1_4, cpanel_1_1_4, cpanel_2_1_4, cpanel_3_1_4, cpanel_4_1_4};
static const cpanel_fn CPANELS_2x2[5] = {cpanel_0_2_2, cpanel_1_2_2, cpanel_2_2_2, cpanel_3_2_2, cpanel_4_2_2};

/* Expands one panel into buf[K][16] floats: the same expression per weight as the register path. */
static void expand_panel(int fmt, const char *wp, const float *sc, const float *mn, int K, float *buf) {
    for (int k0 = 0; k0 < K; k0 += QK) {
        int k1 = K - k0 < QK ? K : k0 + QK;
        for (int h = 0; h < NH; h++) {
            size_t at = (size_t)(k0 / QK) * LANES + h * VW;
            vw d = fmt == SG_Q8 || fmt == SG_Q4 ? *(const vw *)(sc + at) : (vw){0};
            vw mi = fmt == SG_Q4 ? *(const vw *)(mn + at) : (vw){0};
            for (int k = k0; k < k1; k++) *(vw *)(buf + (size_t)k * LANES + h * VW) = expand(fmt, wp, k, h, d, mi);
        }
    }
}

/* Where a call's panels go: one output, or several (q, k and v, or gate and up, computed in one pass
 * over their concatenated panels; every part but the last a whole number of panels). Each output
 * feature's result is the same whichever call computes it. */
#define SG_MAX_PARTS 4
typedef struct {
    int parts;
    int first[SG_MAX_PARTS + 1]; /* first panel of each part; first[parts] = panels */
    int N[SG_MAX_PARTS];
    float *y[SG_MAX_PARTS];
    const float *bias[SG_MAX_PARTS];
} outputs;

/* rows results of panel p (of the concatenation), for rows row0.. of the call. */
static void put(const outputs *o, const vec *out, int rows, int p, int row0) {
    int i = 0;
    while (p >= o->first[i + 1]) i++;
    int q = p - o->first[i];
    store_rows(out, rows, width_of(q, o->N[i]), o->bias[i], q, o->N[i], o->y[i] + (size_t)row0 * o->N[i]);
}

static int linear_a8(int fmt, const float *x, int M, int K, const char *wp, const float *sc, const float *mn,
                     const outputs *o);

/* The panels of a call, in format fmt (layouts above; wp, sc, mn 64-byte aligned; sc, mn unused, may be
 * NULL, for formats without them), into the outputs o. Returns 0, or -1 (writing nothing) for a
 * format, row count or size outside the kernel's range. */
static int linear_parts(int fmt, const float *x, int M, int K, const char *wp, const float *sc, const float *mn,
                        const outputs *o) {
    if (fmt > SG_Q4) return linear_a8(fmt, x, M, K, wp, sc, mn, o);
    int panels = o->first[o->parts];
    size_t pstride = panel_bytes(fmt, K), sstride = (size_t)((K + QK - 1) / QK) * LANES;
    int first = 0; /* panels from here on are computed one at a time */
    int team = sg_parallel(M, K, (long)panels * LANES);
    if (M <= 2) {  /* np whole panels side by side; the remaining (panels % np) go one at a time below */
        int np = M == 1 ? 4 : 2, groups = panels / np;
#pragma omp parallel for schedule(static) if (team)
        for (int g = 0; g < groups; g++) {
            int p0 = g * np;
            vec out[4];
            (M == 1 ? CPANELS_1x4 : CPANELS_2x2)[fmt](x, K, wp + p0 * pstride, pstride, sc ? sc + p0 * sstride : 0,
                                                       mn ? mn + p0 * sstride : 0, sstride, K, out);
            for (int q = 0; q < np; q++)
                for (int m = 0; m < M; m++) put(o, &out[q * M + m], 1, p0 + q, m);
        }
        first = groups * np;
    }
    if (M <= LANES) {
        if (first < panels) {
#pragma omp parallel for schedule(static) if (team)
            for (int p = first; p < panels; p++)
                for (int g = 0; g < M; g += ROWS_AT_ONCE) {
                    int rows = M - g < ROWS_AT_ONCE ? M - g : ROWS_AT_ONCE;
                    vec out[LANES];
                    CPANELS1[fmt][rows](x + (size_t)g * K, K, wp + p * pstride, pstride, sc ? sc + p * sstride : 0,
                                        mn ? mn + p * sstride : 0, sstride, K, out);
                    put(o, out, rows, p, g);
                }
        }
        return 0;
    }
    int failed = 0;
#pragma omp parallel if (team)
    {
        /* One expanded panel per thread, reused for every panel the thread takes. */
        float *buf = fmt == SG_F32 ? 0 : aligned_alloc(64, ((size_t)K * LANES * 4 + 63) / 64 * 64 + 64);
        if (fmt != SG_F32 && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            if (fmt != SG_F32 && !buf) continue;
            const char *panel = wp + p * pstride;
            if (fmt != SG_F32) {
                expand_panel(fmt, panel, sc ? sc + p * sstride : 0, mn ? mn + p * sstride : 0, K, buf);
                panel = (const char *)buf;
            }
            for (int g = 0; g < M; g += ROWS_AT_ONCE) {
                int rows = M - g < ROWS_AT_ONCE ? M - g : ROWS_AT_ONCE;
                vec out[LANES];
                CPANELS1[SG_F32][rows](x + (size_t)g * K, K, panel, 0, 0, 0, 0, K, out);
                put(o, out, rows, p, g);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* y[M][N] = x[M][K] @ w^T + bias with w held in format fmt (bias may be NULL). */
int sg_linear_c(int fmt, const float *x, int M, int K, const void *wp, const float *sc, const float *mn, int N,
                const float *bias, float *y) {
    if (fmt < SG_F32 || fmt > 7 || M < 1 || M > SG_MAX_ROWS || K < 0 || N < 0) return -1;
    outputs o = {.parts = 1, .first = {0, (N + LANES - 1) / LANES}, .N = {N}, .y = {y}, .bias = {bias}};
    return linear_parts(fmt, x, M, K, (const char *)wp, sc, mn, &o);
}

/* Several layers of one input in one call: their panels (and scales) concatenated in wp (sc, mn); part
 * i's output [M][Ns[i]] is written at y + M * (Ns[0] + ... + Ns[i-1]), one block after another
 * (biases[i] may be NULL). Every part but the last must be a whole number of panels (Ns[i] % 16 == 0);
 * returns -1 (writing nothing) otherwise. */
int sg_linear_parts(int fmt, const float *x, int M, int K, const void *wp, const float *sc, const float *mn, int parts,
                    const int *Ns, float *y, const float *const *biases) {
    if (fmt < SG_F32 || fmt > 7 || M < 1 || M > SG_MAX_ROWS || K < 0 || parts < 1 || parts > SG_MAX_PARTS) return -1;
    outputs o = {.parts = parts};
    for (int i = 0; i < parts; i++) {
        if (Ns[i] < 0 || (i < parts - 1 && Ns[i] % LANES)) return -1;
        o.first[i + 1] = o.first[i] + (Ns[i] + LANES - 1) / LANES;
        o.N[i] = Ns[i];
        o.y[i] = i ? o.y[i - 1] + (size_t)M * Ns[i - 1] : y;
        o.bias[i] = biases ? biases[i] : 0;
    }
    return linear_parts(fmt, x, M, K, (const char *)wp, sc, mn, &o);
}

#pragma GCC pop_options

/* ---- Integer dot products: 4- and 8-bit codes against activations rounded to 8 bits -----------------
 *
 * Why: the paths above expand every weight to a float and spend about nine vector operations per 32
 * weights of a 4-bit panel, so one decode step is bound by arithmetic (about 40% of the memory's
 * speed), not by the bytes it reads. Rounding each row of x to int8 per block of 32 (one scale per
 * block, as llama.cpp does for its Q4/Q8 dot products) lets the CPU multiply 64 code bytes by 64
 * activation bytes and add them in fours into 16 int32 lanes in one instruction (AVX512-VNNI
 * vpdpbusd, AVX-VNNI's 256-bit one, or the portable loop below that computes the same integers).
 * It is another model than the float paths (the activations are rounded), offered as its own
 * --weights value; its agreement with fp32 is reported beside theirs.
 *
 * Formats (codes held as unsigned bytes; 32 k per block, KB = ceil(K / 32), K padded with code 0 /
 * 128 and activation 0, which add nothing):
 *   SG_Q8A8  [P][KB][8][16][4] u8 = q + 128 (q the signed int8 code): chunk c holds k = 4c..4c+3 of
 *            each of the panel's 16 output features, 4 bytes per feature   w = q * d
 *   SG_Q4A8  [P][KB][4][16][4] u8 pairs: chunk c holds, per feature, k = 8c+t in the low nibble of byte
 *            t and k = 8c+4+t in its high nibble (t = 0..3)                   w = q * d + m
 * with scales (and minimums) [P][KB][16] floats as in the float paths, or
 *   SG_Q4A8H [P][KB][320] bytes: SG_Q4A8's 256 code bytes of the block, then its 16 scales and 16
 *            minimums as IEEE half floats. For weights whose scales are halves already (GGUF's Q4_1):
 *            the same values, so the same outputs bit for bit, in 320 bytes a block instead of 384,
 *            and one stream per panel instead of three. benchmarks/q4a8_layout.c measured the one-row
 *            kernel 5-20% faster over SmolLM2's layers; fp32 scales in the same stream gained nothing.
 *
 * Per row and block: qx = round(x / dx), dx = max|x| / 127, sq = sum of qx. Per output and block:
 *   Q8A8: acc += (float)(sum(u * qx) - 128 * sq) * (d * dx)
 *   Q4A8: acc += (float)sum(u * qx) * (d * dx);  acc += m * (dx * sq)
 * The integer sums are exact, so their order is free (the CPU may add in any grouping); the float
 * steps are written out one operation at a time, in block order, and compiled without contraction:
 * every output is the same sequence of IEEE operations whatever M is and whatever path computes it,
 * so a row's result is bit-identical alone, in a verify and in a prefill.
 */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

enum { SG_Q8A8 = 5, SG_Q4A8 = 6, SG_Q4A8H = 7 };
typedef uint8_t u8x64 __attribute__((vector_size(64)));

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
/* 16 IEEE half floats at p (any alignment) as floats: exact, every half is a float. */
static inline vec load_halves(const char *p) {
#if defined(__AVX512F__) && !defined(SG_PORTABLE)
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && defined(__AVX__) && !defined(SG_PORTABLE)
    union { vec v; __m256 h[2]; } u;
    u.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    u.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    return u.v;
#else
    vec v;
    for (int i = 0; i < LANES; i++) {
        uint16_t h;
        __builtin_memcpy(&h, p + 2 * i, 2);
        uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
        float f;
        if (e == 0) { /* zero or subnormal: m * 2^-24, exact in a float */
            f = (float)m * 5.9604644775390625e-8f;
            __builtin_memcpy(&bits, &f, 4);
            bits |= sign;
        } else {
            bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
        }
        __builtin_memcpy(&f, &bits, 4);
        v[i] = f;
    }
    return v;
#endif
}

/* acc + per lane: the 4 bytes of w (unsigned) times the 4 signed bytes of x4, summed. */
static inline i32x16 dot4(i32x16 acc, i32x16 w, int32_t x4) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(SG_PORTABLE)
    return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#elif defined(__AVXVNNI__) && !defined(SG_PORTABLE)
    union { i32x16 v; __m256i h[2]; } a = {.v = acc}, b = {.v = w};
    __m256i xb = _mm256_set1_epi32(x4);
    a.h[0] = _mm256_dpbusd_avx_epi32(a.h[0], b.h[0], xb);
    a.h[1] = _mm256_dpbusd_avx_epi32(a.h[1], b.h[1], xb);
    return a.v;
#else
    u32x16 u = (u32x16)w;
    for (int t = 0; t < 4; t++) acc += (i32x16)((u >> (8 * t)) & 255) * (int32_t)(int8_t)(x4 >> (8 * t));
    return acc;
#endif
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

/* Rounds rows of x to int8 per block of 32: qx [M][KB * 32], dx and sq [M][KB], dxsq = dx * sq.
 * q = round-half-even(x * (1 / dx)) (adding and subtracting 1.5 * 2^23 rounds |v| <= 127 to the nearest
 * integer in the default rounding mode, as nearbyintf would, 16 lanes at a time). */
static void quantize_rows(const float *x, int M, int K, int8_t *qx, float *dx, int32_t *sq, float *dxsq) {
    int KB = (K + QK - 1) / QK;
    const vec magic = (vec){0} + 12582912.0f;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < KB; b++) {
            const float *xb = x + (size_t)r * K + b * QK;
            int n = K - b * QK < QK ? K - b * QK : QK;
            vec v[2];
            if (n == QK) {
                v[0] = *(const vec_u *)xb;
                v[1] = *(const vec_u *)(xb + LANES);
            } else {
                float tail[QK] = {0};
                for (int i = 0; i < n; i++) tail[i] = xb[i];
                v[0] = *(const vec_u *)tail;
                v[1] = *(const vec_u *)(tail + LANES);
            }
            vec a0 = (vec)((i32x16)v[0] & 0x7fffffff), a1 = (vec)((i32x16)v[1] & 0x7fffffff); /* |v| */
            i32x16 gt = a0 > a1; /* C has no vector ?: : select with the comparison's mask */
            vec mx = (vec)(((i32x16)a0 & gt) | ((i32x16)a1 & ~gt));
            float amax = 0.0f;
            for (int i = 0; i < LANES; i++) amax = mx[i] > amax ? mx[i] : amax;
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = qx + (size_t)r * KB * QK + b * QK;
            i32x16 total = {0};
            for (int h = 0; h < 2; h++) {
                vec t = v[h] * id;
                t = (t + magic) - magic;
                i32x16 qi = __builtin_convertvector(t, i32x16);
                i32x16 hi = qi > 127, lo = qi < -127;
                qi = (qi & ~hi) | (127 & hi);
                qi = (qi & ~lo) | (-127 & lo);
                total += qi;
                for (int i = 0; i < LANES; i++) q[h * LANES + i] = (int8_t)qi[i];
            }
            int32_t s = 0;
            for (int i = 0; i < LANES; i++) s += total[i];
            dx[(size_t)r * KB + b] = d;
            sq[(size_t)r * KB + b] = s;
            dxsq[(size_t)r * KB + b] = d * (float)s;
        }
}

typedef struct {
    const int8_t *qx;
    const float *dx, *dxsq;
    const int32_t *sq;
    int KB;
} qrows;

/* One panel (its codes at wp, its scales and minimums at sc and mn) for R rows of qx. */
#define APANEL(FMT, R)                                                                                               \
    static void apanel_##FMT##_##R(qrows q, const char *restrict wp, const float *restrict sc,                      \
                                   const float *restrict mn, vec *restrict out) {                                    \
        vec acc[R];                                                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = (vec){0};                                       \
        const size_t blk = FMT == SG_Q8A8 ? 512 : FMT == SG_Q4A8H ? 320 : 256, lq = (size_t)q.KB * QK;            \
        for (int b = 0; b < q.KB; b++) {                                                                              \
            i32x16 s[R];                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s[r] = (i32x16){0};                                  \
            const int8_t *xq = q.qx + (size_t)b * QK;                                                                 \
            if (FMT == SG_Q8A8) {                                                                                     \
                _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {                                                 \
                    i32x16 w = *(const i32x16 *)(wp + b * blk + c * 64);                                              \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) s[r] = dot4(s[r], w, load4(xq + r * lq + 4 * c)); \
                }                                                                                                     \
            } else {                                                                                                  \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                                 \
                    u8x64 v = *(const u8x64 *)(wp + b * blk + c * 64);                                                \
                    i32x16 lo = (i32x16)(v & 15), hi = (i32x16)(v >> 4);                                              \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                        s[r] = dot4(s[r], lo, load4(xq + r * lq + 8 * c));                                            \
                        s[r] = dot4(s[r], hi, load4(xq + r * lq + 8 * c + 4));                                        \
                    }                                                                                                 \
                }                                                                                                     \
            }                                                                                                         \
            vec d = FMT == SG_Q4A8H ? load_halves(wp + b * blk + 256) : *(const vec *)(sc + (size_t)b * LANES);       \
            vec m = FMT == SG_Q4A8H ? load_halves(wp + b * blk + 288)                                                 \
                  : FMT == SG_Q4A8 ? *(const vec *)(mn + (size_t)b * LANES) : (vec){0};                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                     \
                const size_t rb = (size_t)r * q.KB + b;                                                               \
                i32x16 si = FMT == SG_Q8A8 ? s[r] - 128 * q.sq[rb] : s[r];                                           \
                vec dd = d * q.dx[rb];                                                                                \
                vec t = __builtin_convertvector(si, vec) * dd;                                                        \
                acc[r] = acc[r] + t;                                                                                  \
                if (FMT != SG_Q8A8) {                                                                                 \
                    vec u = m * q.dxsq[rb];                                                                           \
                    acc[r] = acc[r] + u;                                                                              \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) out[r] = acc[r];                                         \
    }

#define AROWS 8 /* rows per pass over a panel: 8 accumulators stay in registers */
#define APANELS(FMT)                                                                                            \
    APANEL(FMT, 1) APANEL(FMT, 2) APANEL(FMT, 3) APANEL(FMT, 4) APANEL(FMT, 5) APANEL(FMT, 6) APANEL(FMT, 7)     \
    APANEL(FMT, 8)
APANELS(5) APANELS(6) APANELS(7)

typedef void (*apanel_fn)(qrows, const char *, const float *, const float *, vec *);
#define ATABLE(FMT)                                                                                                  \
    {0, apanel_##FMT##_1, apanel_##FMT##_2, apanel_##FMT##_3, apanel_##FMT##_4, apanel_##FMT##_5, apanel_##FMT##_6,  \
     apanel_##FMT##_7, apanel_##FMT##_8}
static const apanel_fn APANELS1[3][AROWS + 1] = {ATABLE(5), ATABLE(6), ATABLE(7)};

static qrows rows_from(qrows q, int r) {
    q.qx += (size_t)r * q.KB * QK;
    q.dx += (size_t)r * q.KB;
    q.dxsq += (size_t)r * q.KB;
    q.sq += (size_t)r * q.KB;
    return q;
}

#define QUANTIZE_SHARED_ROWS 16

static int linear_a8(int fmt, const float *x, int M, int K, const char *wp, const float *sc, const float *mn,
                     const outputs *o) {
    int KB = (K + QK - 1) / QK, f = fmt - SG_Q8A8;
    /* One allocation for the rounded rows: M * KB * (32 + 12) bytes. */
    char *work = malloc((size_t)M * KB * (QK + 12) + 64);
    if (!work) return -1;
    qrows q = {(const int8_t *)work, (const float *)(work + (size_t)M * KB * QK),
               (const float *)(work + (size_t)M * KB * (QK + 4)), (const int32_t *)(work + (size_t)M * KB * (QK + 8)), KB};
    /* A prompt chunk's rows rounded by the team (each row alone, so the same bits whoever rounds
     * it): done by the calling thread, they left the other threads waiting for about a tenth of a
     * 32-token chunk's forward. A few decode rows are not worth the extra barrier. */
    int shared = M >= QUANTIZE_SHARED_ROWS;
    if (!shared) quantize_rows(x, M, K, (int8_t *)q.qx, (float *)q.dx, (int32_t *)q.sq, (float *)q.dxsq);
    int panels = o->first[o->parts];
    size_t pstride = (size_t)KB * (fmt == SG_Q8A8 ? 512 : fmt == SG_Q4A8H ? 320 : 256), sstride = (size_t)KB * LANES;
    /* One panel at a time for every row count: for one or two rows four (or two) panels side by side
     * read twelve streams at once and were 10-18% slower from memory than one panel's three
     * (SmolLM2's 120 layers, M = 1 and 2, AMD EPYC); the panels also split more evenly between the
     * threads. Each output's operations are the same either way. */
#pragma omp parallel if (sg_parallel(M, K, (long)panels * LANES))
    {
        if (shared) {
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++) {
                qrows mine = rows_from(q, r);
                quantize_rows(x + (size_t)r * K, 1, K, (int8_t *)mine.qx, (float *)mine.dx, (int32_t *)mine.sq,
                              (float *)mine.dxsq);
            }
        }
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++)
            for (int g = 0; g < M; g += AROWS) {
                int rows = M - g < AROWS ? M - g : AROWS;
                vec out[AROWS];
                APANELS1[f][rows](rows_from(q, g), wp + p * pstride, sc ? sc + p * sstride : 0, mn ? mn + p * sstride : 0,
                                  out);
                put(o, out, rows, p, g);
            }
    }
    free(work);
    return 0;
}

#pragma GCC pop_options

/* The machine's read bandwidth as this kernel's loops see it: the sum of n floats (n a multiple of
 * 64), split over the team like the panels and read with the same vectors. `specdec bench --kernel`
 * sets the GB/s a decode step reaches against it. */
float sg_read(const float *a, size_t n) {
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
        vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}; /* four chains: the adds keep up with the loads */
#pragma omp for schedule(static)
        for (size_t i = 0; i < n; i += 4 * LANES) {
            s0 += *(const vec *)(a + i);
            s1 += *(const vec *)(a + i + LANES);
            s2 += *(const vec *)(a + i + 2 * LANES);
            s3 += *(const vec *)(a + i + 3 * LANES);
        }
        vec s = s0 + s1 + s2 + s3;
        for (int j = 0; j < LANES; j++) total += s[j];
    }
    return total;
}
