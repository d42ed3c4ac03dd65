/* The copy that lands an arriving KV frame in the pool (engine/kv_cache.py): non-temporal
 * (streaming) stores for the bulk of it.
 *
 * Why: an ordinary copy into pool lines that are not cached first reads each destination line
 * (a read for ownership), then writes it back, so memory moves three bytes per byte landed.
 * Streaming stores skip that read. A 4 MiB piece landed in 0.38-0.45 ms by memoryview (memcpy)
 * and in 0.23-0.26 ms here, on the 2-core AVX-512 test host; a 2048-token prompt of the 50M
 * benchmark model lands eight such pieces between its first and second token. What was landed
 * is not left in the cache, which costs nothing here: a frame is read next by a decode step,
 * after the rest of the transfer has passed through the cache anyway.
 *
 * Called through ctypes, so the Python thread that lands (a transport's receiver) lets go of
 * the GIL for the copy, and the engine's thread runs on meanwhile. No OpenMP: a receiver thread
 * that opened a parallel region would get a thread team of its own (see paged_attention.c). */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LINE 64
typedef __m512i line_t;
#define LOAD(p) _mm512_loadu_si512((const void *)(p))
#define STREAM(p, v) _mm512_stream_si512((void *)(p), (v))
#elif defined(__AVX__)
#include <immintrin.h>
#define LINE 32
typedef __m256i line_t;
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define STREAM(p, v) _mm256_stream_si256((__m256i *)(p), (v))
#elif defined(__SSE2__)
#include <emmintrin.h>
#define LINE 16
typedef __m128i line_t;
#define LOAD(p) _mm_loadu_si128((const __m128i *)(p))
#define STREAM(p, v) _mm_stream_si128((__m128i *)(p), (v))
#endif

void stream_copy(char *dst, const char *src, int64_t n) {
#ifdef LINE
    int64_t head = (int64_t)((LINE - ((uintptr_t)dst & (LINE - 1))) & (LINE - 1));
    if (head > n) head = n;
    memcpy(dst, src, (size_t)head); /* up to the destination's first aligned address */
    int64_t i = head;
    for (; i + 4 * LINE <= n; i += 4 * LINE) {
        line_t a = LOAD(src + i), b = LOAD(src + i + LINE), c = LOAD(src + i + 2 * LINE), d = LOAD(src + i + 3 * LINE);
        STREAM(dst + i, a);
        STREAM(dst + i + LINE, b);
        STREAM(dst + i + 2 * LINE, c);
        STREAM(dst + i + 3 * LINE, d);
    }
    _mm_sfence(); /* streaming stores are weakly ordered: visible before the call returns */
    memcpy(dst + i, src + i, (size_t)(n - i));
#else
    memcpy(dst, src, (size_t)n);
#endif
}
