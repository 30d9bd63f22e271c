/* Fused elementwise ops of a decoder layer for CPUs (see dlbatch/engine/ops/native.py).
 *
 * The reference ops are chains of torch ops: rms_norm is six of them (square, mean, add,
 * rsqrt, two multiplies), rotary about ten per tensor, each a pass over the activations
 * with a tensor of its own. Here each op is one pass per row, float32:
 *   dl_rms_norm       out = w * (h * 1/sqrt(mean(h^2) + eps)), h = x (+ res: h is written)
 *   dl_silu_and_mul   out = silu(x[:, :n]) * x[:, n:]
 *   dl_rotary_store   rotary (rotate-half form) on q and k in place, then k and v written to
 *                     their cache slots (float32, float16 or bfloat16; a slot < 0 is skipped)
 * Activations are float32; rms_norm also takes bfloat16 and rotary float16/bfloat16 (a model
 * computing in half precision on a CPU with AMX). Half precision is widened to float32 and
 * each result rounded (to nearest even, as torch rounds) where the reference's chain of
 * half-precision ops rounds: rotary gives the reference's bits, rms_norm may differ in the
 * last place (squares summed in another order). In float32 the arithmetic per element is the
 * reference's (the compiler may fuse a multiply and an add; the squares are summed in another
 * order). rms_norm and silu_and_mul run on vectors of W floats, rotary's half precision
 * element by element (its rows are short). Where AVX-512 exists, bfloat16 rows (rms_norm,
 * silu_and_mul, rotary) run on 16-float vectors with masked tails instead (the 8-wide code
 * compiles to long shuffle chains for bf16); silu_and_mul takes bf16 only there: the 8-wide
 * version was slower than torch's (docs/benchmarks.md).
 * Every row is computed alone: a row's result never depends on the other rows of the
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

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
#define AI static inline __attribute__((always_inline))

/* element i of a row of `kind` as float32, and back (rounded to nearest even as torch rounds) */
AI float get1(const void *p, int64_t i, const int kind) {
    if (kind == KV_F32) return ((const float *)p)[i];
    if (kind == KV_F16) return (float)((const _Float16 *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* v rounded to `kind`'s precision (what a half-precision torch op stores) */
AI float rnd(float v, const int kind) {
    if (kind == KV_F32) return v;
    if (kind == KV_F16) {  /* through memory: GCC's default -fexcess-precision=fast may skip a cast's rounding */
        volatile _Float16 h = (_Float16)v;
        return (float)h;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    u = isnan(v) ? 0x7FC00000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

AI void put1(void *p, int64_t i, float v, const int kind) {
    if (kind == KV_F32) {
        ((float *)p)[i] = v;
    } else if (kind == KV_F16) {
        ((_Float16 *)p)[i] = (_Float16)v;
    } else {  /* the upper half of v rounded to bf16 */
        uint32_t u;
        v = rnd(v, KV_BF16);
        memcpy(&u, &v, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    }
}

/* n elements from a row of kind sk to a row of kind dk */
static void copy_row(void *dst, const int dk, const void *src, const int sk, int64_t n) {
    if (dk == sk) { memcpy(dst, src, (size_t)n * (dk == KV_F32 ? 4 : 2)); return; }
    for (int64_t i = 0; i < n; i++) put1(dst, i, get1(src, i, sk), dk);
}

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

/* bfloat16 rows on vectors: W elements widened (a shift), and rounded back to nearest even
 * (NaN stays NaN) as torch rounds; the last n < W elements of a row through a zeroed buffer */
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

static inline vf ldb(const void *p) { vh h; memcpy(&h, p, sizeof h); return (vf)(__builtin_convertvector(h, vu) << 16); }
static inline vf rndb(vf x) {
    const vu u = (vu)x, r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return sel(x != x, (vf)((vu){0} + 0x7FC00000u), (vf)r);
}
static inline void stb(void *p, vf x) { vh h = __builtin_convertvector((vu)rndb(x) >> 16, vh); memcpy(p, &h, sizeof h); }
/* the first n <= W elements (a whole vector when n == W) */
static inline vf ldb_n(const void *p, int64_t n) {
    if (n == W) return ldb(p);
    uint16_t t[W] = {0};
    memcpy(t, p, (size_t)n * 2);
    return ldb(t);
}
static inline void stb_n(void *p, vf x, int64_t n) {
    if (n == W) { stb(p, x); return; }
    uint16_t t[W];
    stb(t, x);
    memcpy(p, t, (size_t)n * 2);
}

/* a bfloat16 row, rounded where the reference's bf16 chain rounds: h = rnd(res + x), the
 * scaled row (its .to(dtype)), the product with w; the squares summed in float32 */
static void norm_row_b(const uint16_t *x, const uint16_t *res, uint16_t *h, uint16_t *out, const uint16_t *w,
                       int64_t n, float eps) {
    vf acc = {0};
    for (int64_t i = 0; i < n; i += W) {
        const int64_t m = n - i < W ? n - i : W;
        vf v = ldb_n(x + i, m);
        if (res) {
            v = rndb(ldb_n(res + i, m) + v);
            stb_n(h + i, v, m);
        }
        acc += v * v;
    }
    float ss = 0.0f;
    for (int j = 0; j < W; j++) ss += acc[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    const uint16_t *src = res ? h : x;
    for (int64_t i = 0; i < n; i += W) {
        const int64_t m = n - i < W ? n - i : W;
        const vf y = ldb_n(w + i, m) * rndb(ldb_n(src + i, m) * r);
        stb_n(out + i, y, m);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* bfloat16 rows on 16-float AVX-512 vectors, the same roundings as the 8-wide code above
 * (which compilers turn into a long chain of shuffles for bf16): a row's tail through
 * masked loads (zeros) and stores, exp by scalef (2^n of any n, so overflow gives inf) */
#include <immintrin.h>
#define B16 1
typedef float vf16 __attribute__((vector_size(64)));
#define vf vf16
#undef F
#define F(name) name##_w16
#include "_vexp.h"
#undef F
#undef vf

static inline __mmask16 tail16(int64_t m) { return m >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1u); }
static inline __m512 ld16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
/* bf16 bits of x, rounded to nearest even as torch rounds (NaN -> 0x7FC0), one per 32-bit lane */
static inline __m512i bits16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
#ifdef __AVX512BF16__
/* the CPU's own rounding (vcvtneps2bf16): the same bits but for NaN's sign and payload and
 * inputs below bf16's smallest normal (~1.2e-38), which it flushes to zero */
static inline __m256i pack16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
static inline __m256i pack16(__m512 x) { return _mm512_cvtepi32_epi16(bits16(x)); }
#endif
static inline __m512 rnd16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pack16(x)), 16));
}
static inline void st16(uint16_t *p, __m512 x, __mmask16 k) { _mm256_mask_storeu_epi16(p, k, pack16(x)); }

static void norm_row_b16(const uint16_t *x, const uint16_t *res, uint16_t *h, uint16_t *out, const uint16_t *w,
                         int64_t n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        __m512 v = ld16(x + i, k);
        if (res) {
            v = rnd16(_mm512_add_ps(ld16(res + i, k), v));
            st16(h + i, v, k);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
    const uint16_t *src = res ? h : x;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        st16(out + i, _mm512_mul_ps(ld16(w + i, k), rnd16(_mm512_mul_ps(ld16(src + i, k), r))), k);
    }
}

/* exp(x) for any x: |rel err| < 2e-7 where the result is normal, inf above ~88.7, 0 below -104 */
static inline __m512 vexp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf16 r = (vf16)x - (vf16)n * 0.693145751953125f - (vf16)n * 1.428606765330187045e-06f;
    return _mm512_scalef_ps((__m512)exp_poly_w16(r), n);
}

/* out = rnd(rnd(silu(a)) * b): silu rounded to bf16 as torch's bf16 silu stores it, then the product */
static void silu_row_b16(const uint16_t *a, const uint16_t *b, uint16_t *o, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        const __m512 x = ld16(a + i, k);
        const __m512 s = rnd16(_mm512_div_ps(x, _mm512_add_ps(one, vexp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        st16(o + i, _mm512_mul_ps(s, ld16(b + i, k)), k);
    }
}

/* rotate_h for bf16, 16 pairs at a time: each product rounded, then their sum */
static void rotate_b16(uint16_t *p, const uint16_t *c, const uint16_t *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 k = tail16(half - i);
        const __m512 a = ld16(p + i, k), b = ld16(p + half + i, k);
        const __m512 x = _mm512_sub_ps(rnd16(_mm512_mul_ps(a, ld16(c + i, k))), rnd16(_mm512_mul_ps(b, ld16(s + i, k))));
        const __m512 y = _mm512_add_ps(rnd16(_mm512_mul_ps(b, ld16(c + half + i, k))),
                                       rnd16(_mm512_mul_ps(a, ld16(s + half + i, k))));
        st16(p + i, x, k);
        st16(p + half + i, y, k);
    }
}
#else
#define B16 0
#endif

/* 16 when bfloat16 rows run on the 16-float vectors above, else 0 (then a bf16 silu_and_mul
 * is torch's: faster than the 8-wide code) */
int dl_fused_bf16_width(void) { return B16 ? 16 : 0; }

/* rows of n elements of kind `ak` (float32 or bfloat16): x row r at x + r * xs elements (res,
 * h likewise; res and h NULL for plain rms_norm) */
void dl_rms_norm(const void *x, int64_t xs, const void *res, int64_t rs, void *h, int64_t hs,
                 void *out, int64_t os, const void *w, int64_t rows, int64_t n, float eps, int ak, int nthreads) {
    const int nt = threads_for(rows, n, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#if B16
        if (ak == KV_BF16) {
            norm_row_b16((const uint16_t *)x + r * xs, res ? (const uint16_t *)res + r * rs : 0,
                         res ? (uint16_t *)h + r * hs : 0, (uint16_t *)out + r * os, w, n, eps);
            continue;
        }
#endif
        if (ak == KV_BF16)
            norm_row_b((const uint16_t *)x + r * xs, res ? (const uint16_t *)res + r * rs : 0,
                       res ? (uint16_t *)h + r * hs : 0, (uint16_t *)out + r * os, w, n, eps);
        else
            norm_row((const float *)x + r * xs, res ? (const float *)res + r * rs : 0,
                     res ? (float *)h + r * hs : 0, (float *)out + r * os, w, n, eps);
    }
}

static inline vf silu_mul(vf a, vf b) { return a / (1.0f + vexp(-a)) * b; }

/* x row r: n gate values then n up values at x + r * xs; out row r: n values at out + r * os;
 * rows of kind `ak`: float32, or bfloat16 where dl_fused_bf16_width() is 16 */
void dl_silu_and_mul(const void *xv, int64_t xs, void *outv, int64_t os, int64_t rows, int64_t n, int ak,
                     int nthreads) {
    const int nt = threads_for(rows, 2 * n, nthreads);
    (void)ak; /* float32 only without the 16-float path */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#if B16
        if (ak == KV_BF16) {
            const uint16_t *a = (const uint16_t *)xv + r * xs;
            silu_row_b16(a, a + n, (uint16_t *)outv + r * os, n);
            continue;
        }
#endif
        const float *a = (const float *)xv + r * xs, *b = a + n;
        float *o = (float *)outv + r * os;
        int64_t i = 0;
        for (; i + W <= n; i += W) st(o + i, silu_mul(ld(a + i), ld(b + i)));
        if (i < n) st_part(o + i, silu_mul(ld_part(a + i, n - i), ld_part(b + i, n - i)), n - i);
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

/* rotate() for a half-precision head (kind k): each product rounded, then their sum, as the
 * reference's q * cos + rotate_half(q) * sin rounds */
AI void rotate_h(void *p, const void *c, const void *s, int64_t half, const int k) {
    for (int64_t i = 0; i < half; i++) {
        const float a = get1(p, i, k), b = get1(p, half + i, k);
        put1(p, i, rnd(a * get1(c, i, k), k) - rnd(b * get1(s, i, k), k), k);
        put1(p, half + i, rnd(b * get1(c, half + i, k), k) + rnd(a * get1(s, half + i, k), k), k);
    }
}

static void rotate_any(void *p, const void *c, const void *s, int64_t half, int ak) {
    if (ak == KV_F32) rotate((float *)p, (const float *)c, (const float *)s, half);
#if B16
    else if (ak == KV_BF16) rotate_b16((uint16_t *)p, (const uint16_t *)c, (const uint16_t *)s, half);
#else
    else if (ak == KV_BF16) rotate_h(p, c, s, half, KV_BF16);
#endif
    else rotate_h(p, c, s, half, KV_F16);
}

/* token t: q heads at q + t * sq_t + h * sq_h elements (k, v likewise), cos and sin rows of d
 * elements at cos + t * d, all of kind `ak`; the cache (kind `kind`) row of (slot, kv head h)
 * at element slot * Hkv * d + h * d */
void dl_rotary_store(void *q, int64_t sq_t, int64_t sq_h, void *k, int64_t sk_t, int64_t sk_h,
                     const void *v, int64_t sv_t, int64_t sv_h, const void *cos, const void *sin,
                     const int64_t *slots, void *kc, void *vc, int kind, int64_t T, int hq, int hk, int64_t d,
                     int ak, int nthreads) {
    const int64_t half = d / 2;
    const size_t esize = kind == KV_F32 ? 4 : 2, ae = ak == KV_F32 ? 4 : 2;
    const int nt = threads_for(T, (int64_t)(hq + 2 * hk) * d, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *c = (const char *)cos + t * d * ae, *s = (const char *)sin + t * d * ae;
        for (int h = 0; h < hq; h++) rotate_any((char *)q + (t * sq_t + h * sq_h) * ae, c, s, half, ak);
        const int64_t slot = slots[t];
        for (int h = 0; h < hk; h++) {
            char *kp = (char *)k + (t * sk_t + h * sk_h) * ae;
            rotate_any(kp, c, s, half, ak);
            if (slot < 0) continue;
            const size_t row = ((size_t)slot * (size_t)hk + (size_t)h) * (size_t)d * esize;
            copy_row((char *)kc + row, kind, kp, ak, d);
            copy_row((char *)vc + row, kind, (const char *)v + (t * sv_t + h * sv_h) * ae, ak, d);
        }
    }
}
