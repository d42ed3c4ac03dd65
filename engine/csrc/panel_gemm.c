/* GEMM from panel-packed weights: y[m, n] = x[m, k] @ W[k, n] (+ bias[n]), for decode batches
 * and prompt chunks alike.
 *
 * Decode reads every weight once per step for a handful of rows, so it is bound by memory, not
 * arithmetic. MKL and oneDNN reach 3-9 GB/s at 1-16 rows on the 50M benchmark model's layers
 * (the host streams ~17-21 GB/s): their row-major reads jump a page per row of W, and their
 * small-M paths are tuned for compute. Here W is packed once, at load, into panels of NB
 * columns: panel j holds W[:, j*NB:(j+1)*NB] row after row, k x NB floats in one contiguous
 * run, so each thread streams its share of panels front to back (14-17 GB/s at one row).
 *
 * Each panel is swept once per MR rows of x, its accumulators (MR x NB floats: 12 of AVX2's 16
 * vector registers at MR 6 and NB 16; 24 of AVX-512's 32 at MR 12 and NB 32) held in registers
 * for the whole k loop; more rows re-read the panel from L2 (k x NB x 4 bytes: 32-180 KiB here).
 * AVX-512 once ran the AVX2 shape, one vector per row: six accumulators, fewer than the FMA
 * units' latency needs in flight, and the kernel reached ~60% of MKL's rate at any row count
 * (Intel Xeon, model 207); at 12 x 32 it ran the 50M model's body layers at 0.97-1.56x the
 * better library's rate at 8-32 rows, and at 70-85% of it on 2048-row prompts. The omp simd
 * loops below must be vectorized 512 bits wide for that (engine/kernels.py FLAGS). Panels are split
 * across torch's OpenMP team (the library shares torch's runtime, see engine/kernels.py). The
 * last panel is zero-padded, so a width that is not a multiple of NB costs only the padding.
 *
 * Prompts: rows go in blocks of MB_ROWS, every panel swept per block, so a block of x (96 x k
 * floats: 192-540 KiB here) stays in cache while the panels stream past it; the weights, a few
 * MiB per layer, come from L3 once per block. Without the blocks every panel re-read all of x
 * (4-11 MiB at 2048 rows) from memory, and 2048-token prompts ran 6% slower than MKL; blocked,
 * 128-2048-token prompts of the 50M model prefill 2-19% faster than with MKL (engine/model.py). */
#include <stdint.h>
#include <string.h>

/* NB: panel width, two vectors, so MR rows keep 2 x MR accumulators in flight.
 * MR: rows of x per sweep of a panel, 24 of AVX-512's 32 vector registers, 12 of AVX2's 16. */
#ifdef __AVX512F__
#define NB 32
#define MR 12
#else
#define NB 16
#define MR 6
#endif
#define MB_ROWS 96 /* rows of x per block (a multiple of MR: no short tile inside a block) */

/* Row t of panel pf fetched into L2 (a line at a time). */
#define FETCH(pf, t)                                                                          \
    for (int l = 0; l < NB; l += 16) __builtin_prefetch((pf) + (t) * NB + l, 0, 2)

/* Row t of the panel times each of the tile's R values of x in column t, into the accumulators. */
#define ACCUMULATE(R, t)                                                                      \
    for (int r = 0; r < R; ++r) {                                                             \
        const float xv = x[r * ldx + (t)], *w = p + (t) * NB;                                 \
        _Pragma("omp simd") for (int c = 0; c < NB; ++c) acc[r][c] += xv * w[c];              \
    }

/* An R-row tile of one panel, its accumulators in registers for the whole k loop.
 * micro_R: pf, the next panel (or NULL), fetched whole into L2 as this one is swept, so a layer
 * whose weights stream from memory (the LM head: 64 MiB) does not wait on each panel.
 * spread_R: for a panel swept more than once (more rows than one tile). Its sweeps share the
 * fetching of the next panel, sweep `first` fetching rows first, first + sweeps, ... of it, so
 * the fetches spread over the whole panel's time; when the first sweep fetched all of it, the
 * later ones waited on memory. On the 2-core Intel host, layers streamed as in a decode step
 * took 0.87-0.92x the time at 16-128 rows (the LM head at 32 rows 0.87x); bench/engine.py, runs
 * alternating with the old build, decoded batch 32 at 1846-1894 tokens/s against 1694-1731
 * (batch 32 / batch 1 10.3-10.7x against 9.4-9.5x). Each sweep fetching a contiguous share
 * instead gained only 2-3% at 32 rows. One sweep keeps micro_R: with spread_R's counter in the
 * loop, one row ran 4-10% slower. */
#define MICRO(R)                                                                              \
    static void micro_##R(const float *x, int64_t ldx, int64_t k, const float *p, float *out,  \
                          const float *pf) {                                                   \
        float acc[R][NB];                                                                     \
        memset(acc, 0, sizeof acc);                                                           \
        for (int64_t t = 0; t < k; ++t) {                                                     \
            if (pf) FETCH(pf, t);                                                             \
            ACCUMULATE(R, t);                                                                 \
        }                                                                                     \
        memcpy(out, acc, sizeof acc);                                                         \
    }                                                                                         \
    static void spread_##R(const float *x, int64_t ldx, int64_t k, const float *p, float *out, \
                           const float *pf, int64_t first, int64_t sweeps) {                   \
        float acc[R][NB];                                                                     \
        memset(acc, 0, sizeof acc);                                                           \
        for (int64_t t = 0, next = pf ? first : k; t < k; ++t) {                              \
            if (t == next) {                                                                  \
                FETCH(pf, t);                                                                 \
                next += sweeps;                                                               \
            }                                                                                 \
            ACCUMULATE(R, t);                                                                 \
        }                                                                                     \
        memcpy(out, acc, sizeof acc);                                                         \
    }
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)
MICRO(5)
MICRO(6)
#if MR > 6
MICRO(7)
MICRO(8)
MICRO(9)
MICRO(10)
MICRO(11)
MICRO(12)
#endif

/* The tiles by height: micros[r] and spreads[r] serve r rows (1 to MR). */
typedef void (*micro_fn)(const float *, int64_t, int64_t, const float *, float *, const float *);
typedef void (*spread_fn)(const float *, int64_t, int64_t, const float *, float *, const float *, int64_t, int64_t);
static const micro_fn micros[MR + 1] = {NULL, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6,
#if MR > 6
                                        micro_7, micro_8, micro_9, micro_10, micro_11, micro_12,
#endif
};
static const spread_fn spreads[MR + 1] = {NULL, spread_1, spread_2, spread_3, spread_4, spread_5, spread_6,
#if MR > 6
                                          spread_7, spread_8, spread_9, spread_10, spread_11, spread_12,
#endif
};

void panel_gemm_limits(int *panel_width) { *panel_width = NB; }

/* x: m rows of k floats, row stride ldx; panels: ceil(n / NB) panels of k x NB floats;
 * bias: n floats or NULL; res: m rows of n floats (row stride ldr) added last, or NULL (a
 * decoder layer's residual: (x W + bias) + res rounds as the separate add did, without its pass
 * over memory); y: m rows of n floats, row stride ldy (may be res itself). */
void panel_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels, int64_t n,
                const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy) {
    const int64_t np = (n + NB - 1) / NB;
#pragma omp parallel
    for (int64_t b0 = 0; b0 < m; b0 += MB_ROWS) {
        const int64_t b1 = b0 + MB_ROWS < m ? b0 + MB_ROWS : m;
        /* nowait: each thread writes only its own panels' columns, whatever the block */
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < np; ++j) {
            const float *p = panels + j * k * NB;
            const int64_t j0 = j * NB, nw = n - j0 < NB ? n - j0 : NB;
            float tile[MR * NB];
            const int64_t sweeps = (b1 - b0 + MR - 1) / MR;
            const float *nxt = j + 1 < np ? p + k * NB : NULL; /* the next panel this thread takes */
            for (int64_t i0 = b0; i0 < b1; i0 += MR) {
                const int r = (int)(b1 - i0 < MR ? b1 - i0 : MR);
                const float *xi = x + i0 * ldx;
                /* one sweep fetches all of the next panel; several share it (spread_R) */
                if (sweeps > 1)
                    spreads[r](xi, ldx, k, p, tile, nxt, (i0 - b0) / MR, sweeps);
                else
                    micros[r](xi, ldx, k, p, tile, nxt);
                for (int rr = 0; rr < r; ++rr) {
                    float *yr = y + (i0 + rr) * ldy + j0;
                    const float *rs = res ? res + (i0 + rr) * ldr + j0 : NULL;
                    for (int64_t c = 0; c < nw; ++c) {
                        const float v = bias ? tile[rr * NB + c] + bias[j0 + c] : tile[rr * NB + c];
                        yr[c] = rs ? v + rs[c] : v;
                    }
                }
            }
        }
    }
}
