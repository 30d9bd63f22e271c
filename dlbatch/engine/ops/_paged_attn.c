/* Paged decode attention for CPUs, float32 (see dlbatch/engine/ops/native.py).
 *
 * One call per layer for the whole decode batch. For each (sequence, KV head) pair the
 * g = Hq / Hkv query heads of its group read the sequence's keys and values straight from
 * the paged cache, run by run (a run = consecutive cache slots), in two passes:
 *   1. scores s[gi][t] = scale * <q[gi], K[t]> for every context token, then softmax;
 *   2. out[gi] = sum_t p[gi][t] * V[t].
 * Each K and V row is read once for the whole group (GQA), with no gather, no padding
 * and no per-sequence operator dispatch: the torch version issues ~6 small ops per
 * sequence per layer, whose dispatch and thread barriers dominate decode at batch > 1.
 * The (sequence, head) pairs are split over `nthreads` POSIX threads.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *kc, *vc;
    float *out;
    const int64_t *run_start, *run_len, *seq_run_off, *seq_len;
    int B, Hq, Hkv, D;
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

static void *work(void *arg) {
    job_t *J = (job_t *)arg;
    const int Hq = J->Hq, Hkv = J->Hkv, g = Hq / Hkv, D = J->D, nv = D / 8;
    const size_t Lp = (size_t)((J->max_len + 7) / 8 * 8);
    float *scores = (float *)aligned_alloc(32, sizeof(float) * (size_t)Hq * Lp);
    v8 *acc = (v8 *)aligned_alloc(32, sizeof(v8) * (size_t)Hq * nv);
    v8 *qv = (v8 *)aligned_alloc(32, sizeof(v8) * (size_t)Hq * nv);
    if (!scores || !acc || !qv) {
        free(scores);
        free(acc);
        free(qv);
        J->status = -1;
        return NULL;
    }
    for (int b = J->first; b < J->last; b++) {
        const int64_t L = J->seq_len[b];
        const int64_t Lr = (L + 7) / 8 * 8;
        const float *qb = J->q + (size_t)b * Hq * D;
        for (int i = 0; i < Hq * nv; i++) qv[i] = ld(qb + 8 * (size_t)i) * J->scale;
        /* pass 1: scores of every head, reading each token's K row (all heads) once, in order */
        int64_t idx = 0;
        for (int64_t r = J->seq_run_off[b]; r < J->seq_run_off[b + 1]; r++) {
            const int64_t s0 = J->run_start[r], n = J->run_len[r];
            for (int64_t t = s0; t < s0 + n; t++, idx++) {
                const float *k = J->kc + (size_t)t * Hkv * D;
                for (int h = 0; h < Hkv; h++) {
                    const float *kh = k + (size_t)h * D;
                    for (int gi = 0; gi < g; gi++) {
                        const v8 *qg = qv + (h * g + gi) * nv;
                        v8 a = qg[0] * ld(kh);
                        for (int j = 1; j < nv; j++) a += qg[j] * ld(kh + 8 * j);
                        scores[(size_t)(h * g + gi) * Lp + idx] = hsum(a);
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
        /* pass 2: weighted sum of values, each token's V row read once, in order */
        for (int i = 0; i < Hq * nv; i++) acc[i] = (v8){0, 0, 0, 0, 0, 0, 0, 0};
        idx = 0;
        for (int64_t r = J->seq_run_off[b]; r < J->seq_run_off[b + 1]; r++) {
            const int64_t s0 = J->run_start[r], n = J->run_len[r];
            for (int64_t t = s0; t < s0 + n; t++, idx++) {
                const float *v = J->vc + (size_t)t * Hkv * D;
                for (int h = 0; h < Hkv; h++) {
                    const float *vh = v + (size_t)h * D;
                    for (int gi = 0; gi < g; gi++) {
                        const float p = scores[(size_t)(h * g + gi) * Lp + idx];
                        v8 *a = acc + (h * g + gi) * nv;
                        for (int j = 0; j < nv; j++) a[j] += p * ld(vh + 8 * j);
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
    return NULL;
}

/* q, out: (B, Hq, D); kc, vc: (slots, Hkv, D); runs of sequence b are
 * [seq_run_off[b], seq_run_off[b+1]) in run_start/run_len; seq_len[b] = sum of its runs.
 * Returns 0; -1 when memory could not be had; -2 for shapes it does not take (D % 8). */
int dl_paged_decode_f32(const float *q, const float *kc, const float *vc, float *out, const int64_t *run_start,
                        const int64_t *run_len, const int64_t *seq_run_off, const int64_t *seq_len, int B, int Hq,
                        int Hkv, int D, float scale, int nthreads) {
    const int tasks = B;
    if (D % 8 != 0 || Hq % Hkv != 0) return -2; /* the caller uses its torch path */
    int64_t max_len = 1;
    for (int b = 0; b < B; b++) max_len = seq_len[b] > max_len ? seq_len[b] : max_len;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > tasks) nthreads = tasks;
    if (nthreads > 64) nthreads = 64;
    job_t jobs[64];
    pthread_t tids[64];
    int started[64] = {0};
    for (int i = 0; i < nthreads; i++) {
        jobs[i] = (job_t){q, kc, vc, out, run_start, run_len, seq_run_off, seq_len, B, Hq, Hkv, D, scale,
                          (int)((int64_t)tasks * i / nthreads), (int)((int64_t)tasks * (i + 1) / nthreads),
                          (int)max_len, -1};
    }
    for (int i = 1; i < nthreads; i++) started[i] = pthread_create(&tids[i], NULL, work, &jobs[i]) == 0;
    work(&jobs[0]);
    int rc = jobs[0].status;
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) {
            pthread_join(tids[i], NULL);
        } else {
            work(&jobs[i]); /* could not start a thread: do its share here */
        }
        if (jobs[i].status != 0) rc = -1;
    }
    return rc;
}
