/* A whole decoder stack of a compact Llama-family model in one call, for the new rows of one or more sequences.
 *
 * Why: with compact weights a small model's decode step is ~120 kernel calls (q/k/v, o, gate/up and
 * down of 30 layers, their norms and attention), each cheap in C and each paying, from Python, the
 * interpreter, a ctypes call, tensor allocations, views and the cache's bookkeeping around it. That
 * was about a third of a SmolLM2-135M decode step on two cores (docs/benchmarks.md), the share by
 * which llama.cpp, whose graph runs in C, decoded faster. Here one call runs every layer through the
 * same C functions the per-layer path calls (sg_rmsnorm, sg_linear_parts / sg_linear_c, sg_attention's
 * tiles, sg_silu_mul), so a row's result is bit-identical whichever path computes it; the rotary embedding
 * and the residual adds are written as the IEEE operations torch performs for them (q * cos, then
 * rotate_half(q) * sin, then their sum; x + y), compiled without contraction.
 *
 * The path covers the chains of one or several sequences, each fed from its own cache: a sequence's
 * new rows see its cached keys and its new keys up to their own (the causal rule). Trees and
 * transformers' padded batches take the per-layer path (specdec/model/cpu/decoder.py).
 * specdec/model/cpu/stack.py says when a forward is eligible and keeps the caches' bookkeeping.
 *
 * x [M][E] (the embeddings in, the last layer's output out, in place); cos, sin [M][D] as
 * transformers' rotary embedding computes them; each sequence's key and value buffers per layer,
 * [Hkv][capacity][D] (strides given), with room for its past + rows positions: its new keys (rotated)
 * and values are written at positions past..past+rows-1.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

int sg_linear_c(int fmt, const float *x, int M, int K, const void *wp, const float *sc, const float *mn, int N,
                const float *bias, float *y);
int sg_linear_parts(int fmt, const float *x, int M, int K, const void *wp, const float *sc, const float *mn, int parts,
                    const int *Ns, float *y, const float *const *biases);
int sg_attention_groups(int G, const int *rows, const int *past, const float *q, long qsi, const float *const *k,
                        const long *ksh, const long *kst, const float *const *v, const long *vsh, const long *vst, int H,
                        int Hkv, int D, float scale, float *out);
void sg_rmsnorm(const float *x, int M, int K, const float *w, float eps, float *y);
void sg_silu_mul(const float *gate, const float *up, size_t n, float *out);

/* transformers' apply_rotary_pos_emb on one head's D values at one position, in place:
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]). (-b) * s + a * c rounds as
 * a * c - b * s: negation is exact. */
static void rotate(float *x, const float *cos, const float *sin, int D) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        float lo = a * cos[i] - b * sin[i];
        float hi = b * cos[i + half] + a * sin[i + half];
        x[i] = lo;
        x[i + half] = hi;
    }
}

typedef struct {
    int fmt, parts;
    int N[3];
    const void *wp;
    const float *sc, *mn;
    const float *bias[3];
} sg_weight;

typedef struct {
    const float *norm1, *norm2; /* input_layernorm, post_attention_layernorm weights */
    float eps1, eps2, scale;    /* their epsilons; the attention's score scale */
    sg_weight qkv, o, gateup, down;
} sg_layer;

/* The working rows of one pass through the layers (sg_stack), for M rows in all. */
typedef struct {
    float *h, *qkv, *att, *tmp, *gu, *act;
    const float **kp, **vp; /* per sequence: this layer's key and value buffers, and their strides */
    long *ksh, *kst, *vsh, *vst;
} sg_rows;

/* Layer l on x: 0, or -1 when a kernel refuses its shape or runs out of memory. */
static int layer_forward(const sg_layer *ly, int l, int L, int G, const int *rows, const int *past, float *const *kv,
                         const long *strides, float *x, int M, int E, int H, int Hkv, int D, int I, const float *cos,
                         const float *sin, sg_rows w) {
    size_t qn = (size_t)H * D, kvn = (size_t)Hkv * D, n = (size_t)M;
    sg_rmsnorm(x, M, E, ly->norm1, ly->eps1, w.h);
    if (sg_linear_parts(ly->qkv.fmt, w.h, M, E, ly->qkv.wp, ly->qkv.sc, ly->qkv.mn, ly->qkv.parts, ly->qkv.N, w.qkv,
                        ly->qkv.bias))
        return -1;
    float *q = w.qkv, *k = q + n * qn, *v = k + n * kvn;
    for (int g = 0, r0 = 0; g < G; r0 += rows[g], g++) {
        size_t at = (size_t)g * L + l;
        float *kc = kv[2 * at], *vc = kv[2 * at + 1];
        long ksh = strides[4 * at], kst = strides[4 * at + 1], vsh = strides[4 * at + 2], vst = strides[4 * at + 3];
        w.kp[g] = kc, w.vp[g] = vc, w.ksh[g] = ksh, w.kst[g] = kst, w.vsh[g] = vsh, w.vst[g] = vst;
        for (int m = r0; m < r0 + rows[g]; m++) {
            const float *c = cos + (size_t)m * D, *s = sin + (size_t)m * D;
            long position = past[g] + (m - r0);
            for (int hh = 0; hh < H; hh++) rotate(q + m * qn + (size_t)hh * D, c, s, D);
            for (int hh = 0; hh < Hkv; hh++) {
                float *kr = k + m * kvn + (size_t)hh * D;
                rotate(kr, c, s, D);
                memcpy(kc + hh * ksh + position * kst, kr, sizeof(float) * D);
                memcpy(vc + hh * vsh + position * vst, v + m * kvn + (size_t)hh * D, sizeof(float) * D);
            }
        }
    }
    /* every sequence's rows in one parallel region (sg_attention_groups says why) */
    if (sg_attention_groups(G, rows, past, q, (long)qn, w.kp, w.ksh, w.kst, w.vp, w.vsh, w.vst, H, Hkv, D, ly->scale, w.att))
        return -1;
    if (sg_linear_c(ly->o.fmt, w.att, M, (int)qn, ly->o.wp, ly->o.sc, ly->o.mn, E, ly->o.bias[0], w.tmp)) return -1;
    for (size_t i = 0; i < n * E; i++) x[i] = x[i] + w.tmp[i];
    sg_rmsnorm(x, M, E, ly->norm2, ly->eps2, w.h);
    if (sg_linear_parts(ly->gateup.fmt, w.h, M, E, ly->gateup.wp, ly->gateup.sc, ly->gateup.mn, ly->gateup.parts,
                        ly->gateup.N, w.gu, ly->gateup.bias))
        return -1;
    sg_silu_mul(w.gu, w.gu + n * I, n * I, w.act);
    if (sg_linear_c(ly->down.fmt, w.act, M, I, ly->down.wp, ly->down.sc, ly->down.mn, E, ly->down.bias[0], w.tmp)) return -1;
    for (size_t i = 0; i < n * E; i++) x[i] = x[i] + w.tmp[i];
    return 0;
}

/* Runs layers[0..L) on the rows of G sequences at once, x [M][E] with M = rows[0] + ... + rows[G-1],
 * sequence g's rows one after another: the linear layers read each weight once for all M rows (what
 * batching is for), and each sequence's rows attend to their own cache, rows[g] new positions after
 * past[g] cached ones, without padding. kv[2 (g L + l)] / kv[2 (g L + l) + 1]: sequence g's key / value
 * buffer of layer l; strides[4 (g L + l) ..]: their (head, position) strides in floats. Returns 0, or
 * -1 (x and the caches then hold partial results: the caller drops the forward) when a kernel
 * refuses its shape or memory runs out. */
int sg_stack(const sg_layer *layers, int L, int G, const int *rows, const int *past, float *const *kv,
             const long *strides, float *x, int E, int H, int Hkv, int D, int I, const float *cos, const float *sin) {
    if (L < 1 || G < 1 || E < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 2 || D % 2 || I < 1) return -1;
    int M = 0;
    for (int g = 0; g < G; g++) {
        if (rows[g] < 1 || past[g] < 0) return -1;
        M += rows[g];
    }
    size_t qn = (size_t)H * D, kvn = (size_t)Hkv * D, n = (size_t)M;
    float *work = malloc(n * (E + qn + 2 * kvn + qn + E + 2 * (size_t)I + I) * sizeof(float));
    if (!work) return -1;
    sg_rows w = {.h = work};
    w.qkv = w.h + n * E, w.att = w.qkv + n * (qn + 2 * kvn), w.tmp = w.att + n * qn, w.gu = w.tmp + n * E,
    w.act = w.gu + n * 2 * I;
    const float **pointers = malloc(sizeof(float *) * 2 * (size_t)G);
    long *lens = malloc(sizeof(long) * 4 * (size_t)G);
    if (!pointers || !lens) {
        free(pointers);
        free(lens);
        free(work);
        return -1;
    }
    w.kp = pointers, w.vp = pointers + G, w.ksh = lens, w.kst = lens + G, w.vsh = lens + 2 * G, w.vst = lens + 3 * G;
    int failed = 0;
    for (int l = 0; l < L && !failed; l++)
        failed = layer_forward(layers + l, l, L, G, rows, past, kv, strides, x, M, E, H, Hkv, D, I, cos, sin, w);
    free(pointers);
    free(lens);
    free(work);
    return failed ? -1 : 0;
}

#pragma GCC pop_options
