/* Decode attention straight from the paged KV pool: one query token per sequence, its keys and
 * values read block by block where they lie, with no gathered copy and no padding mask.
 *
 * One task per sequence. Each cached block is read once, front to back (it is contiguous:
 * tokens x KV heads x dim), scoring every query head of each KV head as its row goes by, so the
 * hardware prefetcher streams it. Softmax is online (running max and sum per query head),
 * rescaled once per block. Stack use: acc is MAX_H x MAX_D floats (128 KiB at the limits).
 *
 * Built and loaded by engine/kernels.py with -fopenmp; loaded after torch, it shares torch's
 * OpenMP runtime (same soname), so its team is torch's team and obeys torch.set_num_threads. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_H 128
#define MAX_D 256
#define MAX_BS 64

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            int64_t block_stride, int64_t token_stride, int64_t head_stride,
                            const int64_t *tables, int64_t table_stride, const int64_t *lens,
                            int batch, int heads, int kv_heads, int dim, int block_size, int64_t window,
                            float scale, float *out) {
    const int groups = heads / kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < batch; ++b) {
        const int64_t len = lens[b];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const float *qb = q + (int64_t)b * heads * dim;
        float m[MAX_H], l[MAX_H], acc[MAX_H * MAX_D], s[MAX_H * MAX_BS];
        for (int h = 0; h < heads; ++h) { m[h] = -INFINITY; l[h] = 0.f; }
        memset(acc, 0, sizeof(float) * heads * dim);
        for (int64_t blk = start / block_size; blk * block_size < len; ++blk) {
            const int64_t id = tables[b * table_stride + blk];
            const float *kb = k_cache + id * block_stride, *vb = v_cache + id * block_stride;
            const int lo = (int)((start > blk * block_size ? start : blk * block_size) - blk * block_size);
            const int hi = (int)((len < (blk + 1) * block_size ? len : (blk + 1) * block_size) - blk * block_size);
            /* Scores, walking the block's K in memory order: token, then KV head, then its queries. */
            for (int t = lo; t < hi; ++t) {
                for (int kh = 0; kh < kv_heads; ++kh) {
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
            for (int h = 0; h < heads; ++h) {
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
                for (int kh = 0; kh < kv_heads; ++kh) {
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
        float *ob = out + (int64_t)b * heads * dim;
        for (int h = 0; h < heads; ++h) {
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            for (int d = 0; d < dim; ++d) ob[h * dim + d] = acc[h * dim + d] * inv;
        }
    }
}

int paged_decode_limits(int *max_heads, int *max_dim, int *max_block) {
    *max_heads = MAX_H; *max_dim = MAX_D; *max_block = MAX_BS;
    return 0;
}
