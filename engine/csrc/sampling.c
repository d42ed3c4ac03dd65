/* Random sampling, one row of logits at a time: temperature, top-k, top-p and an inverse-CDF draw
 * in a few passes over the row. torch sorted each top-p row (~1.8 ms for a 32000-token
 * vocabulary: 73 ms of sampling in a 32-sequence decode step whose model ran ~20 ms) and made a
 * pass per op otherwise.
 *
 * top-k and top-p keep every token at or above a cut, and each cut is a selection, not a sort:
 * the largest value v such that the weight of the values >= v reaches a target (a count k for
 * top-k; a share p of the probability mass for top-p). A radix select finds it, three passes
 * over the row, each histogramming one digit of the values' order-preserving bit patterns.
 * That is the sort's rule (keep a token while the mass before it in descending order is below p)
 * except that a tie at the cut keeps all its tokens, where a sort kept whichever came first.
 *
 * Rows split over torch's OpenMP team (see paged_attention.c). */
#include <float.h>
#include <math.h>

#include "simd.h"

/* The bits of a float as an unsigned key in the floats' order (-0 as +0; NaN not handled). */
static inline uint32_t order_key(float f) {
    uint32_t b;
    if (f == 0.f) f = 0.f;
    memcpy(&b, &f, sizeof b);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static inline float key_value(uint32_t k) {
    uint32_t b = (k & 0x80000000u) ? k & 0x7fffffffu : ~k;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

typedef uint32_t vu __attribute__((vector_size(VW * 4), aligned(4)));

/* order_key lane by lane: -0 + 0 is +0, and a negative's arithmetic shift is all ones. */
static inline vu order_keys(vf v) {
    const vi b = (vi)(v + 0.f);
    return (vu)(b ^ ((b >> 31) | ((vi){} + INT32_MIN)));
}

static inline int any_lane(vi m) {
    uint64_t a[VW / 2], acc = 0;
    memcpy(a, &m, sizeof a);
    for (int j = 0; j < VW / 2; ++j) acc |= a[j];
    return acc != 0;
}

/* Adds w[i] (1 when w is NULL) to hist[digit of y[i]'s key] for the y[i] whose key has the digits
 * chosen so far (prefix, under the mask `fixed`) and whose weight is at least w_min (> 0). Past the
 * first digit few values qualify, and whole vectors without one are skipped. */
static void histogram(const float *y, const float *w, float w_min, int64_t n, uint32_t prefix, uint32_t fixed,
                      int shift, uint32_t mask, double *hist) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vu k = order_keys(*(const vf *)(y + i));
        vi hit = (vi)((k & fixed) == prefix);
        if (w) hit &= (vi)(*(const vf *)(w + i) >= w_min);
        if (!any_lane(hit)) continue;
        uint32_t ks[VW];
        int32_t hs[VW];
        memcpy(ks, &k, sizeof ks);
        memcpy(hs, &hit, sizeof hs);
        for (int j = 0; j < VW; ++j)
            if (hs[j]) hist[(ks[j] >> shift) & mask] += w ? (double)w[i + j] : 1.0;
    }
    for (; i < n; ++i) {
        const uint32_t k = order_key(y[i]);
        if ((k & fixed) == prefix && (!w || w[i] >= w_min)) hist[(k >> shift) & mask] += w ? (double)w[i] : 1.0;
    }
}

/* The largest value v of y such that the weight of y's values >= v reaches `target`: weight w[i]
 * (entries of weight 0 never chosen), or 1 each when w is NULL. Should the whole weight fall
 * short of the target (rounding), the smallest weighted value: everything is kept. Three
 * digits of the key, most significant first: 11, 11 and 10 bits.
 * Weights: `total` is their sum. Values lighter than half of (total - target) / n are passed
 * over: all of them together weigh less than total - target, so the values above them already
 * reach the target and the cut lies above them. A real model's distribution is peaked, and most
 * of its vocabulary is that light. */
static float select_cut(const float *y, const float *w, int64_t n, double target, double total) {
    static const int shifts[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
    double hist[2048];
    const float w_min = fmaxf((float)(0.5 * (total - target) / (double)n), FLT_MIN);
    uint32_t prefix = 0, fixed = 0; /* the digits chosen so far, and the mask of their bits */
    for (int level = 0; level < 3; ++level) {
        const int shift = shifts[level], nb = 1 << bits[level];
        const uint32_t mask = (uint32_t)(nb - 1);
        memset(hist, 0, sizeof(double) * (size_t)nb);
        histogram(y, w, w_min, n, prefix, fixed, shift, mask, hist);
        int digit = -1, lowest = -1;
        double above = 0.0;
        for (int d = nb - 1; d >= 0; --d) {
            if (!(hist[d] > 0.0)) continue;
            lowest = d;
            if (above + hist[d] >= target) {
                digit = d;
                break;
            }
            above += hist[d];
        }
        if (lowest < 0) return -INFINITY; /* nothing weighted at all */
        if (digit < 0) { /* short of the target (rounding): keep the whole lowest bucket */
            digit = lowest;
            above -= hist[lowest];
        }
        prefix |= (uint32_t)digit << shift;
        fixed |= mask << shift;
        target -= above;
    }
    return key_value(prefix);
}

/* e[i] = exp(y[i] - top), or 0 where y[i] < cut (-inf logits always), and their sum. The sum
 * runs as invert() walks it (block sums of VW, then the tail), so that the walk reaches it. */
static double weigh(const float *y, float *e, int64_t n, float top, float cut) {
    double z = 0.0;
    int64_t i = 0;
    cut = fmaxf(cut, -FLT_MAX);
    for (; i + VW <= n; i += VW) {
        const vf v = *(const vf *)(y + i);
        const vf ev = (vf)((vi)vexp(v - top) & (v >= cut));
        *(vf *)(e + i) = ev;
        z += hsum(ev);
    }
    for (; i < n; ++i) {
        e[i] = y[i] >= cut ? expf(y[i] - top) : 0.f;
        z += e[i];
    }
    return z;
}

/* Zero e[i] where y[i] < cut; the sum of what is left, summed as weigh() sums. */
static double trim(const float *y, float *e, int64_t n, float cut) {
    double z = 0.0;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf ev = (vf)((vi) * (const vf *)(e + i) & (*(const vf *)(y + i) >= cut));
        *(vf *)(e + i) = ev;
        z += hsum(ev);
    }
    for (; i < n; ++i) {
        e[i] = y[i] >= cut ? e[i] : 0.f;
        z += e[i];
    }
    return z;
}

/* The first index whose running sum of e passes t (e sums to z); past the end, which rounding
 * can cause, the last index with any weight. Blocks of VW are skipped whole by their sums. */
static int64_t invert(const float *e, int64_t n, double t) {
    double acc = 0.0;
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const double block = hsum(*(const vf *)(e + i));
        if (acc + block > t) break;
        acc += block;
    }
    for (; i < n; ++i) {
        acc += e[i];
        if (acc > t && e[i] > 0.f) return i;
    }
    for (i = n - 1; i > 0 && !(e[i] > 0.f); --i) {}
    return i;
}

/* For each of `rows` rows (row rows[r] of x, stride ldx): divide by temp[r], keep the top_k[r]
 * largest (0: all) and then the top_p[r] share of the mass (1: all), and draw the token at u[r]
 * (uniform in [0, 1)) of the kept tokens' cumulative distribution, in vocabulary order, into
 * out[r]. scratch: 2 * cols floats per row. A row of -inf or NaN logits draws token 0. */
void sample_rows(const float *x, int64_t ldx, const int64_t *rows, int64_t num_rows, int64_t cols,
                 const float *temp, const int64_t *top_k, const float *top_p, const double *u,
                 float *scratch, int64_t *out) {
#pragma omp parallel for schedule(dynamic, 1) if (num_rows * cols >= 65536)
    for (int64_t r = 0; r < num_rows; ++r) {
        const float *xr = x + rows[r] * ldx;
        float *y = scratch + r * 2 * cols, *e = y + cols;
        const float t = temp[r];
        float top = -INFINITY;
        int64_t i = 0;
        for (; i + VW <= cols; i += VW) {
            const vf v = *(const vf *)(xr + i) / t; /* a division, as torch's, not a multiply */
            *(vf *)(y + i) = v;
            top = fmaxf(top, hmax(v));
        }
        for (; i < cols; ++i) {
            y[i] = xr[i] / t;
            top = fmaxf(top, y[i]);
        }
        if (top == INFINITY) { /* a temperature so small that logits overflowed: the limit, the first largest */
            int64_t best = 0;
            for (int64_t j = 1; j < cols; ++j) best = xr[j] > xr[best] ? j : best;
            out[r] = best;
            continue;
        }
        if (!isfinite(top)) {
            out[r] = 0;
            continue;
        }
        float cut = -INFINITY;
        if (top_k[r] > 0 && top_k[r] < cols) cut = select_cut(y, NULL, cols, (double)top_k[r], 0.0);
        double z = weigh(y, e, cols, top, cut);
        if (top_p[r] < 1.f) z = trim(y, e, cols, select_cut(y, e, cols, (double)top_p[r] * z, z));
        out[r] = invert(e, cols, u[r] * z);
    }
}
