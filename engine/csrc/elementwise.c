/* Elementwise steps of a decoder layer, one pass each where torch makes several:
 * - silu_mul: silu(gate) * up, reading the gate_up projection's two halves in place (torch:
 *   a silu pass and a multiply pass, each allocating a T x I result);
 * - rotary: the rotary embedding of q and k heads in place, x * cos + rotate_half(x) * sin
 *   (torch: chunk, neg, cat, two multiplies and an add, four T x heads x dim temporaries).
 * On a 2048-token prompt of the 50M benchmark model these were ~7% of the prefill.
 * - write_kv: the step's new K and V rows into their cache slots, both in one call (torch: an
 *   index_put per cache and layer, ~17 us each for a 32-sequence decode step against ~1 us).
 *
 * Rows split over torch's OpenMP team (see paged_attention.c). exp is a polynomial (relative
 * error ~1e-7); rounding otherwise follows torch's order of operations up to FMA contraction. */
#include <math.h>

#include "simd.h"

/* out[t][i] = silu(x[t][i]) * x[t][width + i] for rows of stride ldx (gate, then up). */
void silu_mul(const float *x, int64_t ldx, int64_t rows, int64_t width, float *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if (rows * width >= 65536)
    for (int64_t t = 0; t < rows; ++t) {
        const float *g = x + t * ldx, *u = g + width;
        float *o = out + t * ldo;
        int64_t i = 0;
        for (; i + VW <= width; i += VW) {
            vf gv = *(const vf *)(g + i), uv = *(const vf *)(u + i);
            *(vf *)(o + i) = gv / (1.f + vexp(-gv)) * uv;
        }
        for (; i < width; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* x: rows of `heads` heads of `dim` floats (row stride ldx), rotated in place by the row's
 * cos and sin (rows of dim floats, stride ldc): x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2
 * for the halves x1, x2 (rotate_half's convention). */
void rotary(float *x, int64_t ldx, int64_t rows, int heads, int dim, const float *cos, const float *sin,
            int64_t ldc) {
    const int half = dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * dim >= 65536)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos + t * ldc, *s = sin + t * ldc;
        for (int h = 0; h < heads; ++h) {
            float *a = x + t * ldx + (int64_t)h * dim, *b = a + half;
            int i = 0;
            for (; i + VW <= half; i += VW) {
                vf av = *(vf *)(a + i), bv = *(vf *)(b + i);
                *(vf *)(a + i) = av * *(const vf *)(c + i) - bv * *(const vf *)(s + i);
                *(vf *)(b + i) = bv * *(const vf *)(c + half + i) + av * *(const vf *)(s + half + i);
            }
            for (; i < half; ++i) {
                const float av = a[i], bv = b[i];
                a[i] = av * c[i] - bv * s[i];
                b[i] = bv * c[half + i] + av * s[half + i];
            }
        }
    }
}

/* Per row of logits: the largest value's index (the first, as torch.argmax) and the row's
 * log-sum-exp, in two passes over the row where torch made three and wrote a whole log-softmax:
 * the sampler needs only the chosen tokens' logprobs (logit - lse). 32 rows of a 32000-token
 * vocabulary: ~1.9 ms a decode step with torch. */
void row_argmax_lse(const float *x, int64_t ldx, int64_t rows, int64_t cols, int64_t *arg, float *lse) {
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * ldx;
        int64_t i = 0, best = cols; /* cols: no maximum (a NaN row), token 0 */
        float top = -INFINITY;
        if (cols >= VW) {
            /* Each lane's largest value and the first index it was met at (a strict > keeps the
             * first); the row's first maximum is the lowest such index of the lanes holding the
             * maximum. A scalar scan for it after the max pass took ~0.2 ms of a 32-row step. */
            vf mv = *(const vf *)row;
            vi at = {}, idx = {};
            for (int l = 0; l < VW; ++l) idx[l] = l;
            at = idx;
            for (i = VW; i + VW <= cols; i += VW) {
                const vf xv = *(const vf *)(row + i);
                const vi gt = mv < xv;
                mv = (vf)(((vi)mv & ~gt) | ((vi)xv & gt)); /* vmax, as before: NaN lanes stay */
                at = (at & ~gt) | ((idx + (int32_t)i) & gt);
            }
            top = hmax(mv);
            for (int l = 0; l < VW; ++l)
                if (mv[l] == top && at[l] < best) best = at[l];
        }
        for (; i < cols; ++i) /* the tail, after every vector's index: a tie keeps the earlier */
            if (row[i] > top) {
                top = row[i];
                best = i;
            }
        vf acc = {};
        for (i = 0; i + VW <= cols; i += VW) acc += vexp(*(const vf *)(row + i) - top);
        float sum = hsum(acc);
        for (; i < cols; ++i) sum += expf(row[i] - top);
        arg[r] = best < cols ? best : 0;
        lse[r] = top + logf(sum);
    }
}

/* Row t of k and of v (`width` bytes each, at k + t * ldk and v + t * ldv) into slot
 * (blocks[t], offsets[t]) of k_cache and v_cache, at block * block_stride + offset *
 * token_stride bytes. Byte strides: any dtype. The slots come from the engine's own block
 * tables (never from a request), so they are not bounds-checked here. */
void write_kv(const char *k, int64_t ldk, const char *v, int64_t ldv, int64_t rows, int64_t width,
              char *k_cache, char *v_cache, int64_t block_stride, int64_t token_stride,
              const int64_t *blocks, const int64_t *offsets) {
#pragma omp parallel for schedule(static) if (rows * width >= (1 << 20))
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t at = blocks[t] * block_stride + offsets[t] * token_stride;
        memcpy(k_cache + at, k + t * ldk, (size_t)width);
        memcpy(v_cache + at, v + t * ldv, (size_t)width);
    }
}
