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

/* lanes_sum of 16 vectors at once, lane u of the result being lanes_sum(s[u]) to the bit: the same
 * additions of the same pairs (halves added pairwise, then (b0 + b2) + (b1 + b3)), done for 16 keys
 * in 15 vector additions instead of one horizontal tree per key. */
static inline fvec reduce16(const fvec *s) {
    fvec a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = __builtin_shufflevector(s[2 * j], s[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(s[2 * j], s[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
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

/* exp(x), 16 lanes: x = n ln2 + r, a degree-6 polynomial for exp(r) (Cephes' expf coefficients,
 * ~1 ulp), times 2^n from the exponent bits. x is clamped to [-87, 88] (2^n stays a normal float):
 * below, exp(-87) = 1.6e-38, which against the maximum's exp(0) = 1 in a softmax's sum is nothing. */
static inline fvec vexp(fvec x) {
    const fvec lo = (fvec){0} - 87.0f, hi = (fvec){0} + 88.0f, magic = (fvec){0} + 12582912.0f;
    ivec below = x < lo, above = x > hi;
    x = (fvec)(((ivec)x & ~below) | ((ivec)lo & below));
    x = (fvec)(((ivec)x & ~above) | ((ivec)hi & above));
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

/* Turns n packed scores into exp(score - mx) in place and returns their sum: 16 lanes at a time,
 * the lanes summed with lanes_sum, the last partial block's terms added one by one. Every row, in a
 * tile or alone, goes through this one sequence of operations. */
static inline float exp_packed(float *s, int n, float mx) {
    fvec sums = {0};
    int j = 0;
    for (; j + VL <= n; j += VL) {
        fvec e = vexp(*(const fvec *)(s + j) - mx);
        *(fvec *)(s + j) = e;
        sums = sums + e;
    }
    float sum = lanes_sum(sums);
    if (j < n) {
        fvec rest = (fvec){0} - 87.0f;
        for (int l = 0; l < n - j; l++) rest[l] = s[j + l] - mx;
        fvec e = vexp(rest);
        for (int l = 0; l < n - j; l++) {
            s[j + l] = e[l];
            sum += e[l];
        }
    }
    return sum;
}

/* A tile: query rows [i0, i0 + R) of head h of batch row b, computed as row_exact's contract says,
 * each row alone in its arithmetic. Why tiles: one row at a time, a key's 64 floats were loaded
 * once per query and the output sums lived in memory, so each key's multiply-adds waited on the
 * previous key's store; a prompt's chunk has hundreds of rows that read the same keys. A tile reads
 * each key once for its R rows and keeps their sums in registers. Every row's numbers are the
 * same whatever R, i0 and the other rows are: the same dot() per key, the same packed-score exp
 * and sum, the same key-order accumulation, so a decode step (one row) and a chunk agree bitwise.
 * DV (D / 16) and R are constants at each call site, so the compiler keeps acc in registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const int DV, const int R, const float *q, long qsi, const float *kb, long kst, const float *vb, long vst,
    const uint8_t *mask, long msi, int rows, int first_last, int masked, int T, float scale,
    float *scores, int *index, long stride, float *out, long osi, int row_step) {
    int n[8], last[8];
    float mx[8];
    int lastmax = 0;
    for (int r = 0; r < rows; r++) {
        n[r] = 0;
        mx[r] = -INFINITY;
        last[r] = masked ? T - 1 : first_last + r * row_step; /* row_step 0: the rows are heads of one query */
        lastmax = last[r] > lastmax ? last[r] : lastmax;
    }
    /* scores 16 keys at a time: each row's 16 dot products, reduced together (reduce16) */
    fvec mxv[8];
    for (int r = 0; r < rows; r++) mxv[r] = (fvec){0} - INFINITY;
    for (int t0 = 0; t0 <= lastmax; t0 += VL) {
        int nk = lastmax + 1 - t0 < VL ? lastmax + 1 - t0 : VL;
        for (int r = 0; r < rows; r++) {
            if (t0 > last[r]) continue;
            const float *qr = q + r * qsi;
            fvec qv[8], sv[VL];
            for (int dv = 0; dv < DV; dv++) qv[dv] = *(const fvec *)(qr + dv * VL);
            for (int u = 0; u < VL; u++) {
                fvec s = {0};
                if (u < nk) {
                    const float *kt = kb + (t0 + u) * kst;
                    for (int dv = 0; dv < DV; dv++) s = s + qv[dv] * *(const fvec *)(kt + dv * VL);
                }
                sv[u] = s;
            }
            fvec sc = reduce16(sv) * scale;
            float *sr = scores + r * stride;
            int *ir = index + r * stride;
            if (!masked && t0 + VL - 1 <= last[r]) { /* a whole block of allowed keys: stored as they are */
                *(fvec *)(sr + n[r]) = sc;
                for (int u = 0; u < VL; u++) ir[n[r] + u] = t0 + u;
                n[r] += VL;
                ivec more = sc > mxv[r];
                mxv[r] = (fvec)(((ivec)sc & more) | ((ivec)mxv[r] & ~more));
                continue;
            }
            for (int u = 0; u < nk; u++) {
                int t = t0 + u;
                if (t > last[r] || (masked && !mask[r * msi + t])) continue;
                sr[n[r]] = sc[u];
                ir[n[r]++] = t;
                mx[r] = sc[u] > mx[r] ? sc[u] : mx[r];
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < VL; u++) mx[r] = mxv[r][u] > mx[r] ? mxv[r][u] : mx[r];
    float inv[8];
    for (int r = 0; r < rows; r++) {
        float sum = exp_packed(scores + r * stride, n[r], mx[r]);
        inv[r] = n[r] ? 1.0f / sum : 0.0f; /* a row that may see nothing (padding): zeros, as torch's kernels give */
    }
    /* The exp-weighted values, one row at a time with its sums in registers: with the rows inside
     * the loop over keys the compiler kept the sums in memory, and every key's adds waited on the
     * previous key's store (perf annotate). The order of each row's additions is unchanged. */
    for (int r = 0; r < rows; r++) {
        fvec acc[8];
        for (int dv = 0; dv < DV; dv++) acc[dv] = (fvec){0};
        const float *sr = scores + r * stride;
        const int *ir = index + r * stride;
        for (int j = 0; j < n[r]; j++) {
            const float *vt = vb + ir[j] * vst;
            fvec e = (fvec){0} + sr[j];
            for (int dv = 0; dv < DV; dv++) acc[dv] = acc[dv] + e * *(const fvec *)(vt + dv * VL);
        }
        for (int dv = 0; dv < DV; dv++) *(fvec *)(out + r * osi + dv * VL) = acc[dv] * inv[r];
    }
}

/* The same for any D: one row a tile, the sums in memory (head sizes that are not 16, 32, 48, 64, 80, 96
 * or 128). A tile computes each of its rows with these very operations (attend_tile says how), so the
 * two give the same bits where both apply. */
static void attend_row(const float *qi, const float *kb, long kst, const float *vb, long vst, const uint8_t *mi,
                       int last, int D, float scale, float *scores, int *index, float *acc, float *o) {
    int n = 0;
    float mx = -INFINITY;
    for (int t = 0; t <= last; t++) {
        if (mi && !mi[t]) continue;
        float sc = dot(qi, kb + t * kst, D) * scale;
        scores[n] = sc;
        index[n++] = t;
        mx = sc > mx ? sc : mx;
    }
    if (!n) {
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        return;
    }
    float sum = exp_packed(scores, n, mx);
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int j = 0; j < n; j++) {
        const float *vt = vb + index[j] * vst;
        float e = scores[j];
        for (int d = 0; d < D; d++) acc[d] += e * vt[d];
    }
    float inv = 1.0f / sum;
    for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
}

/* A thread's working memory for tiles of up to R rows over `stride` keys: scores, their key indices,
 * and attend_row's sums. NULL members where malloc failed (scratch_ok says). */
typedef struct {
    float *scores, *acc;
    int *index;
} scratch;

static int scratch_ok(scratch s) { return s.scores && s.acc && s.index; }

/* Called by each thread of a parallel region; sets *failed where memory ran out. */
static scratch scratch_open(long stride, int R, int D, int *failed) {
    scratch s = {malloc(sizeof(float) * (size_t)(stride * R)), malloc(sizeof(float) * (size_t)D),
                 malloc(sizeof(int) * (size_t)(stride * R))};
    if (!scratch_ok(s)) {
#pragma omp atomic write
        *failed = 1;
    }
    return s;
}

static void scratch_close(scratch s) {
    free(s.scores);
    free(s.acc);
    free(s.index);
}

#define TILE_ROWS 4 /* rows a tile: D = 64 keeps 4 rows' sums in 16 vector registers, D = 128 two rows' */

/* `rows` query rows (at most tile_rows(D)) as attend_tile computes them, its constants fixed for the
 * head dims whose tiles keep their sums in registers (multiples of 16 up to 128 but 112); any other D
 * one row at a time (attend_row, rows 1). Inlined, so each branch is the specialised tile the three callers spelled out before. */
static inline __attribute__((always_inline)) void attend(
    int D, const float *q, long qsi, const float *kb, long kst, const float *vb, long vst, const uint8_t *mask, long msi,
    int rows, int first_last, int masked, int T, float scale, float *scores, int *index, float *acc, long stride,
    float *out, long osi, int row_step) {
#define ATTEND_TILE(DV, R) attend_tile(DV, R, q, qsi, kb, kst, vb, vst, mask, msi, rows, first_last, masked, T, scale, \
                                      scores, index, stride, out, osi, row_step)
    if (D == 64)
        ATTEND_TILE(4, TILE_ROWS);
    else if (D == 128)
        ATTEND_TILE(8, TILE_ROWS / 2);
    else if (D == 16) /* the other multiples of 16: the same tiles (small models, Phi's 80 and 96) */
        ATTEND_TILE(1, TILE_ROWS);
    else if (D == 32)
        ATTEND_TILE(2, TILE_ROWS);
    else if (D == 48)
        ATTEND_TILE(3, TILE_ROWS / 2);
    else if (D == 80)
        ATTEND_TILE(5, TILE_ROWS / 2);
    else if (D == 96)
        ATTEND_TILE(6, TILE_ROWS / 2);
    else
        attend_row(q, kb, kst, vb, vst, mask, masked ? T - 1 : first_last, D, scale, scores, index, acc, out);
}

/* Whether attention over this many query-key products per head dimension opens a parallel region:
 * as for the linear layers (csrc/gemm.c, sg_parallel), a small pass is done sooner by the calling
 * thread than a team forks and joins, and a waiting team thread holds a shared core. Each tile is
 * computed alike whichever thread takes it, so the choice changes no bit. */
static inline int attention_parallel(double products) { return products >= (double)(1 << 20); }

static inline int tile_rows(int D) {
    return D == 64 || D == 16 || D == 32 ? TILE_ROWS : D == 128 || D == 48 || D == 80 || D == 96 ? TILE_ROWS / 2 : 1;
}

int sg_attention(const float *q, long qsb, long qsh, long qsi, const float *k, long ksb, long ksh, long kst,
                 const float *v, long vsb, long vsh, long vst, const uint8_t *mask, long msb, long msh, long msi,
                 int B, int H, int Hkv, int Mq, int T, int D, float scale, float *out) {
    if (B < 1 || H < 1 || Hkv < 1 || H % Hkv || Mq < 1 || T < Mq || D < 1) return -1;
    int group = H / Hkv, failed = 0;
    int R = tile_rows(D), tiles = (Mq + R - 1) / R;
    long stride = (long)T + VL;
#pragma omp parallel if (attention_parallel((double)B * H * Mq * T * D))
    {
        scratch mine = scratch_open(stride, R, D, &failed);
        float *scores = mine.scores, *acc = mine.acc;
        int *index = mine.index;
#pragma omp for collapse(3) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int tile = 0; tile < tiles; tile++) {
                    if (!scratch_ok(mine)) continue;
                    int i0 = tile * R, rows = Mq - i0 < R ? Mq - i0 : R;
                    const float *qi = q + b * qsb + h * qsh + i0 * qsi;
                    const float *kb = k + b * ksb + (h / group) * ksh, *vb = v + b * vsb + (h / group) * vsh;
                    const uint8_t *mi = mask ? mask + b * msb + h * msh + i0 * msi : 0;
                    float *o = out + (((size_t)b * Mq + i0) * H + h) * D;
                    long osi = (long)H * D;
                    attend(D, qi, qsi, kb, kst, vb, vst, mi, msi, rows, T - Mq + i0, mask != 0, T, scale, scores, index, acc,
                           stride, o, osi, 1);
                }
        scratch_close(mine);
    }
    return failed ? -1 : 0;
}

/* The causal attention of G sequences' new rows, each over its own cache, in ONE parallel region:
 * sequence g's rows[g] query rows q + (r0 + i) * qsi (r0 its first row among all), heads of D at
 * stride D, attend to its past[g] + rows[g] keys/values at k[g], v[g] (head stride ksh[g] / vsh[g],
 * position stride kst[g] / vst[g]); out [M][H][D] contiguous, M the rows of all.
 *
 * Why one region: the decoder stack (csrc/stack.c) called sg_attention once per sequence, so a pass of
 * 8 decoding sequences opened 8 parallel regions a layer, 240 a pass, each with its scratch and its
 * barrier, and H heads of one query split unevenly over the threads; in a perf profile of such a pass
 * attention and the idle threads' spin together outweighed the linear layers. Every (sequence,
 * head, tile) is computed by attend_tile exactly as sg_attention computes it, so each row's bits do
 * not change. */
int sg_attention_groups(int G, const int *rows, const int *past, const float *q, long qsi, const float *const *k,
                        const long *ksh, const long *kst, const float *const *v, const long *vsh, const long *vst, int H,
                        int Hkv, int D, float scale, float *out) {
    if (G < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 1) return -1;
    int group = H / Hkv, failed = 0, R = tile_rows(D);
    /* A sequence with one new row (a decode step) attends as Hkv tiles, each the `group` query heads
     * that share a key head: each key is read once for them all, not once per head. */
    int by_heads = group > 1 && group <= R;
    int *first = malloc(sizeof(int) * (size_t)(G + 1)), *row0 = malloc(sizeof(int) * (size_t)G); /* items, rows before g */
    if (!first || !row0) {
        free(first);
        free(row0);
        return -1;
    }
    int longest = 0;
    double products = 0;
    first[0] = 0;
    for (int g = 0, r = 0; g < G; r += rows[g], g++) {
        products += (double)rows[g] * (past[g] + rows[g]) * H * D;
        if (rows[g] < 1 || past[g] < 0) failed = 1;
        row0[g] = r;
        first[g + 1] = first[g] + (by_heads && rows[g] == 1 ? Hkv : H * ((rows[g] + R - 1) / R));
        longest = past[g] + rows[g] > longest ? past[g] + rows[g] : longest;
    }
    long stride = (long)longest + VL, osi = (long)H * D;
    if (!failed) {
#pragma omp parallel if (attention_parallel(products))
        {
            scratch mine = scratch_open(stride, R, D, &failed);
            float *scores = mine.scores, *acc = mine.acc;
            int *index = mine.index;
            int g = 0;
#pragma omp for schedule(static)
            for (int item = 0; item < first[G]; item++) {
                if (!scratch_ok(mine)) continue;
                while (item >= first[g + 1]) g++; /* the items run in increasing order within a thread */
                while (item < first[g]) g--;
                int local = item - first[g], T = past[g] + rows[g];
                if (by_heads && rows[g] == 1) { /* key head `local`, its query heads as the tile's rows */
                    int h0 = local * group;
                    const float *qi = q + (size_t)row0[g] * qsi + (size_t)h0 * D;
                    float *o = out + ((size_t)row0[g] * H + h0) * D;
                    const float *kb = k[g] + local * ksh[g], *vb = v[g] + local * vsh[g];
                    attend(D, qi, D, kb, kst[g], vb, vst[g], 0, 0, group, T - 1, 0, T, scale, scores, index, acc, stride, o, D, 0);
                    continue;
                }
                int tiles = (rows[g] + R - 1) / R, h = local / tiles, tile = local % tiles;
                int i0 = tile * R, n = rows[g] - i0 < R ? rows[g] - i0 : R;
                const float *qi = q + (size_t)(row0[g] + i0) * qsi + (size_t)h * D;
                const float *kb = k[g] + (h / group) * ksh[g], *vb = v[g] + (h / group) * vsh[g];
                float *o = out + ((size_t)(row0[g] + i0) * H + h) * D;
                attend(D, qi, qsi, kb, kst[g], vb, vst[g], 0, 0, n, T - rows[g] + i0, 0, T, scale, scores, index, acc, stride,
                       o, osi, 1);
            }
            scratch_close(mine);
        }
    }
    free(first);
    free(row0);
    return failed ? -1 : 0;
}

/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up, n values, 16 at a time (the tail padded).
 * The compact model's gated MLP computes its activation here in every path (the per-layer forward
 * and csrc/stack.c): torch's own silu rounds differently, and the paths must agree bitwise. */
void sg_silu_mul(const float *gate, const float *up, size_t n, float *out) {
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        fvec g = *(const fvec *)(gate + i);
        *(fvec *)(out + i) = g / (1.0f + vexp(-g)) * *(const fvec *)(up + i);
    }
    if (i < n) {
        fvec g = {0}, u = {0};
        for (size_t j = 0; j < n - i; j++) g[j] = gate[i + j], u[j] = up[i + j];
        fvec y = g / (1.0f + vexp(-g)) * u;
        for (size_t j = 0; j < n - i; j++) out[i + j] = y[j];
    }
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
