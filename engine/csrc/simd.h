/* Vector helpers shared by the kernels, on GCC's vector extension (a scalar operand is broadcast;
 * a splat built lane by lane compiled to 16 masked broadcasts per use). The width follows the
 * build (-march=native): 16 floats with AVX-512, else 8. engine/kernels.py keys its cache of
 * built kernels on this header as well as on each source. */
#ifndef PDSERVE_SIMD_H
#define PDSERVE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

static inline vf vmax(vf a, vf b) {
    vi m = a < b;
    return (vf)(((vi)a & ~m) | ((vi)b & m));
}

static inline vf vmin(vf a, vf b) {
    vi m = a > b;
    return (vf)(((vi)a & ~m) | ((vi)b & m));
}

/* The largest lane. AVX-512: in registers (on a 2048-token prompt of the 50M model, prefill
 * attention ran 3-4.5% faster than through the array below, Intel Xeon); the order of a max does
 * not change its result. Else by halving (a chain of VW - 1 dependent compares is a long
 * critical path). */
#if VW == 16
static inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
#else
static inline float hmax(vf v) {
    float a[VW];
    memcpy(a, &v, sizeof a);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) a[i] = a[i] > a[i + w] ? a[i] : a[i + w];
    return a[0];
}
#endif

static inline float hsum(vf v) {
    float a[VW];
    memcpy(a, &v, sizeof a);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) a[i] += a[i + w];
    return a[0];
}

/* 2^x lane by lane, clamped to [-126, 126] (below, a result would be denormal, and each
 * denormal costs a microcode assist: 30x the time of the whole function; -inf, a masked score,
 * gives ~1e-38, nothing next to a softmax row maximum's 1): x = j + f with j = round(x) and
 * |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error ~1e-7), times 2^j. */
#if VW == 16
/* AVX-512 rounds and scales by 2^j in one instruction each (vrndscaleps, vscalefps): the prompt
 * attention kernel ran 3% faster than with the portable version below. */
static inline vf vexp2(vf x) {
    /* The clamp's operands in this order pass a NaN through (min/max return their second operand
     * when either is NaN), as the portable version does. */
    const __m512 v = _mm512_min_ps(_mm512_set1_ps(126.f), _mm512_max_ps(_mm512_set1_ps(-126.f), (__m512)x));
    const __m512 j = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(v, j);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return (vf)_mm512_scalef_ps(p, j);
}
#else
/* 2^j is built in the exponent bits. */
static inline vf vexp2(vf x) {
    const vf magic = (vf){} + 12582912.f; /* 1.5 x 2^23: adding it rounds to an integer */
    x = vmin(vmax(x, (vf){} - 126.f), (vf){} + 126.f);
    vf r = x + magic;
    vf f = x - (r - magic);
    vf p = (vf){} + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.f;
    vi bits = (((vi)r - (vi)magic) + 127) << 23;
    return p * (vf)bits;
}
#endif

static inline vf vexp(vf x) { return vexp2(x * 1.4426950408889634f); }

#endif
