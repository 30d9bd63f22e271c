/* Paged decode attention for CPUs (see dlbatch/engine/ops/native.py).
 *
 * One call per layer for the whole decode batch. Each sequence's keys and values are
 * read straight from the paged cache through its block table (slot = table[t / bs] * bs
 * + t % bs, block by block), in two passes per sequence:
 *   1. scores s[h][t] = scale * <q[h], K[t]> for every visible token, then softmax;
 *   2. out[h] = sum_t p[h][t] * V[t].
 * Each K and V row (all KV heads) is read once for all g = Hq / Hkv query heads of its
 * group (GQA), with no gather, no padding and no per-sequence operator dispatch.
 * The cache may hold float32, float16 or bfloat16: rows are widened to float32 as they
 * are loaded (half the bytes of a float32 cache for the same math), so a CPU without
 * native half-precision arithmetic still reads half the KV. bf16 queries over a bf16 cache
 * (a model computing in bf16) on a CPU with AVX512_BF16, head sizes a multiple of 32: the
 * scores come from `vdpbf16ps` on the operands as they are (bf16 x bf16 products are exact
 * in float32, summed in pairs), times the scale; softmax and the weighted sum stay float32.
 * Sequences are split over
 * `nthreads` threads: built with -fopenmp, an OpenMP parallel region, which torch's own
 * workers take (the process loads one libgomp, torch's); otherwise POSIX threads.
 *
 * Memory. A decode step reads every visible K and V row once from memory (a batch's KV is
 * far larger than the caches). While a chunk of rows is computed, the rows of the chunk
 * read next (the sequence's next chunk, the next member's, the V rows after the K rows,
 * the next group's K rows) are asked for a head's lines at a time, interleaved with the
 * arithmetic (pf_t): asking for a whole chunk at once fills the core's miss buffers and
 * stalls it until the lines arrive.
 *
 * Vector width. The arithmetic is written once for vectors of W floats (GCC vector
 * extensions) in the second part of this file (after the `#else` of `#ifndef PA_W`), which the file includes
 * into itself once per width: W = 8 (AVX2, or whatever the compiler maps 32-byte vectors
 * to) always, and W = 16 where the compiler targets AVX-512, used for head sizes that are
 * a multiple of 16 (a 512-bit FMA does twice the work of a 256-bit one on such CPUs).
 * Names in that part carry the width (`F(name)` -> name_w8, name_w16). One call uses one
 * width for every sequence, so the result never depends on how the batch is grouped.
 */
#ifndef PA_W
#if defined(__AVX__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q; /* float32, or bfloat16 (qbf16) */
    const void *kc, *vc;
    float *out;
    const int64_t *block_tables, *seq_len;
    int Hq, Hkv, D, nb_stride, block_size, window;
    float scale;
    const int *order, *gstart;   /* group i = sequences order[gstart[i] .. gstart[i + 1]) */
    const int64_t *gshared;      /* visible positions group i's members share (same cache rows) */
    int first, last;             /* groups [first, last) */
    int max_len;
    int qbf16;                   /* bf16 queries over a bf16 cache: scores by vdpbf16ps */
    int status;
} job_t;

#define GMAX 8 /* sequences per group at most (bigger runs are split) */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

#define CH 32 /* tokens per chunk: a chunk's K or V rows stay in L1 while every query head reads them */


/* positions in the chunk of a sequence's L visible positions that starts at c (<= 0: none) */
static inline int chunk_len(int64_t L, int64_t c) { return (int)(L - c < CH ? L - c : CH); }

/* element offsets of the cache rows of positions [t0, t0 + n) of a sequence (bs a power of two) */
static inline void chunk_rows(const int64_t *tab, int64_t bs, int64_t t0, int n, size_t row, size_t *off) {
    const int sh = __builtin_ctzll((unsigned long long)bs);
    for (int i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        off[i] = (size_t)((tab[t >> sh] << sh) + (t & (bs - 1))) * row;
    }
}

/* The rows a pass reads next (the next chunk of its sequence, the next member's first,
 * or, when the pass has none left, the first of what the thread reads after it), asked for
 * a head's lines at a time while the current chunk is computed: a whole chunk's lines asked
 * at once fill the core's miss buffers, and the core stalls until they come back. */
typedef struct {
    const char *base; /* the cache they are in */
    size_t off[CH];   /* element offsets of the rows */
    int n;            /* rows (0: nothing follows) */
    int es;           /* bytes per cache element */
} pf_t;

/* positions [t0, t0 + n) of a sequence's table in cache `base` as the rows to ask for next */
static inline void pf_set(pf_t *p, const void *base, const int64_t *tab, int64_t bs, int64_t t0, int n, size_t row,
                          int es) {
    p->base = (const char *)base;
    p->n = n > 0 ? n : 0;
    p->es = es;
    if (p->n) chunk_rows(tab, bs, t0, p->n, row, p->off);
}

/* ask for the lines of head elements [h0, h0 + D) of rows [t, t + cnt) of p */
static inline void pf_head(const pf_t *p, int t, int cnt, size_t h0, int D) {
    if (!p) return;
    const size_t bytes = (size_t)D * p->es;
    for (int u = t; u < t + cnt && u < p->n; u++) {
        const char *a = p->base + (p->off[u] + h0) * p->es;
        for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(a + o, 0, 3);
        __builtin_prefetch(a + bytes - 1, 0, 3);
    }
}

/* where a pass goes once its own rows are done: the first chunk of a sequence's rows */
typedef struct {
    const void *cache;
    const int64_t *tab;
    int64_t lo, L; /* L = 0: nothing */
} after_t;

#define CAT_(a, b) a##_w##b
#define CAT(a, b) CAT_(a, b)
#define F(name) CAT(name, PA_W)

#define PA_W 8
#include "_paged_attn.c" /* this file, the second part (found next to it) */
#undef PA_W
#if defined(__AVX512F__)
#define PA_W 16
#include "_paged_attn.c" /* this file, the second part (found next to it) */
#undef PA_W
#define PA_WIDE 1
#else
#define PA_WIDE 0
#endif

/* floats per vector the kernel uses for head size D */
int dl_paged_decode_width(int D) { return PA_WIDE && D % 16 == 0 ? 16 : 8; }

#if PA_WIDE && defined(__AVX512BF16__)
#define PA_QBF16 1
#else
#define PA_QBF16 0
#endif
/* 1 where bf16 queries over a bf16 cache with head size D are taken as they are (q_kind 2) */
int dl_paged_decode_bf16(int D) { return PA_QBF16 && D % 32 == 0 && D <= 256; }

#if PA_WIDE
#define WIDE_FN(kind) ((kind) == KV_F32 ? work_f32_w16 : (kind) == KV_F16 ? work_f16_w16 : work_bf16_w16)
#else
#define WIDE_FN(kind) NULL
#endif

/* Leading visible positions sequences a and b read from the same cache rows. */
static int64_t shared_len(const int64_t *ta, const int64_t *tb, int64_t la, int64_t lb, int bs, int nb_stride) {
    const int64_t lim = la < lb ? la : lb;
    int64_t i = 0;
    while (i < nb_stride && (i + 1) * bs <= lim && ta[i] == tb[i]) i++;
    return i * bs;
}

typedef struct {
    const int64_t *tab;
    int64_t nblocks; /* full blocks of the table */
    int b;
} seq_key_t;

/* block tables in lexicographic order: sequences sharing the longest prefix end up next
 * to each other (the tasks of one paper), as in a depth-first walk of a prefix trie */
static int by_table(const void *x, const void *y) {
    const seq_key_t *a = (const seq_key_t *)x, *b = (const seq_key_t *)y;
    const int64_t n = a->nblocks < b->nblocks ? a->nblocks : b->nblocks;
    for (int64_t i = 0; i < n; i++)
        if (a->tab[i] != b->tab[i]) return a->tab[i] < b->tab[i] ? -1 : 1;
    if (a->nblocks != b->nblocks) return a->nblocks < b->nblocks ? -1 : 1;
    return a->b - b->b;
}

/* q: (B, Hq, D) float32 (q_kind 0), or bfloat16 (q_kind 2, over a bfloat16 cache where
 * dl_paged_decode_bf16(D): scores by vdpbf16ps); out: (B, Hq, D) float32; kc, vc: (slots, Hkv, D) of kv_kind (0 float32, 1 float16,
 * 2 bfloat16); block_tables (B, nb_stride) int64; seq_len[b] = context length of sequence
 * b (its new token included); window > 0: only its last `window` tokens are visible.
 * Sequences sharing leading blocks (a prefix-cache hit) are grouped (at most GMAX each)
 * and read their shared rows together; groups are split over `nthreads` threads. Head sizes that are a multiple of 16 use
 * 16-float vectors where the compiler targets AVX-512 (dl_paged_decode_width).
 * Returns 0; -1 when memory could not be had; -2 for shapes it does not take. */
int dl_paged_decode(const void *q, const void *kc, const void *vc, float *out, const int64_t *block_tables,
                    const int64_t *seq_len, int B, int nb_stride, int block_size, int window, int Hq, int Hkv,
                    int D, float scale, int kv_kind, int nthreads, int q_kind) {
    if (D % 8 != 0 || D > 256 || Hq % Hkv != 0 || kv_kind < 0 || kv_kind > 2) return -2; /* the caller uses its torch path */
    if (!(q_kind == KV_F32 || (q_kind == KV_BF16 && kv_kind == KV_BF16 && dl_paged_decode_bf16(D)))) return -2;
    if (B <= 0) return 0;
    void *(*fn)(void *) = kv_kind == KV_F32 ? work_f32_w8 : kv_kind == KV_F16 ? work_f16_w8 : work_bf16_w8;
    if (dl_paged_decode_width(D) == 16) fn = WIDE_FN(kv_kind);
    int64_t max_len = 1;
    for (int b = 0; b < B; b++) max_len = seq_len[b] > max_len ? seq_len[b] : max_len;
    if (window > 0 && max_len > window) max_len = window;
    int *order = (int *)malloc(sizeof(int) * (size_t)B * 2 + sizeof(int));
    int64_t *gshared = (int64_t *)malloc(sizeof(int64_t) * (size_t)B);
    seq_key_t *keys = (seq_key_t *)malloc(sizeof(seq_key_t) * (size_t)B);
    if (!order || !gshared || !keys) {
        free(order);
        free(gshared);
        free(keys);
        return -1;
    }
    int *gstart = order + B;
    for (int b = 0; b < B; b++) {
        int64_t nbl = seq_len[b] / block_size;
        keys[b] = (seq_key_t){block_tables + (size_t)b * nb_stride, nbl < nb_stride ? nbl : nb_stride, b};
    }
    if (window <= 0) qsort(keys, (size_t)B, sizeof(seq_key_t), by_table); /* a window sees other rows: no groups */
    for (int b = 0; b < B; b++) order[b] = keys[b].b;
    free(keys);
    int ng = 0;
    for (int i = 0; i < B;) {
        const int a = order[i];
        const int64_t *ta = block_tables + (size_t)a * nb_stride;
        int64_t sh = seq_len[a];
        int j = i + 1;
        while (window <= 0 && j < B && j - i < GMAX) {
            const int b = order[j];
            const int64_t s = shared_len(ta, block_tables + (size_t)b * nb_stride, seq_len[a], seq_len[b], block_size,
                                         nb_stride);
            if (s < CH) break;
            sh = s < sh ? s : sh;
            j++;
        }
        gstart[ng] = i;
        gshared[ng] = j - i > 1 ? sh : 0;
        ng++;
        i = j;
    }
    gstart[ng] = B;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ng) nthreads = ng;
    if (nthreads > 64) nthreads = 64;
    job_t jobs[64];
    /* contiguous runs of groups with about equal work (visible rows of every member) */
    int64_t total = 0;
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * (size_t)(ng + 1));
    if (!work) {
        free(order);
        free(gshared);
        return -1;
    }
    work[0] = 0;
    for (int i = 0; i < ng; i++) {
        for (int j = gstart[i]; j < gstart[i + 1]; j++)
            total += window > 0 && seq_len[order[j]] > window ? window : seq_len[order[j]];
        work[i + 1] = total;
    }
    int g0 = 0;
    for (int i = 0; i < nthreads; i++) {
        int g1 = g0;
        const int64_t want = total * (i + 1) / nthreads;
        while (g1 < ng && (i == nthreads - 1 || g1 == g0 || work[g1 + 1] <= want ||
                           work[g1 + 1] - want < want - work[g1])) g1++;
        jobs[i] = (job_t){q, kc, vc, out, block_tables, seq_len, Hq, Hkv, D, nb_stride, block_size, window, scale,
                          order, gstart, gshared, g0, g1, (int)max_len, q_kind == KV_BF16, -1};
        g0 = g1;
    }
#ifdef _OPENMP
    /* torch's OpenMP workers (the same libgomp, loaded once per process) spin for a while
     * after each of its parallel regions: threads of our own would compete with them for the
     * cores, while a parallel region of ours is taken by those workers at once */
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
    for (int i = 0; i < nthreads; i++) fn(&jobs[i]);
    int rc = 0;
    for (int i = 0; i < nthreads; i++)
        if (jobs[i].status != 0) rc = -1;
#else
    pthread_t tids[64];
    int started[64] = {0};
    for (int i = 1; i < nthreads; i++) started[i] = pthread_create(&tids[i], NULL, fn, &jobs[i]) == 0;
    fn(&jobs[0]);
    int rc = jobs[0].status;
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) {
            pthread_join(tids[i], NULL);
        } else {
            fn(&jobs[i]); /* could not start a thread: do its share here */
        }
        if (jobs[i].status != 0) rc = -1;
    }
#endif
    free(order);
    free(gshared);
    free(work);
    return rc;
}

#else /* PA_W defined: the arithmetic for vectors of PA_W floats */

typedef float F(vf) __attribute__((vector_size(4 * PA_W)));
typedef int32_t F(vi) __attribute__((vector_size(4 * PA_W)));
#define vf F(vf)
#define vi F(vi)

static inline vf F(ld)(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void F(st)(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* W cache elements starting at element i, widened to float32 (kind is a constant after inlining) */
static inline __attribute__((always_inline)) vf F(ldkv)(const void *base, size_t i, const int kind) {
    if (kind == KV_F32) return F(ld)((const float *)base + i);
    const uint16_t *h = (const uint16_t *)base + i;
#if PA_W == 8 && defined(__F16C__)
    if (kind == KV_F16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#elif PA_W == 16 && defined(__AVX512F__)
    if (kind == KV_F16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#endif
#if PA_W == 8 && defined(__AVX2__)
    if (kind == KV_BF16)
        return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
#elif PA_W == 16 && defined(__AVX512F__)
    if (kind == KV_BF16)
        return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
#endif
    typedef _Float16 hv __attribute__((vector_size(2 * PA_W)));
    typedef uint16_t uv __attribute__((vector_size(2 * PA_W)));
    if (kind == KV_F16) {
        hv x;
        memcpy(&x, h, sizeof x);
        return __builtin_convertvector(x, vf);
    }
    uv b;
    memcpy(&b, h, sizeof b);
    return (vf)(__builtin_convertvector(b, vi) << 16);
}

/* the 8-lane sum, in the order ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)), of the
 * lanes folded to 8 (x[i] + x[i + 8] for 16 lanes) */
static inline float F(hsum)(vf x) {
#if PA_W == 16
    for (int i = 0; i < 8; i++) x[i] += x[i + 8];
#endif
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

#include "_vexp.h"

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), |rel err| < 2e-7. */
static inline vf F(vexp)(vf x) {
    const vf lo = (vf){0} - 87.f;
    vi below = x < lo;
    x = (vf)(((vi)lo & below) | ((vi)x & ~below));
    vf fn = x * 1.44269504088896341f;
    /* round to nearest */
    vi n = __builtin_convertvector(fn + 0.5f, vi);
    vf nf = __builtin_convertvector(n, vf);
    vi over = nf > fn + 0.5f; /* conversion truncates toward zero: make it floor(fn + 0.5) */
    n = n - (over & 1);
    nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;
    vf p = F(exp_poly)(r);
    vi e = (n + 127) << 23;
    return p * (vf)e;
}

/* R query rows x 4 keys: 4R dot products over nv vectors, each reduced as F(hsum) does
 * and stored at s[r][0..3]. One K vector load serves R rows. */
static inline __attribute__((always_inline)) void F(qk_tile)(const vf *const *q, float *const *s, const int R,
                                                             const void *kc, const size_t *off, size_t h0, int nv,
                                                             const int kind) {
    vf a[3][4];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) a[r][u] = (vf){0};
    for (int j = 0; j < nv; j++) {
        for (int u = 0; u < 4; u++) {
            const vf k = F(ldkv)(kc, off[u] + h0 + PA_W * (size_t)j, kind);
            for (int r = 0; r < R; r++) a[r][u] += q[r][j] * k;
        }
    }
    for (int r = 0; r < R; r++) {
#if defined(__AVX__)
#if PA_W == 16
        __m256 x[4];
        for (int u = 0; u < 4; u++) {
            const __m512 z = (__m512)a[r][u];
            x[u] = _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
        }
#else
        const __m256 x[4] = {(__m256)a[r][0], (__m256)a[r][1], (__m256)a[r][2], (__m256)a[r][3]};
#endif
        __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
        t0 = _mm256_hadd_ps(t0, t1);
        _mm_storeu_ps(s[r], _mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1)));
#else
        for (int u = 0; u < 4; u++) s[r][u] = F(hsum)(a[r][u]);
#endif
    }
}

#if PA_W == 16 && defined(__AVX512BF16__)
#define PA_BF16 1
/* qk_tile for bf16 queries and a bf16 cache (D a multiple of 32): the dot products by
 * vdpbf16ps on the operands as they are (exact products, summed in pairs into float32),
 * then multiplied by the scale */
static inline __attribute__((always_inline)) void F(qk_tile_bh)(const uint16_t *const *q, float *const *s, const int R,
                                                                const void *kc, const size_t *off, size_t h0, int D,
                                                                float scale) {
    __m512 a[3][4];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) a[r][u] = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 32) {
        __m512bh x[3];
        for (int r = 0; r < R; r++) x[r] = (__m512bh)_mm512_loadu_si512((const void *)(q[r] + j));
        for (int u = 0; u < 4; u++) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512((const void *)((const uint16_t *)kc + off[u] + h0 + j));
            for (int r = 0; r < R; r++) a[r][u] = _mm512_dpbf16_ps(a[r][u], x[r], k);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 y[4];
        for (int u = 0; u < 4; u++)
            y[u] = _mm256_add_ps(_mm512_castps512_ps256(a[r][u]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][u]), 1)));
        __m256 t0 = _mm256_hadd_ps(y[0], y[1]), t1 = _mm256_hadd_ps(y[2], y[3]);
        t0 = _mm256_hadd_ps(t0, t1);
        const __m128 z = _mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1));
        _mm_storeu_ps(s[r], _mm_mul_ps(z, _mm_set1_ps(scale)));
    }
}

/* one key's dot product with a bf16 query, as qk_tile_bh computes it */
static inline float F(qk_one_bh)(const uint16_t *q, const uint16_t *k, int D, float scale) {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < D; j += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(q + j)),
                             (__m512bh)_mm512_loadu_si512((const void *)(k + j)));
    return F(hsum)((vf)a) * scale;
}
#else
#define PA_BF16 0
#endif

/* One sequence of a group: its query (scaled), scores and accumulators. */
typedef struct {
    vf *qv, *acc;
    const uint16_t *qh; /* bf16 queries as they are (J->qbf16) */
    float *scores;
    const int64_t *tab;
    int64_t lo, L; /* visible positions [lo, lo + L) */
    int b;
} F(member_t);
#define member_t F(member_t)

/* R query heads from hq of m over the K rows of positions [c, c + n) */
static inline __attribute__((always_inline)) void F(score_heads)(const job_t *J, const member_t *m, int hq, const int R,
                                                                 int64_t c, int n, const size_t *off, size_t Lp,
                                                                 const int kind, const pf_t *pf) {
    const int g = J->Hq / J->Hkv, nv = J->D / PA_W, n4 = n / 4 * 4;
    const size_t h0 = (size_t)(hq / g) * J->D;
    float *s[3];
#if PA_BF16
    if (kind == KV_BF16 && J->qbf16) {
        const uint16_t *qh[3];
        for (int r = 0; r < R; r++) qh[r] = m->qh + (size_t)(hq + r) * J->D;
        for (int t = 0; t < n4; t += 4) {
            pf_head(pf, t, 4, h0, J->D);
            for (int r = 0; r < R; r++) s[r] = m->scores + (size_t)(hq + r) * Lp + c + t;
            F(qk_tile_bh)(qh, s, R, J->kc, off + t, h0, J->D, J->scale);
        }
        pf_head(pf, n4, CH - n4, h0, J->D);
        for (int t = n4; t < n; t++)
            for (int r = 0; r < R; r++)
                m->scores[(size_t)(hq + r) * Lp + c + t] =
                    F(qk_one_bh)(qh[r], (const uint16_t *)J->kc + off[t] + h0, J->D, J->scale);
        return;
    }
#endif
    const vf *q[3];
    for (int r = 0; r < R; r++) q[r] = m->qv + (hq + r) * nv;
    for (int t = 0; t < n4; t += 4) {
        pf_head(pf, t, 4, h0, J->D);
        for (int r = 0; r < R; r++) s[r] = m->scores + (size_t)(hq + r) * Lp + c + t;
        F(qk_tile)(q, s, R, J->kc, off + t, h0, nv, kind);
    }
    pf_head(pf, n4, CH - n4, h0, J->D); /* the rest of the next chunk */
    for (int t = n4; t < n; t++) {
        for (int r = 0; r < R; r++) {
            vf a = q[r][0] * F(ldkv)(J->kc, off[t] + h0, kind);
            for (int j = 1; j < nv; j++) a += q[r][j] * F(ldkv)(J->kc, off[t] + h0 + PA_W * j, kind);
            m->scores[(size_t)(hq + r) * Lp + c + t] = F(hsum)(a);
        }
    }
}

/* scores of every query head of m over visible positions [c, c + n) (rows at off), the
 * heads of one KV head three at a time */
static inline __attribute__((always_inline)) void F(score_rows)(const job_t *J, const member_t *m, int64_t c, int n,
                                                                const size_t *off, size_t Lp, const int kind,
                                                                const pf_t *pf) {
    const int g = J->Hq / J->Hkv;
    for (int h = 0; h < J->Hkv; h++) {
        int gi = 0;
        for (; gi + 3 <= g; gi += 3) F(score_heads)(J, m, h * g + gi, 3, c, n, off, Lp, kind, gi ? NULL : pf);
        if (g - gi == 2) F(score_heads)(J, m, h * g + gi, 2, c, n, off, Lp, kind, gi ? NULL : pf);
        if (g - gi == 1) F(score_heads)(J, m, h * g + gi, 1, c, n, off, Lp, kind, gi ? NULL : pf);
    }
}

/* R heads x U output vectors from column vector j: x[r][u] += sum_t p[r][t] V[t] */
static inline __attribute__((always_inline)) void F(pv_tile)(vf (*x)[4], const float *const *p, const int R,
                                                             const int U, const void *vc, const size_t *off, size_t o0,
                                                             int n, const int kind, const pf_t *pf, size_t h0, int D) {
    for (int t = 0; t < n; t++) {
        pf_head(pf, t, 1, h0, D);
        const size_t o = off[t] + o0;
        for (int u = 0; u < U; u++) {
            const vf v = F(ldkv)(vc, o + PA_W * u, kind);
            for (int r = 0; r < R; r++) x[r][u] += p[r][t] * v;
        }
    }
    pf_head(pf, n, CH - n, h0, D); /* the rest of the next chunk */
}

/* R heads from hq: out[r] += sum_t p[r][t] V[t], 4 output vectors at a time held in
 * registers across the rows; one V load serves R heads */
static inline __attribute__((always_inline)) void F(pv_heads)(const job_t *J, const member_t *m, int hq, const int R,
                                                              int64_t c, int n, const size_t *off, size_t Lp,
                                                              const int kind, const pf_t *pf) {
    const int g = J->Hq / J->Hkv, nv = J->D / PA_W;
    const size_t h0 = (size_t)(hq / g) * J->D;
    const float *p[3];
    for (int r = 0; r < R; r++) p[r] = m->scores + (size_t)(hq + r) * Lp + c;
    for (int j = 0; j < nv; j += 4) {
        const int U = nv - j < 4 ? nv - j : 4;
        vf x[3][4];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < U; u++) x[r][u] = m->acc[(hq + r) * nv + j + u];
        const pf_t *pj = j ? NULL : pf; /* the next rows asked for once */
        if (U == 4) /* the common case, with the vector count a constant */
            F(pv_tile)(x, p, R, 4, J->vc, off, h0 + PA_W * (size_t)j, n, kind, pj, h0, J->D);
        else
            F(pv_tile)(x, p, R, U, J->vc, off, h0 + PA_W * (size_t)j, n, kind, pj, h0, J->D);
        for (int r = 0; r < R; r++)
            for (int u = 0; u < U; u++) m->acc[(hq + r) * nv + j + u] = x[r][u];
    }
}

/* every query head's weighted sum of m over the V rows of positions [c, c + n) */
static inline __attribute__((always_inline)) void F(pv_rows)(const job_t *J, const member_t *m, int64_t c, int n,
                                                             const size_t *off, size_t Lp, const int kind,
                                                             const pf_t *pf) {
    const int g = J->Hq / J->Hkv;
    for (int h = 0; h < J->Hkv; h++) {
        int gi = 0;
        for (; gi + 3 <= g; gi += 3) F(pv_heads)(J, m, h * g + gi, 3, c, n, off, Lp, kind, gi ? NULL : pf);
        if (g - gi == 2) F(pv_heads)(J, m, h * g + gi, 2, c, n, off, Lp, kind, gi ? NULL : pf);
        if (g - gi == 1) F(pv_heads)(J, m, h * g + gi, 1, c, n, off, Lp, kind, gi ? NULL : pf);
    }
}

/* softmax of each head's scores in place (the padding up to a whole vector set to 0);
 * the maximum is taken a vector at a time (the exact maximum, whatever the order) */
static void F(softmax_rows)(const job_t *J, const member_t *m, size_t Lp) {
    const int64_t L = m->L, Lr = (L + PA_W - 1) / PA_W * PA_W;
    for (int hq = 0; hq < J->Hq; hq++) {
        float *s = m->scores + (size_t)hq * Lp;
        for (int64_t t = L; t < Lr; t++) s[t] = -INFINITY; /* padding -> exp 0 */
        vf vm = F(ld)(s);
        for (int64_t t = PA_W; t < Lr; t += PA_W) {
            const vf x = F(ld)(s + t);
            const vi gt = x > vm;
            vm = (vf)(((vi)x & gt) | ((vi)vm & ~gt));
        }
        float mx = vm[0];
        for (int i = 1; i < PA_W; i++) mx = vm[i] > mx ? vm[i] : mx;
        vf vs = (vf){0};
        for (int64_t t = 0; t < Lr; t += PA_W) {
            vf e = F(vexp)(F(ld)(s + t) - mx);
            F(st)(s + t, e);
            vs += e;
        }
        const float inv = 1.f / F(hsum)(vs);
        for (int64_t t = 0; t < Lr; t += PA_W) F(st)(s + t, F(ld)(s + t) * inv);
    }
}

/* The chunk after (i, c) in a pass (i = -1: a joint chunk, read for every member through
 * member 0's table): 1 and its member and start, or 0 when the pass has no more. */
static inline int F(next_chunk)(const member_t *M, int k, int64_t joint, int i, int64_t c, int *ni, int64_t *nc) {
    c += CH;
    if ((i < 0 && c < joint) || (i >= 0 && c < M[i].L)) {
        *ni = i;
        *nc = c;
        return 1;
    }
    for (int m = i + 1; m < k; m++) {
        if (joint < M[m].L) {
            *ni = m;
            *nc = joint;
            return 1;
        }
    }
    return 0;
}

/* One pass over the rows of a group (pv = 0: K rows, scores; pv = 1: V rows, weighted
 * sums; a constant after inlining): the joint chunks for all members, then each member's
 * own, which it ends with its softmax (pass 0) or by storing its output (pass 1). Each
 * chunk asks for the rows of the one after it (pf_t), the last for `after`'s first. */
static inline __attribute__((always_inline)) void F(pass)(const job_t *J, member_t *M, int k, int64_t joint, size_t Lp,
                                                          const int kind, const int pv, after_t after) {
    size_t off[CH];
    pf_t pf;
    const size_t row = (size_t)J->Hkv * J->D;
    const int es = kind == KV_F32 ? 4 : 2;
    const void *cache = pv ? J->vc : J->kc;
    const int64_t bs = J->block_size;
#define NEXT(i, c)                                                                                                 \
    do {                                                                                                           \
        int ni;                                                                                                    \
        int64_t nc;                                                                                                \
        if (F(next_chunk)(M, k, joint, (i), (c), &ni, &nc)) {                                                      \
            const member_t *nm = &M[ni < 0 ? 0 : ni];                                                              \
            pf_set(&pf, cache, nm->tab, bs, nm->lo + nc, ni < 0 ? CH : chunk_len(nm->L, nc), row, es);             \
        } else {                                                                                                   \
            pf_set(&pf, after.cache, after.tab, bs, after.lo, chunk_len(after.L, 0), row, es);                     \
        }                                                                                                          \
    } while (0)
    for (int64_t c = 0; c < joint; c += CH) {
        chunk_rows(M[0].tab, bs, M[0].lo + c, CH, row, off);
        NEXT(-1, c);
        for (int i = 0; i < k; i++) {
            if (pv) F(pv_rows)(J, &M[i], c, CH, off, Lp, kind, i ? NULL : &pf);
            else F(score_rows)(J, &M[i], c, CH, off, Lp, kind, i ? NULL : &pf);
        }
    }
    for (int i = 0; i < k; i++) {
        for (int64_t c = joint; c < M[i].L; c += CH) {
            const int n = chunk_len(M[i].L, c);
            chunk_rows(M[i].tab, bs, M[i].lo + c, n, row, off);
            NEXT(i, c);
            if (pv) F(pv_rows)(J, &M[i], c, n, off, Lp, kind, &pf);
            else F(score_rows)(J, &M[i], c, n, off, Lp, kind, &pf);
        }
        if (!pv) {
            F(softmax_rows)(J, &M[i], Lp);
        } else {
            float *ob = J->out + (size_t)M[i].b * J->Hq * J->D;
            for (int j = 0; j < J->Hq * (J->D / PA_W); j++) F(st)(ob + PA_W * (size_t)j, M[i].acc[j]);
        }
    }
#undef NEXT
}

/* the two passes as functions of their own, which GCC clones per kind: inlined together
 * into one body, the float32 pass compiles slower (docs/benchmarks.md) */
static __attribute__((noinline)) void F(score_pass)(const job_t *J, member_t *M, int k, int64_t joint, size_t Lp,
                                                    const int kind) {
    F(pass)(J, M, k, joint, Lp, kind, 0, (after_t){J->vc, M[0].tab, M[0].lo, M[0].L}); /* then the first V rows */
}
static __attribute__((noinline)) void F(value_pass)(const job_t *J, member_t *M, int k, int64_t joint, size_t Lp,
                                                    const int kind, after_t after) {
    F(pass)(J, M, k, joint, Lp, kind, 1, after);
}

/* A group of k sequences whose first `shared` visible positions are the same cache rows
 * (one paper's tasks: the prefix cache gave them the same blocks). Chunks of the shared
 * part are loaded once and used by every member while they sit in L1, so a paper's KV
 * comes from memory once per step instead of once per task. The chunk boundaries are the
 * same as for a sequence alone, so the result does not depend on the grouping. */
static inline __attribute__((always_inline)) void F(group_body)(const job_t *J, member_t *M, int k, int64_t shared,
                                                                size_t Lp, const int kind, after_t after) {
    const int nq = J->Hq * (J->D / PA_W);
    const int64_t joint = shared / CH * CH;
    for (int i = 0; i < k; i++) {
        if (J->qbf16) {
            M[i].qh = (const uint16_t *)J->q + (size_t)M[i].b * J->Hq * J->D;
        } else {
            const float *qb = (const float *)J->q + (size_t)M[i].b * J->Hq * J->D;
            for (int j = 0; j < nq; j++) M[i].qv[j] = F(ld)(qb + PA_W * (size_t)j) * J->scale;
        }
        for (int j = 0; j < nq; j++) M[i].acc[j] = (vf){0};
    }
    F(score_pass)(J, M, k, joint, Lp, kind);
    F(value_pass)(J, M, k, joint, Lp, kind, after);
}

static inline __attribute__((always_inline)) void F(work_body)(job_t *J, const int kind) {
    const int nq = J->Hq * (J->D / PA_W);
    const size_t Lp = (size_t)((J->max_len + CH - 1) / CH * CH);
    float *scores = (float *)aligned_alloc(64, sizeof(float) * (size_t)J->Hq * Lp * GMAX);
    vf *acc = (vf *)aligned_alloc(64, sizeof(vf) * (size_t)nq * GMAX);
    vf *qv = (vf *)aligned_alloc(64, sizeof(vf) * (size_t)nq * GMAX);
    if (!scores || !acc || !qv) {
        free(scores);
        free(acc);
        free(qv);
        J->status = -1;
        return;
    }
    member_t M[GMAX];
    for (int gi = J->first; gi < J->last; gi++) {
        const int k = J->gstart[gi + 1] - J->gstart[gi];
        for (int i = 0; i < k; i++) {
            const int b = J->order[J->gstart[gi] + i];
            const int64_t Lfull = J->seq_len[b];
            const int64_t lo = (J->window > 0 && Lfull > J->window) ? Lfull - J->window : 0;
            M[i] = (member_t){qv + (size_t)i * nq, acc + (size_t)i * nq, NULL, scores + (size_t)i * J->Hq * Lp,
                              J->block_tables + (size_t)b * J->nb_stride, lo, Lfull - lo, b};
        }
        after_t after = {NULL, NULL, 0, 0}; /* the next group's first K rows */
        if (gi + 1 < J->last) {
            const int b = J->order[J->gstart[gi + 1]];
            const int64_t Lfull = J->seq_len[b];
            const int64_t lo = (J->window > 0 && Lfull > J->window) ? Lfull - J->window : 0;
            after = (after_t){J->kc, J->block_tables + (size_t)b * J->nb_stride, lo, Lfull - lo};
        }
        F(group_body)(J, M, k, J->gshared[gi], Lp, kind, after);
    }
    free(scores);
    free(acc);
    free(qv);
    J->status = 0;
}

static void *F(work_f32)(void *arg) {
    F(work_body)((job_t *)arg, KV_F32);
    return NULL;
}
static void *F(work_f16)(void *arg) {
    F(work_body)((job_t *)arg, KV_F16);
    return NULL;
}
static void *F(work_bf16)(void *arg) {
    F(work_body)((job_t *)arg, KV_BF16);
    return NULL;
}

#undef member_t
#undef vf
#undef vi
#undef PA_BF16
#endif /* PA_W */
