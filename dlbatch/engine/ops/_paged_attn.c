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
 * native half-precision arithmetic still reads half the KV. Sequences are split over
 * `nthreads` POSIX threads.
 */
#if defined(__AVX__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    const void *kc, *vc;
    float *out;
    const int64_t *block_tables, *seq_len;
    int B, Hq, Hkv, D, nb_stride, block_size, window;
    float scale;
    int first, last; /* sequences [first, last) */
    int max_len;
    int status;
} job_t;

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 ld(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void st(float *p, v8 x) { memcpy(p, &x, sizeof x); }

typedef _Float16 v8f16 __attribute__((vector_size(16)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* 8 cache elements starting at element i, widened to float32 (kind is a constant after inlining) */
static inline __attribute__((always_inline)) v8 ldkv(const void *base, size_t i, const int kind) {
    if (kind == KV_F32) return ld((const float *)base + i);
    if (kind == KV_F16) {
#ifdef __F16C__
        return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
#else
        v8f16 h;
        memcpy(&h, (const _Float16 *)base + i, sizeof h);
        return __builtin_convertvector(h, v8);
#endif
    }
#ifdef __AVX2__
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    v8u16 b;
    memcpy(&b, (const uint16_t *)base + i, sizeof b);
    v8i w = __builtin_convertvector(b, v8i) << 16;
    return (v8)w;
#endif
}

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), |rel err| < 2e-7. */
static inline v8 vexp(v8 x) {
    const v8 lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    v8i below = x < lo;
    x = (v8)(((v8i)lo & below) | ((v8i)x & ~below));
    v8 fn = x * 1.44269504088896341f;
    /* round to nearest */
    v8i n = __builtin_convertvector(fn + (v8){0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f}, v8i);
    v8 nf = __builtin_convertvector(n, v8);
    v8i over = nf > fn + 0.5f; /* conversion truncates toward zero: make it floor(fn + 0.5) */
    v8i adj = over & (v8i){1, 1, 1, 1, 1, 1, 1, 1};
    n = n - adj;
    nf = __builtin_convertvector(n, v8);
    v8 r = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;
    v8 p = (v8){1.9875691500e-4f, 1.9875691500e-4f, 1.9875691500e-4f, 1.9875691500e-4f, 1.9875691500e-4f,
                1.9875691500e-4f, 1.9875691500e-4f, 1.9875691500e-4f};
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    v8i e = (n + 127) << 23;
    return p * (v8)e;
}

#define CH 32 /* tokens per chunk: a chunk's K or V rows stay in L1 while every query head reads them */

/* element offsets of the cache rows of positions [t0, t0 + n) of a sequence */
static inline void chunk_rows(const int64_t *tab, int64_t bs, int64_t t0, int n, size_t row, size_t *off) {
    for (int i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        off[i] = (size_t)(tab[t / bs] * bs + t % bs) * row;
    }
}

/* 8 dot products <q, K[t]> (t = 8 rows at off[0..7] + h0) as one vector, nv 8-float
 * vectors each: the horizontal sums are done together (hadd tree) instead of one per row. */
static inline __attribute__((always_inline)) v8 dot8(const v8 *q, const void *kc, const size_t *off, size_t h0,
                                                     int nv, const int kind) {
    v8 a[8];
    for (int t = 0; t < 8; t++) {
        v8 x = q[0] * ldkv(kc, off[t] + h0, kind);
        for (int j = 1; j < nv; j++) x += q[j] * ldkv(kc, off[t] + h0 + 8 * j, kind);
        a[t] = x;
    }
#ifdef __AVX__
    __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
#else
    v8 r;
    for (int t = 0; t < 8; t++) r[t] = hsum(a[t]);
    return r;
#endif
}

static inline __attribute__((always_inline)) void work_body(job_t *J, const int kind) {
    const int Hq = J->Hq, Hkv = J->Hkv, g = Hq / Hkv, D = J->D, nv = D / 8;
    const size_t Lp = (size_t)((J->max_len + CH - 1) / CH * CH);
    float *scores = (float *)aligned_alloc(32, sizeof(float) * (size_t)Hq * Lp);
    v8 *acc = (v8 *)aligned_alloc(32, sizeof(v8) * (size_t)Hq * nv);
    v8 *qv = (v8 *)aligned_alloc(32, sizeof(v8) * (size_t)Hq * nv);
    if (!scores || !acc || !qv) {
        free(scores);
        free(acc);
        free(qv);
        J->status = -1;
        return;
    }
    const size_t row = (size_t)Hkv * D;
    size_t off[CH];
    for (int b = J->first; b < J->last; b++) {
        const int64_t Lfull = J->seq_len[b];
        const int64_t lo = (J->window > 0 && Lfull > J->window) ? Lfull - J->window : 0;
        const int64_t L = Lfull - lo; /* visible tokens */
        const int64_t Lr = (L + 7) / 8 * 8;
        const int64_t *tab = J->block_tables + (size_t)b * J->nb_stride;
        const float *qb = J->q + (size_t)b * Hq * D;
        for (int i = 0; i < Hq * nv; i++) qv[i] = ld(qb + 8 * (size_t)i) * J->scale;
        /* pass 1, chunk by chunk: scores of every query head over the chunk's K rows */
        for (int64_t c = 0; c < L; c += CH) {
            const int n = (int)(L - c < CH ? L - c : CH);
            chunk_rows(tab, J->block_size, lo + c, n, row, off);
            const int n8 = n / 8 * 8;
            for (int h = 0; h < Hkv; h++) {
                for (int gi = 0; gi < g; gi++) {
                    const v8 *q = qv + (h * g + gi) * nv;
                    float *s = scores + (size_t)(h * g + gi) * Lp + c;
                    for (int t = 0; t < n8; t += 8) st(s + t, dot8(q, J->kc, off + t, (size_t)h * D, nv, kind));
                    for (int t = n8; t < n; t++) {
                        v8 a = q[0] * ldkv(J->kc, off[t] + (size_t)h * D, kind);
                        for (int j = 1; j < nv; j++) a += q[j] * ldkv(J->kc, off[t] + (size_t)h * D + 8 * j, kind);
                        s[t] = hsum(a);
                    }
                }
            }
        }
        /* softmax per query head */
        for (int hq = 0; hq < Hq; hq++) {
            float *s = scores + (size_t)hq * Lp;
            float m = s[0];
            for (int64_t t = 1; t < L; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = L; t < Lr; t++) s[t] = -INFINITY; /* padding -> exp 0 */
            v8 vs = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t t = 0; t < Lr; t += 8) {
                v8 e = vexp(ld(s + t) - m);
                st(s + t, e);
                vs += e;
            }
            const float inv = 1.f / hsum(vs);
            for (int64_t t = 0; t < Lr; t += 8) st(s + t, ld(s + t) * inv);
        }
        /* pass 2, chunk by chunk: each query head's weighted sum over the chunk's V rows,
         * 8 output columns at a time held in a register across the chunk */
        for (int i = 0; i < Hq * nv; i++) acc[i] = (v8){0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t c = 0; c < L; c += CH) {
            const int n = (int)(L - c < CH ? L - c : CH);
            chunk_rows(tab, J->block_size, lo + c, n, row, off);
            for (int h = 0; h < Hkv; h++) {
                for (int gi = 0; gi < g; gi++) {
                    const float *p = scores + (size_t)(h * g + gi) * Lp + c;
                    v8 *a = acc + (h * g + gi) * nv;
                    int j = 0;
                    for (; j + 8 <= nv; j += 8) { /* 8 independent accumulators in registers */
                        v8 x[8];
                        for (int u = 0; u < 8; u++) x[u] = a[j + u];
                        for (int t = 0; t < n; t++) {
                            const size_t o = off[t] + (size_t)h * D + 8 * (size_t)j;
                            for (int u = 0; u < 8; u++) x[u] += p[t] * ldkv(J->vc, o + 8 * u, kind);
                        }
                        for (int u = 0; u < 8; u++) a[j + u] = x[u];
                    }
                    for (; j < nv; j++) {
                        v8 x = a[j];
                        for (int t = 0; t < n; t++) x += p[t] * ldkv(J->vc, off[t] + (size_t)h * D + 8 * j, kind);
                        a[j] = x;
                    }
                }
            }
        }
        float *ob = J->out + (size_t)b * Hq * D;
        for (int i = 0; i < Hq * nv; i++) st(ob + 8 * (size_t)i, acc[i]);
    }
    free(scores);
    free(acc);
    free(qv);
    J->status = 0;
}

static void *work_f32(void *arg) {
    work_body((job_t *)arg, KV_F32);
    return NULL;
}
static void *work_f16(void *arg) {
    work_body((job_t *)arg, KV_F16);
    return NULL;
}
static void *work_bf16(void *arg) {
    work_body((job_t *)arg, KV_BF16);
    return NULL;
}

/* q, out: (B, Hq, D) float32; kc, vc: (slots, Hkv, D) of kv_kind (0 float32, 1 float16,
 * 2 bfloat16); block_tables (B, nb_stride) int64; seq_len[b] = context length of sequence
 * b (its new token included); window > 0: only its last `window` tokens are visible.
 * Returns 0; -1 when memory could not be had; -2 for shapes it does not take. */
int dl_paged_decode(const float *q, const void *kc, const void *vc, float *out, const int64_t *block_tables,
                    const int64_t *seq_len, int B, int nb_stride, int block_size, int window, int Hq, int Hkv,
                    int D, float scale, int kv_kind, int nthreads) {
    const int tasks = B;
    if (D % 8 != 0 || D > 256 || Hq % Hkv != 0 || kv_kind < 0 || kv_kind > 2) return -2; /* the caller uses its torch path */
    void *(*fn)(void *) = kv_kind == KV_F32 ? work_f32 : kv_kind == KV_F16 ? work_f16 : work_bf16;
    int64_t max_len = 1;
    for (int b = 0; b < B; b++) max_len = seq_len[b] > max_len ? seq_len[b] : max_len;
    if (window > 0 && max_len > window) max_len = window;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > tasks) nthreads = tasks;
    if (nthreads > 64) nthreads = 64;
    job_t jobs[64];
    pthread_t tids[64];
    int started[64] = {0};
    for (int i = 0; i < nthreads; i++) {
        jobs[i] = (job_t){q, kc, vc, out, block_tables, seq_len, B, Hq, Hkv, D, nb_stride, block_size, window, scale,
                          (int)((int64_t)tasks * i / nthreads), (int)((int64_t)tasks * (i + 1) / nthreads),
                          (int)max_len, -1};
    }
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
    return rc;
}
