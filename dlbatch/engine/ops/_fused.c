/* Fused elementwise ops of a decoder layer for CPUs (see dlbatch/engine/ops/native.py).
 *
 * The reference ops are chains of torch ops: rms_norm is six of them (square, mean, add,
 * rsqrt, two multiplies), rotary about ten per tensor, each a pass over the activations
 * with a tensor of its own. Here each op is one pass per row, float32:
 *   dl_rms_norm       out = w * (h * 1/sqrt(mean(h^2) + eps)), h = x (+ res: h is written)
 *   dl_silu_and_mul   out = silu(x[:, :n]) * x[:, n:]
 *   dl_rotary_store   rotary (rotate-half form) on q and k in place, then k and v written to
 *                     their cache slots (float32, float16 or bfloat16; a slot < 0 is skipped)
 * The arithmetic per element is the reference's (same operations in the same order; the
 * compiler may fuse a multiply and an add, and the squares are summed in another order),
 * and every row is computed alone: a row's result never depends on the other rows of the
 * call (a resumed sampling job batches differently and must draw the same tokens).
 * Rows are split over `nthreads` OpenMP threads (torch's own workers, as in
 * _paged_attn.c) when a call is big enough to pay for waking them; built without OpenMP,
 * one thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define W 8
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

/* below this many floats a call runs on the calling thread */
#define PAR_MIN 32768

static inline int threads_for(int64_t rows, int64_t per_row, int nthreads) {
    return rows * per_row < PAR_MIN || nthreads < 1 ? 1 : nthreads;
}

static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }
/* m ? a : b lane by lane (m: all ones or all zeros per lane, as comparisons give) */
static inline vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

#define F(name) name##_w8
#include "_vexp.h"

/* exp(x), |rel err| < 2e-7 on [-87, 88]; below, 0 (x = -inf included); above, +inf */
static inline vf vexp(vf x) {
    const vf hi = splat(88.7f), lo = splat(-87.3f);
    const vi big = x > hi, small = x < lo;
    x = sel(big, hi, sel(small, lo, x));
    vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + sel(x >= 0, splat(0.5f), splat(-0.5f)), vi), vf);
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = F(exp_poly)(r);
    /* 2^n in two halves so that n = 128 (x near 88.7) does not overflow the exponent */
    vi ni = __builtin_convertvector(n, vi);
    vi n1 = ni >> 1, n2 = ni - n1;
    vf s1, s2;
    vi e1 = (n1 + 127) << 23, e2 = (n2 + 127) << 23;
    memcpy(&s1, &e1, sizeof s1);
    memcpy(&s2, &e2, sizeof s2);
    vf y = p * s1 * s2;
    return sel(big, splat(INFINITY), sel(small, splat(0.0f), y));
}

/* the first `n` (< W) floats of p as a vector, the rest 0; and back */
static inline vf ld_part(const float *p, int64_t n) { vf v = {0}; memcpy(&v, p, (size_t)n * 4); return v; }
static inline void st_part(float *p, vf v, int64_t n) { memcpy(p, &v, (size_t)n * 4); }

static void norm_row(const float *x, const float *res, float *h, float *out, const float *w, int64_t n, float eps) {
    vf acc = {0};
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        vf v = ld(x + i);
        if (res) { v = ld(res + i) + v; st(h + i, v); }
        acc += v * v;
    }
    for (; i < n; i++) {
        float v = x[i];
        if (res) { v = res[i] + v; h[i] = v; }
        tail += v * v;
    }
    float ss = tail;
    for (int j = 0; j < W; j++) ss += acc[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    const float *src = res ? h : x;
    for (i = 0; i + W <= n; i += W) st(out + i, ld(w + i) * (ld(src + i) * r));
    for (; i < n; i++) out[i] = w[i] * (src[i] * r);
}

/* rows of n floats: x row r at x + r * xs (res, h likewise; res and h NULL for plain rms_norm) */
void dl_rms_norm(const float *x, int64_t xs, const float *res, int64_t rs, float *h, int64_t hs,
                 float *out, int64_t os, const float *w, int64_t rows, int64_t n, float eps, int nthreads) {
    const int nt = threads_for(rows, n, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * xs, res ? res + r * rs : 0, res ? h + r * hs : 0, out + r * os, w, n, eps);
}

static inline vf silu_mul(vf a, vf b) { return a / (1.0f + vexp(-a)) * b; }

/* x row r: n gate values then n up values at x + r * xs; out row r: n values at out + r * os */
void dl_silu_and_mul(const float *x, int64_t xs, float *out, int64_t os, int64_t rows, int64_t n, int nthreads) {
    const int nt = threads_for(rows, 2 * n, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * xs, *b = a + n;
        float *o = out + r * os;
        int64_t i = 0;
        for (; i + W <= n; i += W) st(o + i, silu_mul(ld(a + i), ld(b + i)));
        if (i < n) st_part(o + i, silu_mul(ld_part(a + i, n - i), ld_part(b + i, n - i)), n - i);
    }
}

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* n floats to the cache row at dst in its format, rounded to nearest even as torch does */
static void put_row(void *dst, const float *src, int64_t n, int kind) {
    if (kind == KV_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (kind == KV_F16) {
        _Float16 *d = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, src + i, 4);
            d[i] = isnan(src[i]) ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        }
    }
}

/* one head of `d` floats at p: a = p[:d/2], b = p[d/2:] -> (a*c1 - b*s1, b*c2 + a*s2) */
static inline void rotate(float *p, const float *c, const float *s, int64_t half) {
    int64_t i = 0;
    for (; i + W <= half; i += W) {
        vf a = ld(p + i), b = ld(p + half + i);
        st(p + i, a * ld(c + i) - b * ld(s + i));
        st(p + half + i, b * ld(c + half + i) + a * ld(s + half + i));
    }
    for (; i < half; i++) {
        float a = p[i], b = p[half + i];
        p[i] = a * c[i] - b * s[i];
        p[half + i] = b * c[half + i] + a * s[half + i];
    }
}

/* token t: q heads at q + t * sq_t + h * sq_h (k, v likewise), cos and sin rows of d floats
 * at cos + t * d; the cache row of (slot, kv head h) at element slot * Hkv * d + h * d */
void dl_rotary_store(float *q, int64_t sq_t, int64_t sq_h, float *k, int64_t sk_t, int64_t sk_h,
                     const float *v, int64_t sv_t, int64_t sv_h, const float *cos, const float *sin,
                     const int64_t *slots, void *kc, void *vc, int kind, int64_t T, int hq, int hk, int64_t d,
                     int nthreads) {
    const int64_t half = d / 2;
    const size_t esize = kind == KV_F32 ? 4 : 2;
    const int nt = threads_for(T, (int64_t)(hq + 2 * hk) * d, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int h = 0; h < hq; h++) rotate(q + t * sq_t + h * sq_h, c, s, half);
        const int64_t slot = slots[t];
        for (int h = 0; h < hk; h++) {
            float *kp = k + t * sk_t + h * sk_h;
            rotate(kp, c, s, half);
            if (slot < 0) continue;
            const size_t row = ((size_t)slot * (size_t)hk + (size_t)h) * (size_t)d * esize;
            put_row((char *)kc + row, kp, d, kind);
            put_row((char *)vc + row, v + t * sv_t + h * sv_h, d, kind);
        }
    }
}
