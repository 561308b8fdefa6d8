/* Would codes and fp16 scales in one stream per panel read faster than today's layout? A standalone
 * check of the one-row Q4A8 kernel (gemm.c's APANEL, four panels side by side) over SmolLM2-135M's 120
 * layer shapes, today's layout (codes, fp32 scales and fp32 minimums in three arrays) against codes
 * followed by each block's fp16 scale and minimum (GGUF's own precision: lossless for Q4_1). Same
 * arithmetic; constant weights (the timing does not depend on the values). Build and run:
 *
 *     gcc -O3 -march=native -fopenmp -std=c11 benchmarks/q4a8_layout.c -o /tmp/q4a8_layout && /tmp/q4a8_layout
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
typedef float vec __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef _Float16 h16 __attribute__((vector_size(32)));
#define QK 32
static inline i32x16 dot4(i32x16 acc, i32x16 w, int32_t x4) { return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4)); }
static inline int32_t load4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
#define NP 4
static void panel_a(const int8_t *qx, const float *dx, const float *dxsq, int KB, const char *wp, size_t pstride, const float *sc, const float *mn, size_t sstride, vec *out) {
    vec acc[NP] = {0};
    for (int b = 0; b < KB; b++) {
        i32x16 s[NP] = {0};
        const int8_t *xq = qx + b * QK;
        for (int c = 0; c < 4; c++) for (int p = 0; p < NP; p++) {
            u8x64 v = *(const u8x64 *)(wp + p * pstride + b * 256 + c * 64);
            i32x16 lo = (i32x16)(v & 15), hi = (i32x16)(v >> 4);
            s[p] = dot4(s[p], lo, load4(xq + 8 * c)); s[p] = dot4(s[p], hi, load4(xq + 8 * c + 4));
        }
        for (int p = 0; p < NP; p++) {
            vec d = *(const vec *)(sc + p * sstride + b * 16), m = *(const vec *)(mn + p * sstride + b * 16);
            vec t = __builtin_convertvector(s[p], vec) * (d * dx[b]);
            acc[p] = acc[p] + t; acc[p] = acc[p] + m * dxsq[b];
        }
    }
    for (int p = 0; p < NP; p++) out[p] = acc[p];
}
static void panel_b(const int8_t *qx, const float *dx, const float *dxsq, int KB, const char *wp, size_t pstride, vec *out) {
    vec acc[NP] = {0};
    for (int b = 0; b < KB; b++) {
        i32x16 s[NP] = {0};
        const int8_t *xq = qx + b * QK;
        for (int c = 0; c < 4; c++) for (int p = 0; p < NP; p++) {
            u8x64 v = *(const u8x64 *)(wp + p * pstride + b * 320 + c * 64);
            i32x16 lo = (i32x16)(v & 15), hi = (i32x16)(v >> 4);
            s[p] = dot4(s[p], lo, load4(xq + 8 * c)); s[p] = dot4(s[p], hi, load4(xq + 8 * c + 4));
        }
        for (int p = 0; p < NP; p++) {
            const char *blk = wp + p * pstride + b * 320 + 256;
            vec d = (vec)_mm512_cvtph_ps(_mm256_load_si256((const __m256i *)blk)), m = (vec)_mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(blk + 32)));
            vec t = __builtin_convertvector(s[p], vec) * (d * dx[b]);
            acc[p] = acc[p] + t; acc[p] = acc[p] + m * dxsq[b];
        }
    }
    for (int p = 0; p < NP; p++) out[p] = acc[p];
}
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main() {
    // 30 layers x (qkv 960x576, o 576x576, gateup 3072x576, down 576x1536) like SmolLM2
    int K[4] = {576, 576, 576, 1536}, N[4] = {960, 576, 3072, 576}, L = 30;
    char *A[120], *B[120]; float *S[120], *Mn[120];
    size_t bytesA = 0, bytesB = 0;
    for (int i = 0; i < 120; i++) {
        int k = K[i % 4], n = N[i % 4], KB = k / 32, P = n / 16;
        A[i] = aligned_alloc(64, (size_t)P * KB * 256); S[i] = aligned_alloc(64, (size_t)P * KB * 64); Mn[i] = aligned_alloc(64, (size_t)P * KB * 64);
        B[i] = aligned_alloc(64, (size_t)P * KB * 320);
        memset(A[i], 0x35, (size_t)P * KB * 256); for (size_t j = 0; j < (size_t)P * KB * 16; j++) S[i][j] = 0.01f, Mn[i][j] = -0.02f;
        memset(B[i], 0x35, (size_t)P * KB * 320);
        bytesA += (size_t)P * KB * 384; bytesB += (size_t)P * KB * 320;
    }
    int8_t qx[1536]; float dx[48], dxsq[48]; for (int i = 0; i < 1536; i++) qx[i] = i % 7 - 3; for (int i = 0; i < 48; i++) dx[i] = 0.1f, dxsq[i] = 0.3f;
    float *y = malloc(4096 * 4);
    for (int variant = 0; variant < 2; variant++) for (int rep = 0; rep < 3; rep++) {
        double best = 1e9;
        for (int it = 0; it < 20; it++) {
            double t0 = now();
            for (int i = 0; i < 120; i++) {
                int k = K[i % 4], n = N[i % 4], KB = k / 32, P = n / 16;
                #pragma omp parallel for schedule(static)
                for (int g = 0; g < P / NP; g++) {
                    vec out[NP];
                    if (variant == 0) panel_a(qx, dx, dxsq, KB, A[i] + (size_t)g * NP * KB * 256, (size_t)KB * 256, S[i] + (size_t)g * NP * KB * 16, Mn[i] + (size_t)g * NP * KB * 16, (size_t)KB * 16, out);
                    else panel_b(qx, dx, dxsq, KB, B[i] + (size_t)g * NP * KB * 320, (size_t)KB * 320, out);
                    for (int p = 0; p < NP; p++) memcpy(y + (g * NP + p) * 16 % 4096, &out[p], 64);
                }
            }
            double dt = now() - t0; if (dt < best) best = dt;
        }
        size_t by = variant ? bytesB : bytesA;
        printf("%s: %.3f ms, %.1f MB, %.1f GB/s\n", variant ? "interleaved f16" : "current f32   ", best * 1e3, by / 1e6, by / best / 1e9);
    }
    return 0;
}
