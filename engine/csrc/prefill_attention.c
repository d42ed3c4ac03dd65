/* Causal attention of a prompt or a chunk of one: n new query tokens over the prefix cached
 * before them and themselves. Flash-style: one task per query head and block of QB query tokens,
 * keys in tiles of KB with an online softmax.
 *
 * Why not torch's CPU flash kernel: its QK^T and PV are GEMMs with an inner dimension of the
 * head size (64), where the library runs at a fraction of its large-GEMM rate; on the 50M
 * benchmark model a 2048-token prompt spent 54% of its prefill there (40 ms a layer, ~107
 * GFLOP/s on 2 AVX-512 cores). Here both products are register-blocked for that shape: scores
 * take R query rows x NV vectors of keys from a transposed copy of K (one per call), and the
 * output takes R rows x NV vectors of the head dimension, broadcasting each probability.
 * On the diagonal, each group of R query rows computes only the key vectors its last row may see,
 * and a prompt's last, partial block only its own rows: on a 512-token prompt of the 50M model,
 * a full-tile kernel computed 24% more scores than the causal mask keeps, and this one ran 10%
 * faster (1.75 against 1.94 ms a layer; 128 tokens: 17%; 2048: 2%).
 *
 * Vector width follows the build (simd.h): 16 floats with AVX-512, else 8. The head size must
 * be a multiple of it (prefill_attention_limits); the engine uses torch elsewhere.
 * Built and loaded by engine/kernels.py; it shares torch's OpenMP team (see paged_attention.c). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if VW == 16
#define NV 4
#else
#define NV 2
#endif
/* Query rows per register block: 6 rows x NV vectors of accumulators (24 of AVX-512's 32
 * registers, 12 of AVX2's 16). With 4 rows each step loaded as much as it multiplied, and one
 * core reached 59 GFLOP/s against 113 with 6 (the 50M model's head size, 64). */
#define R 6
#define QB 48 /* query tokens per task (a multiple of R) */
#define KB 64 /* keys per tile (a multiple of NV x VW) */
#define MAX_D 256

/* s[r0 .. r0 + R][j0 : j0 + W x VW] = qb[r0 .. r0 + R][dim] . kt[dim][j0 : j0 + W x VW] for one
 * register block; W is a constant at each call (see ACCUMULATE_BLOCK). */
#define SCORES_BLOCK(W)                                                                           \
    do {                                                                                          \
        vf acc[R][W];                                                                             \
        for (int r = 0; r < R; ++r)                                                               \
            for (int v = 0; v < W; ++v) acc[r][v] = (vf){};                                       \
        for (int d = 0; d < dim; ++d) {                                                           \
            vf kv[W];                                                                             \
            for (int v = 0; v < W; ++v) kv[v] = *(const vf *)(kt + d * ld + j0 + v * VW);         \
            for (int r = 0; r < R; ++r) {                                                         \
                const float qv = qb[(r0 + r) * dim + d];                                          \
                for (int v = 0; v < W; ++v) acc[r][v] += qv * kv[v];                              \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; ++r)                                                               \
            for (int v = 0; v < W; ++v) *(vf *)(s + (r0 + r) * KB + j0 + v * VW) = acc[r][v];    \
    } while (0)

/* s[QB][KB] = qb[QB][dim] . kt[dim][kt0 : kt0 + KB] (kt rows of stride ld), for the first
 * `groups` row groups of R, group g over its first vecs[g] vectors of keys: the columns past
 * them are keys no row of the group may see (the causal mask), left unwritten. */
static void scores(const float *qb, const float *kt, int64_t ld, int dim, int groups, const int *vecs, float *s) {
    for (int g = 0; g < groups; ++g) {
        const int r0 = g * R;
        for (int v0 = 0; v0 < vecs[g]; v0 += NV) {
            const int j0 = v0 * VW;
            switch (vecs[g] - v0 < NV ? vecs[g] - v0 : NV) {
            case 1: SCORES_BLOCK(1); break;
#if NV == 4
            case 2: SCORES_BLOCK(2); break;
            case 3: SCORES_BLOCK(3); break;
#endif
            default: SCORES_BLOCK(NV); break;
            }
        }
    }
}

/* o[rows r0.. r0 + R][d0 .. d0 + W x VW] += p . vt for one register block; W is a constant at
 * each call, so the accumulators stay in registers (a run-time count spilled them to the stack,
 * and the copies took a fifth of the time). */
#define ACCUMULATE_BLOCK(W)                                                                       \
    do {                                                                                          \
        vf acc[R][W];                                                                             \
        for (int r = 0; r < R; ++r)                                                               \
            for (int v = 0; v < W; ++v) acc[r][v] = *(vf *)(o + (r0 + r) * dim + d0 + v * VW);    \
        for (int j = 0; j < keys; ++j) {                                                          \
            vf vv[W];                                                                             \
            for (int v = 0; v < W; ++v) vv[v] = *(const vf *)(vt + j * ld + d0 + v * VW);         \
            for (int r = 0; r < R; ++r) {                                                         \
                const float pv = p[(r0 + r) * KB + j];                                            \
                for (int v = 0; v < W; ++v) acc[r][v] += pv * vv[v];                              \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; ++r)                                                               \
            for (int v = 0; v < W; ++v) *(vf *)(o + (r0 + r) * dim + d0 + v * VW) = acc[r][v];    \
    } while (0)

/* o[QB][dim] += p[QB][keys] . vt[keys][dim] (vt rows of stride ld), for the first `groups` row
 * groups of R, group g over its first keys[g] keys. */
static void accumulate(const float *p, const float *vt, int64_t ld, int dim, int groups, const int *nkeys, float *o) {
    for (int g = 0; g < groups; ++g) {
        const int r0 = g * R, keys = nkeys[g];
        int d0 = 0;
        for (; d0 + NV * VW <= dim; d0 += NV * VW) ACCUMULATE_BLOCK(NV);
        for (; d0 < dim; d0 += VW) ACCUMULATE_BLOCK(1);
    }
}

/* One query head h over query tokens [q0, q0 + rows) of n, which sit at key positions
 * prefix + q0 ... (nk = prefix + n keys in all). */
static void task(const float *q, int64_t q_ld, const float *kt, const float *v, int64_t n, int64_t prefix, int64_t nk_pad,
                 int heads, int kv_heads, int dim, float scale, int h, int64_t q0, float *out) {
    const int64_t nk = prefix + n;
    const int kh = h / (heads / kv_heads);
    const int rows = (int)(n - q0 < QB ? n - q0 : QB);
    float qb[QB * MAX_D], o[QB * MAX_D], s[QB * KB], m[QB];
    vf lv[QB]; /* each row's running sum, lane by lane: reduced once, at the end */
    const float qscale = scale * 1.4426950408889634f; /* log2(e): softmax in base 2 */
    for (int i = 0; i < QB; ++i) {
        for (int d = 0; d < dim; ++d) qb[i * dim + d] = i < rows ? q[(q0 + i) * q_ld + h * dim + d] * qscale : 0.f;
        m[i] = -INFINITY;
        lv[i] = (vf){};
    }
    memset(o, 0, sizeof(float) * QB * dim);
    const float *ktk = kt + (int64_t)kh * dim * nk_pad; /* its tiles, each [dim][KB] */
    const float *vk = v + (int64_t)kh * dim * nk_pad; /* its rows, [nk_pad][dim] */
    const int64_t vld = dim;
    const int groups = (rows + R - 1) / R; /* row groups holding this task's rows */
    for (int64_t k0 = 0; k0 < prefix + q0 + rows; k0 += KB) {
        const int keys = (int)(nk - k0 < KB ? nk - k0 : KB);
        int vecs[QB / R], gkeys[QB / R];
        for (int g = 0; g < groups; ++g) { /* the keys the group's last row sees in this tile */
            const int last_row = (g + 1) * R < rows ? (g + 1) * R - 1 : rows - 1;
            const int64_t seen = prefix + q0 + last_row - k0 + 1;
            gkeys[g] = (int)(seen < 0 ? 0 : seen < keys ? seen : keys); /* 0: the tile is past them all */
            vecs[g] = (gkeys[g] + VW - 1) / VW;
        }
        scores(qb, ktk + k0 * dim, KB, dim, groups, vecs, s);
        for (int i = 0; i < rows; ++i) {
            float *si = s + i * KB;
            const int width = vecs[i / R] * VW; /* the columns computed for this row */
            if (width == 0)
                continue; /* nothing to see here: its p is never read (accumulate takes no keys) */
            const int64_t last = prefix + q0 + i - k0; /* keys past this row's own token are masked */
            if (last < width - 1 || keys < width)
                for (int j = 0; j < width; ++j)
                    if (j > last || j >= keys) si[j] = -INFINITY;
            vf mv = *(vf *)si;
            for (int j = VW; j < width; j += VW) mv = vmax(mv, *(vf *)(si + j));
            const float mx = hmax(mv);
            if (mx > m[i]) { /* a new row maximum: rescale what was summed against the old one */
                const float alpha = m[i] == -INFINITY ? 0.f : exp2f(m[i] - mx);
                m[i] = mx;
                lv[i] *= alpha;
                for (int d = 0; d < dim; ++d) o[i * dim + d] *= alpha;
            }
            vf sum = (vf){};
            for (int j = 0; j < width; j += VW) {
                vf e = vexp2(*(vf *)(si + j) - m[i]);
                *(vf *)(si + j) = e;
                sum += e;
            }
            lv[i] += sum;
        }
        for (int i = rows; i < groups * R; ++i) memset(s + i * KB, 0, sizeof(float) * KB);
        accumulate(s, vk + k0 * vld, vld, dim, groups, gkeys, o);
    }
    for (int i = 0; i < rows; ++i) {
        const float inv = 1.f / hsum(lv[i]);
        float *dst = out + ((q0 + i) * heads + h) * dim;
        for (int d = 0; d < dim; ++d) dst[d] = o[i * dim + d] * inv;
    }
}

/* q: [n, heads, dim], token rows q_ld floats apart; k, v: [prefix + n, kv_heads, dim] (the cached
 * prefix, then the new tokens), rows kv_ld floats apart (views into a fused QKV projection's
 * output need no copy); out: [n, heads, dim], contiguous. Returns 0, or -1 when the scratch
 * copies of K and V could not be allocated. */
int causal_prefill_attention(const float *q, int64_t q_ld, const float *k, const float *v, int64_t kv_ld, int64_t n,
                             int64_t prefix, int heads, int kv_heads, int dim, float scale, float *out) {
    const int64_t nk = prefix + n, n_pad = (nk + KB - 1) / KB * KB;
    float *kt = aligned_alloc(64, 2 * sizeof(float) * (size_t)kv_heads * dim * n_pad + 64);
    if (kt == NULL) return -1;
    float *vp = kt + (size_t)kv_heads * dim * n_pad;
    /* K transposed per KV head in tiles of KB keys ([dim][KB] each, contiguous; zero past the
     * last key) so that scores read keys as vectors. One transposed [dim][n] per head put its
     * rows 4n bytes apart: with n a power of two they shared a few L1 sets, and the tile's rows
     * evicted each other. V is copied per KV head too ([n_pad][dim] each), for the same reason:
     * in place, a tile's rows lie kv_heads x dim x 4 bytes apart (1 KiB on the 50M model), so its
     * 64 rows of 4 lines each fell into 16 of L1's 64 sets. Copied, the kernel ran 3.5% faster
     * on a 2048-token prompt. */
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < (int64_t)kv_heads * (n_pad / KB); ++blk) {
        const int kh = (int)(blk / (n_pad / KB));
        const int64_t t0 = (blk % (n_pad / KB)) * KB;
        float *dst = kt + (int64_t)kh * dim * n_pad + t0 * dim;
        for (int64_t t = t0; t < t0 + KB; ++t)
            for (int d = 0; d < dim; ++d) dst[d * KB + (t - t0)] = t < nk ? k[t * kv_ld + kh * dim + d] : 0.f;
        float *vdst = vp + (int64_t)kh * dim * n_pad + t0 * dim;
        for (int64_t t = t0; t < t0 + KB; ++t)
            for (int d = 0; d < dim; ++d) vdst[(t - t0) * dim + d] = t < nk ? v[t * kv_ld + kh * dim + d] : 0.f;
    }
    const int64_t blocks = (n + QB - 1) / QB; /* of queries */
    /* Latest query blocks first: they attend to the most keys, and dynamic scheduling then
     * fills the end of the loop with the short ones. */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < blocks * heads; ++t) {
        const int64_t qblk = blocks - 1 - t / heads;
        task(q, q_ld, kt, vp, n, prefix, n_pad, heads, kv_heads, dim, scale, (int)(t % heads), qblk * QB, out);
    }
    free(kt);
    return 0;
}

void prefill_attention_limits(int *vector_width, int *max_dim) {
    *vector_width = VW;
    *max_dim = MAX_D;
}
