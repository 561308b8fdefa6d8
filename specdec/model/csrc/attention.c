/* Attention for CPU forwards in which a query row's result does not depend on the other rows.
 *
 * Why: speculative decoding is exact only if the target computes a position the same way in a
 * decode step (one query row) and in a verify pass (several rows, among them the drafted ones).
 * The linear layers of specdec's kernel are (gemm.c); torch's CPU attention is not: its flash
 * kernel blocks one query and many queries differently, and the same position's output differs in
 * the last bits. With float activations that flips a greedy token only at rare near-ties; where
 * the next layer rounds its input to 8 bits (the -a8 weight formats) a last-bit difference can
 * move a rounding step and the logits by tenths, and speculation stops being exact.
 *
 * Here every (batch row, head, query row) computes its output alone, over the keys it may see in
 * key order: the scores q.k * scale, their maximum, exp(score - max), the sum of those, the
 * exp-weighted sum of values, divided by the sum. The arithmetic is the same whatever the number
 * of query rows, the mask or the padding around the row (a key not allowed is skipped, not
 * weighted by zero), so a position's output is bit-identical in a decode step, a verify, a tree
 * pass and a batch.
 *
 * q [B][H][Mq][D], k and v [B][Hkv][T][D] (any strides for B, H and the row; D contiguous), the
 * query rows being the last Mq of the T positions; mask NULL (causal: row i sees keys 0..T-Mq+i) or
 * mask[b][h][i][t] bytes (nonzero: allowed; strides given, 0 to broadcast); out [B][Mq][H][D]
 * contiguous. Heads h of a group of H / Hkv share key head h / (H / Hkv) (grouped-query attention).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define VL 16
typedef float fvec __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(VL * 4), aligned(4)));

/* Sum of the 16 lanes as a fixed tree (halves added pairwise): cheaper than 15 dependent additions. */
static inline float lanes_sum(fvec s) {
    typedef float f8 __attribute__((vector_size(32)));
    typedef float f4 __attribute__((vector_size(16)));
    f8 a = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
    f4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* The dot product of two D-float rows: 16-lane partial sums in index order, then lanes_sum. */
static inline float dot(const float *a, const float *b, int D) {
    fvec s = {0};
    int d = 0;
    for (; d + VL <= D; d += VL) s = s + *(const fvec *)(a + d) * *(const fvec *)(b + d);
    float total = lanes_sum(s);
    for (; d < D; d++) total += a[d] * b[d];
    return total;
}

/* exp(x) for x <= 0, 16 lanes: x = n ln2 + r, a degree-6 polynomial for exp(r) (Cephes' expf
 * coefficients, ~1 ulp), times 2^n from the exponent bits. Below -87 it returns exp(-87) (1.6e-38):
 * against the maximum's exp(0) = 1 in the same sum, that is nothing. */
static inline fvec vexp(fvec x) {
    const fvec lo = (fvec){0} - 87.0f, magic = (fvec){0} + 12582912.0f;
    ivec below = x < lo;
    x = (fvec)(((ivec)x & ~below) | ((ivec)lo & below));
    fvec n = (x * 1.44269504088896341f + magic) - magic; /* round to nearest */
    fvec r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    fvec p = (fvec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    fvec y = p * r * r + r + 1.0f;
    ivec e = (__builtin_convertvector(n, ivec) + 127) << 23;
    return y * (fvec)e;
}

int sg_attention(const float *q, long qsb, long qsh, long qsi, const float *k, long ksb, long ksh, long kst,
                 const float *v, long vsb, long vsh, long vst, const uint8_t *mask, long msb, long msh, long msi,
                 int B, int H, int Hkv, int Mq, int T, int D, float scale, float *out) {
    if (B < 1 || H < 1 || Hkv < 1 || H % Hkv || Mq < 1 || T < Mq || D < 1) return -1;
    int group = H / Hkv, failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * ((size_t)T + VL)), *acc = malloc(sizeof(float) * (size_t)D);
        int *index = malloc(sizeof(int) * (size_t)T);
        if (!scores || !acc || !index) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < Mq; i++) {
                    if (!scores || !acc || !index) continue;
                    const float *qi = q + b * qsb + h * qsh + i * qsi;
                    const float *kb = k + b * ksb + (h / group) * ksh, *vb = v + b * vsb + (h / group) * vsh;
                    const uint8_t *mi = mask ? mask + b * msb + h * msh + i * msi : 0;
                    int last = mask ? T - 1 : T - Mq + i;
                    /* the allowed keys, in order: their scores and indices, packed */
                    int n = 0;
                    float mx = -INFINITY;
                    for (int t = 0; t <= last; t++) {
                        if (mi && !mi[t]) continue;
                        float sc = dot(qi, kb + t * kst, D) * scale;
                        scores[n] = sc;
                        index[n++] = t;
                        mx = sc > mx ? sc : mx;
                    }
                    float *o = out + (((size_t)b * Mq + i) * H + h) * D;
                    if (!n) { /* a row that may see nothing (padding): zeros, as torch's kernels give */
                        for (int d = 0; d < D; d++) o[d] = 0.0f;
                        continue;
                    }
                    fvec sums = {0};
                    int j = 0;
                    for (; j + VL <= n; j += VL) {
                        fvec e = vexp(*(const fvec *)(scores + j) - mx);
                        *(fvec *)(scores + j) = e;
                        sums = sums + e;
                    }
                    float sum = lanes_sum(sums);
                    if (j < n) {
                        fvec rest = (fvec){0} - 87.0f;
                        for (int l = 0; l < n - j; l++) rest[l] = scores[j + l] - mx;
                        fvec e = vexp(rest);
                        for (int l = 0; l < n - j; l++) {
                            scores[j + l] = e[l];
                            sum += e[l];
                        }
                    }
                    for (int d = 0; d < D; d++) acc[d] = 0.0f;
                    for (j = 0; j < n; j++) {
                        const float *vt = vb + index[j] * vst;
                        float e = scores[j];
                        for (int d = 0; d < D; d++) acc[d] += e * vt[d];
                    }
                    float inv = 1.0f / sum;
                    for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
                }
        free(scores);
        free(acc);
        free(index);
    }
    return failed ? -1 : 0;
}

/* RMS normalisation of M rows of K floats (transformers' LlamaRMSNorm, one call instead of eight
 * tensor operations): y = w * (x * (1 / sqrt(mean(x^2) + eps))); each row alone, sums in one fixed
 * order, so a row's result does not depend on the others either. */
void sg_rmsnorm(const float *x, int M, int K, const float *w, float eps, float *y) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        float *ym = y + (size_t)m * K;
        float r = 1.0f / sqrtf(dot(xm, xm, K) / (float)K + eps);
        for (int d = 0; d < K; d++) ym[d] = w[d] * (xm[d] * r);
    }
}
