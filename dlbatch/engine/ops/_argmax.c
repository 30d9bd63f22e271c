/* Row-wise argmax of a float32 matrix for CPUs (greedy sampling; see
 * dlbatch/engine/ops/native.py). torch's argmax over the vocabulary tracks indices
 * element by element; here pass 1 finds the row maximum with 8-wide vector max
 * (vectorised), pass 2 the first index holding it. Same result as torch.argmax: the
 * first maximal element, or the first NaN when the row has one. Rows are split over
 * `nthreads` threads: an OpenMP parallel region when built with -fopenmp (torch's own
 * worker threads take it; see _paged_attn.c), else POSIX threads. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

typedef struct {
    const float *x;
    int64_t *out;
    int64_t cols, stride, first, last;
} job_t;

static int64_t row_argmax(const float *r, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
    if (n >= 8) {
        v8 vm, x;
        memcpy(&vm, r, sizeof vm);
        v8i vn = vm != vm;
        for (i = 8; i + 8 <= n; i += 8) {
            memcpy(&x, r + i, sizeof x);
            vn |= x != x;
            const v8i gt = x > vm;
            vm = (v8)((gt & (v8i)x) | (~gt & (v8i)vm));
        }
        for (int j = 0; j < 8; j++) {
            m = vm[j] > m ? vm[j] : m;
            nan |= vn[j] != 0;
        }
    }
    for (; i < n; i++) {
        nan |= r[i] != r[i];
        m = r[i] > m ? r[i] : m;
    }
    for (i = 0; i < n; i++) {
        if (nan ? r[i] != r[i] : r[i] == m) return i;
    }
    return 0;
}

static void *work(void *arg) {
    job_t *J = (job_t *)arg;
    for (int64_t b = J->first; b < J->last; b++) J->out[b] = row_argmax(J->x + b * J->stride, J->cols);
    return NULL;
}

/* x: (rows, cols) with row stride `stride` elements; out: (rows,) int64. */
void dl_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > rows) nthreads = (int)rows;
    if (nthreads > 64) nthreads = 64;
    job_t jobs[64];
    for (int i = 0; i < nthreads; i++)
        jobs[i] = (job_t){x, out, cols, stride, rows * i / nthreads, rows * (i + 1) / nthreads};
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
    for (int i = 0; i < nthreads; i++) work(&jobs[i]);
#else
    pthread_t tids[64];
    int started[64] = {0};
    for (int i = 1; i < nthreads; i++) started[i] = pthread_create(&tids[i], NULL, work, &jobs[i]) == 0;
    if (nthreads > 0) work(&jobs[0]);
    for (int i = 1; i < nthreads; i++) {
        if (started[i]) {
            pthread_join(tids[i], NULL);
        } else {
            work(&jobs[i]);
        }
    }
#endif
}
