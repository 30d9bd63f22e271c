/* Fused copy + sum64 checksum for KV transfer (see dlbatch/transfer/fastcopy.py).
 *
 * sum64(bytes) = (wrapping sum of the bytes read as little-endian uint64 words, the
 * tail zero-padded to 8 bytes) + number of bytes, mod 2^64 -- the same value as
 * dlbatch.transfer.payload.checksum(arr, "sum64").
 *
 * Why C: numpy's copy of a large buffer *out of* /dev/shm (4 KiB pages, no THP for
 * shmem on our hosts) runs at about a third of the speed between private huge-page arrays,
 * and a checksum is one more read pass. This loop reads each word once, adds it to the
 * checksum in registers, writes it with non-temporal stores (the destination is not
 * read back soon: a shm segment or the paged KV cache) and prefetches a few pages
 * ahead, so reading 4 KiB-page memory keeps close to the huge-page speed (figures:
 * docs/transfer.md, docs/benchmarks.md).
 * Called through ctypes, which releases the GIL for the whole call.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define DLKV_SSE2 1
#endif

#define PREFETCH_BYTES 8192
#define NT_MIN_BYTES (1u << 20)

static uint64_t tail_word(const uint8_t *p, size_t k) {
    uint64_t w = 0;
    memcpy(&w, p, k); /* little-endian host: low bytes first, rest zero */
    return w;
}

/* Copy n bytes src -> dst (no overlap); return sum64 of the bytes if want_sum, else 0. */
uint64_t dlkv_copy_sum64(void *dst_, const void *src_, size_t n, int want_sum) {
    uint8_t *dst = (uint8_t *)dst_;
    const uint8_t *src = (const uint8_t *)src_;
    size_t i = 0;
    uint64_t total = 0;
#ifdef DLKV_SSE2
    if (n >= NT_MIN_BYTES) {
        /* head: bring dst to 16-byte alignment with whole 8-byte words where possible */
        while (i + 8 <= n && (((uintptr_t)(dst + i)) & 15)) {
            uint64_t w;
            memcpy(&w, src + i, 8);
            memcpy(dst + i, &w, 8);
            total += w;
            i += 8;
        }
        if ((((uintptr_t)(dst + i)) & 15) == 0) {
            __m128i acc0 = _mm_setzero_si128(), acc1 = _mm_setzero_si128();
            __m128i acc2 = _mm_setzero_si128(), acc3 = _mm_setzero_si128();
            for (; i + 64 <= n; i += 64) {
                _mm_prefetch((const char *)(src + i + PREFETCH_BYTES), _MM_HINT_T0);
                __m128i x0 = _mm_loadu_si128((const __m128i *)(src + i));
                __m128i x1 = _mm_loadu_si128((const __m128i *)(src + i + 16));
                __m128i x2 = _mm_loadu_si128((const __m128i *)(src + i + 32));
                __m128i x3 = _mm_loadu_si128((const __m128i *)(src + i + 48));
                _mm_stream_si128((__m128i *)(dst + i), x0);
                _mm_stream_si128((__m128i *)(dst + i + 16), x1);
                _mm_stream_si128((__m128i *)(dst + i + 32), x2);
                _mm_stream_si128((__m128i *)(dst + i + 48), x3);
                if (want_sum) {
                    acc0 = _mm_add_epi64(acc0, x0);
                    acc1 = _mm_add_epi64(acc1, x1);
                    acc2 = _mm_add_epi64(acc2, x2);
                    acc3 = _mm_add_epi64(acc3, x3);
                }
            }
            _mm_sfence(); /* non-temporal stores visible before any later flag store */
            uint64_t lanes[2];
            __m128i acc = _mm_add_epi64(_mm_add_epi64(acc0, acc1), _mm_add_epi64(acc2, acc3));
            _mm_storeu_si128((__m128i *)lanes, acc);
            total += lanes[0] + lanes[1];
        }
    }
#endif
    if (!want_sum) {
        memcpy(dst + i, src + i, n - i);
        return 0;
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, src + i, 8);
        memcpy(dst + i, &w, 8);
        total += w;
    }
    if (i < n) {
        memcpy(dst + i, src + i, n - i);
        total += tail_word(src + i, n - i);
    }
    return total + (uint64_t)n;
}

/* sum64 of n bytes (see above). */
uint64_t dlkv_sum64(const void *src_, size_t n) {
    const uint8_t *src = (const uint8_t *)src_;
    size_t i = 0;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, src + i, 32);
        a0 += w[0];
        a1 += w[1];
        a2 += w[2];
        a3 += w[3];
    }
    uint64_t total = a0 + a1 + a2 + a3;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, src + i, 8);
        total += w;
    }
    if (i < n)
        total += tail_word(src + i, n - i);
    return total + (uint64_t)n;
}
