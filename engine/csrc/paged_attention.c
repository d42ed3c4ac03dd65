/* Decode attention straight from the paged KV pool: one query token per sequence, its keys and
 * values read block by block where they lie, with no gathered copy and no padding mask.
 *
 * One task per sequence (or per part of its KV heads). Each cached block is read once, front to
 * back (it is contiguous: tokens x KV heads x dim), and softmax is online (running max and sum
 * per query head), rescaled once per block.
 *
 * Where the vectors divide the head size (task_vec), a block's scores for VW tokens of one query
 * head are VW vector dot products folded into one vector by a halving tree of two-vector shuffles
 * (VW - 1 shuffle pairs, against a horizontal sum per token), its softmax runs a vector at a
 * time with simd.h's exp, and each query head's output accumulates in registers over the block
 * (the head size a compile-time constant of the instance). It replaced a loop with one reduction
 * per (token, head), scalar expf and the output row loaded and stored per token: on a 2-core
 * Xeon (AVX-512), the 50M model's attention for 32 sequences of 576 tokens took 23 ms a step,
 * 10 GB/s of KV against the 23 GB/s the machine reads. Other head sizes keep that loop
 * (task_scalar). Stack use: acc is MAX_H x MAX_D floats (128 KiB at the limits).
 *
 * Built and loaded by engine/kernels.py with -fopenmp; loaded after torch, it shares torch's
 * OpenMP runtime (same soname), so its team is torch's team and obeys torch.set_num_threads. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_H 128
#define MAX_D 256
#define MAX_BS 64

#define MAX_G 16 /* query heads per KV head on the vector path */

/* The halving tree's shuffles, level by level, as constants: a mask read from an array indexed
 * by the level compiled to a lane-by-lane shuffle with AVX2 (3-4x slower than the old kernel). */
#if VW == 16
#define FOLD_LO0 ((vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})
#define FOLD_HI0 ((vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31})
#define FOLD_LO1 ((vi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27})
#define FOLD_HI1 ((vi){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31})
#define FOLD_LO2 ((vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29})
#define FOLD_HI2 ((vi){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31})
#define FOLD_LO3 ((vi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30})
#define FOLD_HI3 ((vi){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31})
#define LANE_ROW ((vi){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15})
#else
#define FOLD_LO0 ((vi){0, 1, 2, 3, 8, 9, 10, 11})
#define FOLD_HI0 ((vi){4, 5, 6, 7, 12, 13, 14, 15})
#define FOLD_LO1 ((vi){0, 1, 8, 9, 4, 5, 12, 13})
#define FOLD_HI1 ((vi){2, 3, 10, 11, 6, 7, 14, 15})
#define FOLD_LO2 ((vi){0, 8, 2, 10, 4, 12, 6, 14})
#define FOLD_HI2 ((vi){1, 9, 3, 11, 5, 13, 7, 15})
#define LANE_ROW ((vi){0, 4, 2, 6, 1, 5, 3, 7})
#endif

#define FOLD(level, n)                                                                                  \
    for (int i = 0; i < (n) / 2; ++i)                                                                  \
        p[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], FOLD_LO##level) +                             \
               __builtin_shuffle(p[2 * i], p[2 * i + 1], FOLD_HI##level)

/* The sums of VW vectors as one vector: pairs fold into one (each keeps half its lanes, summed
 * with the other half), level by level. Lane i ends with the sum of vector LANE_ROW[i] (the
 * bit-reversed i). p is overwritten. */
static inline vf fold_sums(vf *p) {
    FOLD(0, VW);
    FOLD(1, VW / 2);
    FOLD(2, VW / 4);
#if VW == 16
    FOLD(3, 2);
#endif
    return p[0];
}

/* The tokens [lo, hi) of block blk that lie in [start, len). */
static inline void block_span(int64_t blk, int block_size, int64_t start, int64_t len, int *lo, int *hi) {
    const int64_t b0 = blk * block_size, b1 = b0 + block_size;
    *lo = (int)((start > b0 ? start : b0) - b0);
    *hi = (int)((len < b1 ? len : b1) - b0);
}

/* Loads and stores through a vector type that may alias floats: memcpy of a 32-byte vector
 * compiled (AVX2) to 16-byte copies through the stack, which kept the output accumulators in
 * memory too (the kernel 3-4x slower than the scalar loop it replaced). */
typedef float vf_alias __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf vload(const float *p) { return *(const vf_alias *)p; }
static inline void vstore(float *p, vf v) { *(vf_alias *)p = v; }

/* One task on the vector path, for NC = dim / VW vectors a head (a constant where it is
 * inlined, and its loops unrolled, so the query and the output accumulators stay in registers:
 * without the unrolling, 32 sequences' attention took 1.6x as long). Scores are in base 2
 * (scale x log2 e), for vexp2. */
static inline __attribute__((always_inline)) void task_vec(
    const int NC, const float *qb, const float *k_cache, const float *v_cache, int64_t block_stride,
    int64_t token_stride, int64_t head_stride, const int64_t *table, int64_t start, int64_t len, int groups,
    int block_size, int kh0, int kh1, float scale2, float *ob, int64_t after, float *part) {
    const int dim = NC * VW;
    float m[MAX_H], l[MAX_H], acc[MAX_H * MAX_D];
    for (int h = kh0 * groups; h < kh1 * groups; ++h) { m[h] = -INFINITY; l[h] = 0.f; }
    memset(acc + kh0 * groups * dim, 0, sizeof(float) * (kh1 - kh0) * groups * dim);
    for (int64_t blk = start / block_size; blk * block_size < len; ++blk) {
        const int64_t id = table[blk];
        /* The sequence's next block lies anywhere in the pool, where no hardware prefetcher
         * follows. Its keys and values are prefetched into L2 while this block is worked on, a
         * share per KV head, a few lines per value row (a burst of a share's 128 lines filled the
         * miss buffers and stalled the loads behind it). Measured on a 2-core AMD EPYC
         * (AVX-512), the 50M model's 8 layers for 32 sequences of 192 tokens on scattered
         * blocks: 8.0-8.5 -> 5.2-5.7 ms a step (a share in one burst: 6.1-6.4 ms; two blocks
         * ahead: no better). */
        /* After the sequence's last block comes `after`, where there is one (the next task's
         * first block). */
        const int more = (blk + 1) * block_size < len;
        const int last = !more && after < 0; /* nothing to prefetch */
        const int64_t next = more ? table[blk + 1] : after;
        const int64_t share = last ? 0 : (int64_t)block_size * token_stride * (int64_t)sizeof(float) / (kh1 - kh0);
        const char *const next_k = (const char *)(k_cache + next * block_stride);
        const char *const next_v = (const char *)(v_cache + next * block_stride);
        int lo, hi;
        block_span(blk, block_size, start, len, &lo, &hi);
        for (int kh = kh0; kh < kh1; ++kh) {
            const float *kb = k_cache + id * block_stride + kh * head_stride;
            const float *vb = v_cache + id * block_stride + kh * head_stride;
            const char *pk = next_k + (kh - kh0) * share, *pv = next_v + (kh - kh0) * share;
            const char *const pend = pk + share;
            for (int g = 0; g < groups; ++g) {
                const int h = kh * groups + g;
                vf q[NC];
#pragma GCC unroll 16
                for (int c = 0; c < NC; ++c) q[c] = vload(qb + h * dim + c * VW) * scale2;
                /* Scores, VW tokens a vector, kept in registers through the softmax and the
                 * values in the fold's lane order: lane i of vector j is token lo + j * VW +
                 * LANE_ROW[i]; lanes past the block's end hold -inf. They went through an array
                 * in token order before, VW scalar stores under each vector load (which the
                 * stores cannot forward to): 32 sequences of 192 tokens on the 50M model took
                 * 0.76-0.92x the time for their 8 layers' attention (2-core AMD EPYC, AVX-512,
                 * KV evicted between calls), one of 512 tokens 1.02-1.07x (a few us). Taking the
                 * values in token order, each probability its lane's, ran 32 sequences 5-11%
                 * slower. */
                vf sv[MAX_BS / VW];
                const int nv = (hi - lo + VW - 1) / VW;
                for (int j = 0; j < nv; ++j) {
                    const int t0 = lo + j * VW;
                    vf part[VW];
#pragma GCC unroll 16
                    for (int i = 0; i < VW; ++i) {
                        vf a = {}, b = {};
                        if (t0 + i < hi) {
                            const float *kt = kb + (t0 + i) * token_stride;
#pragma GCC unroll 16
                            for (int c = 0; c + 1 < NC; c += 2) {
                                a += q[c] * vload(kt + c * VW);
                                b += q[c + 1] * vload(kt + (c + 1) * VW);
                            }
                            if (NC & 1) a += q[NC - 1] * vload(kt + (NC - 1) * VW);
                        }
                        part[i] = a + b;
                    }
                    const vi valid = LANE_ROW < (hi - t0);
                    sv[j] = (vf)(((vi)fold_sums(part) & valid) | ((vi)((vf){} - INFINITY) & ~valid));
                }
                /* Online softmax over the block. */
                vf vmx = sv[0];
                for (int j = 1; j < nv; ++j) vmx = vmax(vmx, sv[j]);
                const float bmax = hmax(vmx), mnew = bmax > m[h] ? bmax : m[h];
                const float corr = m[h] == -INFINITY ? 0.f : exp2f(m[h] - mnew);
                vf vsum = {};
                for (int j = 0; j < nv; ++j) {
                    const vi valid = LANE_ROW < (hi - lo - j * VW);
                    sv[j] = (vf)((vi)vexp2(sv[j] - mnew) & valid); /* padding lanes: exactly 0 */
                    vsum += sv[j];
                }
                l[h] = l[h] * corr + hsum(vsum);
                m[h] = mnew;
                /* Values: the head's output in registers over the block. */
                float *ah = acc + h * dim;
                vf o[NC];
#pragma GCC unroll 16
                for (int c = 0; c < NC; ++c) o[c] = vload(ah + c * VW) * corr;
                for (int j = 0; j < nv; ++j) {
                    const int t0 = lo + j * VW, full = t0 + VW <= hi;
#pragma GCC unroll 16
                    for (int i = 0; i < VW; ++i) { /* lane by lane: tokens in the fold's order */
                        const int t = t0 + LANE_ROW[i];
                        if (!full && t >= hi) continue;
                        const float p = sv[j][i];
                        const float *vt = vb + t * token_stride;
                        if (pk < pend) {
                            __builtin_prefetch(pk, 0, 2);
                            __builtin_prefetch(pk + 64, 0, 2);
                            __builtin_prefetch(pv, 0, 2);
                            __builtin_prefetch(pv + 64, 0, 2);
                            pk += 128;
                            pv += 128;
                        }
#pragma GCC unroll 16
                        for (int c = 0; c < NC; ++c) o[c] += p * vload(vt + c * VW);
                    }
                }
#pragma GCC unroll 16
                for (int c = 0; c < NC; ++c) vstore(ah + c * VW, o[c]);
            }
            for (; pk < pend; pk += 64, pv += 64) { /* what the rows left (short blocks, few heads) */
                __builtin_prefetch(pk, 0, 2);
                __builtin_prefetch(pv, 0, 2);
            }
        }
    }
    if (part != NULL) { /* a part of the context: its unnormalized output, maximum and sum */
        for (int h = kh0 * groups; h < kh1 * groups; ++h) {
            memcpy(part + h * (dim + 2), acc + h * dim, sizeof(float) * dim);
            part[h * (dim + 2) + dim] = m[h];
            part[h * (dim + 2) + dim + 1] = l[h];
        }
        return;
    }
    for (int h = kh0 * groups; h < kh1 * groups; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int d = 0; d < dim; ++d) ob[h * dim + d] = acc[h * dim + d] * inv;
    }
}

/* One sequence's output from its context parts (task_vec's `part`: per head, dim unnormalized
 * sums, then the base-2 maximum and the sum of weights), as one softmax over them all. */
static void merge_parts(const float *parts, int nparts, int heads, int dim, float *ob) {
    for (int h = 0; h < heads; ++h) {
        float mx = -INFINITY, sum = 0.f;
        for (int p = 0; p < nparts; ++p) {
            const float mp = parts[((int64_t)p * heads + h) * (dim + 2) + dim];
            mx = mp > mx ? mp : mx;
        }
        for (int d = 0; d < dim; ++d) ob[h * dim + d] = 0.f;
        for (int p = 0; p < nparts; ++p) {
            const float *ph = parts + ((int64_t)p * heads + h) * (dim + 2);
            if (ph[dim] == -INFINITY) continue; /* an empty part */
            const float w = exp2f(ph[dim] - mx);
            sum += ph[dim + 1] * w;
            for (int d = 0; d < dim; ++d) ob[h * dim + d] += ph[d] * w;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int d = 0; d < dim; ++d) ob[h * dim + d] *= inv;
    }
}

/* One task on the scalar path (any head size). */
static void task_scalar(const float *qb, const float *k_cache, const float *v_cache, int64_t block_stride,
                        int64_t token_stride, int64_t head_stride, const int64_t *table, int64_t start, int64_t len,
                        int groups, int dim, int block_size, int kh0, int kh1, float scale, float *ob) {
    const int h0 = kh0 * groups, h1 = kh1 * groups; /* this task's query heads */
    float m[MAX_H], l[MAX_H], acc[MAX_H * MAX_D], s[MAX_H * MAX_BS];
    for (int h = h0; h < h1; ++h) { m[h] = -INFINITY; l[h] = 0.f; }
    memset(acc + h0 * dim, 0, sizeof(float) * (h1 - h0) * dim);
    for (int64_t blk = start / block_size; blk * block_size < len; ++blk) {
        const int64_t id = table[blk];
        const float *kb = k_cache + id * block_stride, *vb = v_cache + id * block_stride;
        int lo, hi;
        block_span(blk, block_size, start, len, &lo, &hi);
        /* Scores, walking the block's K in memory order: token, then KV head, then its queries. */
        for (int t = lo; t < hi; ++t) {
            for (int kh = kh0; kh < kh1; ++kh) {
                const float *kt = kb + t * token_stride + kh * head_stride;
                for (int g = 0; g < groups; ++g) {
                    const int h = kh * groups + g;
                    const float *qh = qb + h * dim;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < dim; ++d) dot += qh[d] * kt[d];
                    s[h * block_size + t] = dot * scale;
                }
            }
        }
        /* Online softmax: rescale each head's running sum and output once per block. */
        for (int h = h0; h < h1; ++h) {
            float bmax = -INFINITY;
            for (int t = lo; t < hi; ++t) bmax = s[h * block_size + t] > bmax ? s[h * block_size + t] : bmax;
            const float mnew = bmax > m[h] ? bmax : m[h];
            const float corr = expf(m[h] - mnew); /* 0 on the first block (m = -inf) */
            float sum = 0.f;
            for (int t = lo; t < hi; ++t) {
                const float p = expf(s[h * block_size + t] - mnew);
                s[h * block_size + t] = p;
                sum += p;
            }
            l[h] = l[h] * corr + sum;
            m[h] = mnew;
            float *ah = acc + h * dim;
#pragma omp simd
            for (int d = 0; d < dim; ++d) ah[d] *= corr;
        }
        /* Values, in memory order again. */
        for (int t = lo; t < hi; ++t) {
            for (int kh = kh0; kh < kh1; ++kh) {
                const float *vt = vb + t * token_stride + kh * head_stride;
                for (int g = 0; g < groups; ++g) {
                    const int h = kh * groups + g;
                    const float p = s[h * block_size + t];
                    float *ah = acc + h * dim;
#pragma omp simd
                    for (int d = 0; d < dim; ++d) ah[d] += p * vt[d];
                }
            }
        }
    }
    for (int h = h0; h < h1; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int d = 0; d < dim; ++d) ob[h * dim + d] = acc[h * dim + d] * inv;
    }
}

/* A task's context: the tokens of a sequence of `len` it attends to, [*start, *end), its part `p` of
 * `parts` (whole blocks each; an empty range where the sequence has fewer blocks than parts). */
static void task_span(int64_t len, int64_t window, int block_size, int p, int parts, int64_t *start,
                      int64_t *end) {
    const int64_t s = (window > 0 && len > window) ? len - window : 0;
    const int64_t b0 = s / block_size, nb = (len + block_size - 1) / block_size - b0;
    const int64_t lo = (b0 + nb * p / parts) * block_size, hi = (b0 + nb * (p + 1) / parts) * block_size;
    *start = lo > s ? lo : s;
    *end = hi < len ? hi : len;
}

void paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            int64_t block_stride, int64_t token_stride, int64_t head_stride,
                            const int64_t *tables, int64_t table_stride, const int64_t *lens,
                            int batch, int heads, int kv_heads, int dim, int block_size, int64_t window,
                            float scale, float *out) {
    const int groups = heads / kv_heads;
    const int nc = dim % VW == 0 && groups <= MAX_G ? dim / VW : 0;
    /* One task per sequence, reading each block front to back. With fewer sequences than
     * threads, each sequence is split too, so a lone stream keeps every thread busy: on the
     * vector path its context, in runs of whole blocks, whose partial softmaxes are merged
     * after (flash decoding). Before that, and still on the scalar path, its KV heads (0.52 ->
     * 0.36 ms per step of the 50M model on 2 threads), each block read in strided halves: the
     * context's halves took 0.65x the time for the 8 layers of a lone 2048-token stream on 2
     * threads (1.36 -> 0.89 ms, KV evicted between calls; 2-core AMD EPYC), 0.95x at 192
     * tokens, a few microseconds more at 20 (two blocks, and the merge). Splitting KV
     * heads more widely cost more than it saved: with a task per KV head, 2-3 sequences of 550
     * tokens stepped ~1 ms slower and 32 sequences 2.4 ms slower, each block then being read in
     * strided quarters. */
    const int threads = omp_get_max_threads();
    const int share = batch < threads ? (threads + batch - 1) / batch : 1;
    int parts = nc ? share : 1;
    float *scratch = NULL; /* the parts' partial results, merged below */
    if (parts > 1 && !(scratch = malloc(sizeof(float) * (size_t)batch * parts * heads * (dim + 2))))
        parts = 1; /* no memory for them (a few KiB): the KV heads split instead */
    int split = parts > 1 ? 1 : share;
    while (split > 1 && kv_heads % split) --split; /* whole KV heads per task (so split <= kv_heads) */
    const int per_task = kv_heads / split;
    const float scale2 = scale * 1.4426950408889634f;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)batch * split * parts; ++task) {
        const int b = (int)(task / (split * parts)), p = (int)(task % parts);
        const int kh0 = (int)(task / parts % split) * per_task, kh1 = kh0 + per_task;
        int64_t start, len;
        task_span(lens[b], window, block_size, p, parts, &start, &len);
        const float *qb = q + (int64_t)b * q_stride; /* a row of the qkv projection: no copy of q */
        const int64_t *table = tables + b * table_stride;
        float *ob = out + (int64_t)b * heads * dim;
        float *part = scratch ? scratch + ((int64_t)b * parts + p) * heads * (dim + 2) : NULL;
        if (part != NULL && start >= len) { /* an empty part (fewer blocks than parts) */
            for (int h = 0; h < heads; ++h) part[h * (dim + 2) + dim] = -INFINITY;
            continue;
        }
        /* The block this thread most likely reads after this task: the first of the sequence
         * `threads` ahead (tasks of similar length come back to each thread in turn). Prefetched
         * over this task's last block, it spares each sequence a cold first block: on a 2-core
         * AMD EPYC (AVX-512), the 50M model's 8 layers for 32 sequences of 192-256 tokens went
         * 1-5% faster (e.g. 3.40 -> 3.27 ms, medians of 60 alternating calls, five runs), 512
         * tokens no faster (one cold block in 32). A wrong guess only wastes reads. */
        const int64_t nb = (int64_t)b + threads;
        int64_t after = -1;
        if (split == 1 && parts == 1 && nb < batch) {
            int64_t nstart, nlen;
            task_span(lens[nb], window, block_size, 0, 1, &nstart, &nlen);
            after = tables[nb * table_stride + nstart / block_size];
        }
#define VEC(N) task_vec(N, qb, k_cache, v_cache, block_stride, token_stride, head_stride, table, start, len, \
                        groups, block_size, kh0, kh1, scale2, ob, after, part)
        switch (nc) {
        case 1: VEC(1); break;
        case 2: VEC(2); break;
        case 3: VEC(3); break;
        case 4: VEC(4); break;
        case 5: VEC(5); break;
        case 6: VEC(6); break;
        case 8: VEC(8); break;
        case 16: VEC(16); break;
        default:
            task_scalar(qb, k_cache, v_cache, block_stride, token_stride, head_stride, table, start, len, groups,
                        dim, block_size, kh0, kh1, scale, ob);
        }
#undef VEC
    }
    if (scratch) {
        for (int b = 0; b < batch; ++b)
            merge_parts(scratch + (int64_t)b * parts * heads * (dim + 2), parts, heads, dim,
                        out + (int64_t)b * heads * dim);
        free(scratch);
    }
}

int paged_decode_limits(int *max_heads, int *max_dim, int *max_block) {
    *max_heads = MAX_H; *max_dim = MAX_D; *max_block = MAX_BS;
    return 0;
}
