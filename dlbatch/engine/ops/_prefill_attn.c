/* Prefill attention for CPUs (see dlbatch/engine/ops/native.py, prefill_attention).
 *
 * One call per layer for every prefill chunk of a step. A chunk is n new tokens of one
 * sequence at positions [ctx, ctx + n); each attends causally to the sequence's keys
 * [0, its own position], all read from the paged cache through the sequence's block table
 * (the step stored the chunk's own K and V there before attention), so a chunk over a
 * cached prefix (chunked prefill, a prefix-cache hit) is the same computation as a fresh
 * prompt. The cache may hold float32, float16 or bfloat16 (rows widened as they are
 * loaded); queries and the output are float32. Flash style: keys in blocks of BK, a
 * running maximum and sum per query row, no n x n score matrix.
 *
 * Work item: (chunk, KV head, block of up to BQ query positions). Its rows are the g =
 * Hq / Hkv query heads of that KV head at those positions (row r = position i * g + head),
 * so every K and V row loaded serves g x BQ rows. The queries are stored transposed
 * (Qt[d][r], scaled), so one key's scores for a vector of rows are a broadcast of the key's
 * elements times rows of Qt (S[j][r] = sum_d K[j][d] Qt[d][r]), the softmax statistics of a
 * vector of rows are vertical vector operations over the keys, and the output
 * O[r][:] += P[j][r] V[j][:] again broadcasts: register-tiled multiply-adds throughout, no
 * horizontal sums. Items are spread over `nthreads` OpenMP threads (torch's own workers,
 * as for _paged_attn.c), the longest first.
 *
 * Invariance: key blocks start at multiples of BK in absolute position, and keys past a
 * row's position (or before its sliding window) contribute exact zeros (their exponent is
 * set to 0, a rescale by exp(0) = 1 is exact), so a row's result does not depend on how its
 * sequence was cut into chunks nor on which rows shared its work item.
 *
 * bf16 queries over a bf16 cache (a model computing in bf16), where the CPU has
 * AVX512_BF16: the scores come from `vdpbf16ps` on the operands as they are (bf16 x bf16
 * products are exact in float32; pairs of them summed into float32 accumulators), twice
 * the multiply-adds of a float32 FMA per instruction. The queries are then stored as pairs
 * (Qp[d / 2][r] = q[r][d], q[r][d + 1]) and unscaled (the scale multiplies the scores), the
 * keys are copied as they are. The weighted values too: the probabilities rounded to bf16
 * (as torch's bf16 SDPA rounds them before its second matmul) and the V rows, both as pairs
 * of consecutive keys, by `vdpbf16ps` into float32 accumulators; the softmax's maximum,
 * sum and rescaling stay float32.
 *
 * Built where the compiler targets AVX-512 and has OpenMP: 16-float vectors (the measured
 * case, docs/benchmarks.md); elsewhere dl_prefill_attn_width() is 0 and the engine keeps
 * torch's SDPA. Head sizes: multiples of 16 up to 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BQ 64 /* query positions per work item */
#define BK 64 /* keys per block */
#define MAXG 16 /* query heads per KV head at most */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

typedef struct {
    const void *q;         /* float32, or bfloat16 (qbf16) */
    int64_t q_tok, q_head; /* element strides of q between tokens and between heads */
    const void *kc, *vc;
    float *out; /* (T, Hq, D) contiguous */
    const int64_t *tables, *cu_q, *ctx;
    int nb_stride, block_size, window, Hq, Hkv, D, kind, qbf16;
    float scale;
} pjob_t;

typedef struct {
    int p, h, qb;   /* chunk, KV head, block of query positions */
    int64_t work;   /* keys its rows read at most: the longest items start first */
} item_t;

#if defined(__AVX512F__) && defined(_OPENMP)
#include <immintrin.h>
#define W 16 /* floats per vector */

/* n (a multiple of 16) elements of a cache row from element off, as float32 into dst */
static inline void widen_row(const void *cache, int kind, size_t off, int n, float *dst) {
    if (kind == KV_F32) {
        memcpy(dst, (const float *)cache + off, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = (const uint16_t *)cache + off;
    for (int i = 0; i < n; i += 16) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(h + i));
        const __m512 y = kind == KV_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))
                                         : _mm512_cvtph_ps(x);
        _mm512_storeu_ps(dst + i, y);
    }
}

static int by_work(const void *x, const void *y) {
    const item_t *a = (const item_t *)x, *b = (const item_t *)y;
    if (a->work != b->work) return a->work > b->work ? -1 : 1;
    if (a->p != b->p) return a->p - b->p;
    if (a->h != b->h) return a->h - b->h;
    return a->qb - b->qb;
}

typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

static inline vf ld(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void st(float *p, vf x) { memcpy(p, &x, sizeof x); }

#define F(name) name /* _vexp.h names its function through F */
#include "_vexp.h"
#undef F

/* exp(x) for x <= 0 (scores less their row's maximum): 2^n * p(r) with n = round(x log2 e),
 * |rel err| < 2e-7; below -87 (and at -inf) it returns exp(-87), about 1.6e-38 (the caller
 * zeroes masked entries itself) */
static inline vf vexp(vf x) {
    x = (vf)_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.f));
    const vf n = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    return (vf)_mm512_scalef_ps((__m512)exp_poly(r), (__m512)n);
}

/* Scratch of one thread for items of up to R rows (padded to whole vector pairs). */
typedef struct {
    float *qt;      /* D x Rp: scaled queries, transposed (bf16 queries: D / 2 x Rp pairs, unscaled) */
    float *s;       /* BK x Rp: scores, then probabilities */
    float *o;       /* R x D: output accumulators */
    float *m, *l;   /* Rp: running maximum and sum per row */
    float *bmax;    /* Rp: this block's maximum score per row (-inf: nothing visible) */
    float *corr;    /* Rp: this block's rescale per row */
    float *kb, *vb; /* BK x D: a half-precision cache's K and V rows of the block, widened
                     * (bf16 queries: the K and V rows as they are, BK x D bf16) */
    uint32_t *pp;   /* BK / 2 x Rp (bf16 queries): probabilities of key pairs, bf16 pairs */
    uint32_t *vp;   /* BK / 2 x D (bf16 queries): V rows of key pairs, bf16 pairs */
    const float *krow[BK], *vrow[BK]; /* each key's float32 row of this KV head */
    size_t kstride; /* floats between consecutive keys of a score tile (UK keys of one cache block) */
    int32_t *pos;   /* Rp: each row's position */
    int32_t *idx;   /* Rp: each row's offset in q from the item's first token */
} scratch_t;

#define UK 8 /* keys per score tile: 8 x 2 accumulators */

/* masked: keys a row may not see (past its position, before its window) -> -inf */
static inline vf mask_keys(vf x, vi pos, int32_t key, int window) {
    vi vis = pos >= key;
    if (window > 0) vis &= pos - window < key;
    return (vf)(((vi)x & vis) | ((vi)((vf){0} - INFINITY) & ~vis));
}

/* scores of keys [j0, j0 + UK) of the block (at kb) for rows [r0, r0 + 2W), masked when
 * `masked`, stored in S->s and folded into the rows' block maximum bm */
static inline __attribute__((always_inline)) void qk_tile(scratch_t *S, int Rp, int D, int r0, int j0, int64_t kb,
                                                          int window, int masked, vf *bm) {
    vf a[UK][2];
    for (int u = 0; u < UK; u++) a[u][0] = a[u][1] = (vf){0};
    const float *qt = S->qt + r0, *k = S->krow[j0];
    const size_t ks = S->kstride;
    for (int d = 0; d < D; d++) {
        const vf x0 = ld(qt + (size_t)d * Rp), x1 = ld(qt + (size_t)d * Rp + W);
        for (int u = 0; u < UK; u++) {
            const vf kv = (vf)_mm512_set1_ps(k[(size_t)u * ks + d]);
            a[u][0] += kv * x0;
            a[u][1] += kv * x1;
        }
    }
    vi pos[2];
    memcpy(pos, S->pos + r0, sizeof pos);
    for (int u = 0; u < UK; u++) {
        for (int v = 0; v < 2; v++) {
            vf x = a[u][v];
            if (masked) x = mask_keys(x, pos[v], (int32_t)(kb + j0 + u), window);
            const vi gt = x > bm[v];
            bm[v] = (vf)(((vi)x & gt) | ((vi)bm[v] & ~gt));
            st(S->s + (size_t)(j0 + u) * Rp + r0 + W * v, x);
        }
    }
}

#if defined(__AVX512BF16__)
#define HAVE_BF16 1
/* qk_tile for bf16 queries and keys: S->qt holds query pairs, S->kb the keys as they are */
static inline __attribute__((always_inline)) void qk_tile_bf16(scratch_t *S, int Rp, int D, int r0, int j0, int64_t kb,
                                                               int window, int masked, vf *bm, float scale) {
    __m512 a[UK][2];
    for (int u = 0; u < UK; u++) a[u][0] = a[u][1] = _mm512_setzero_ps();
    const uint32_t *qp = (const uint32_t *)S->qt + r0;
    const uint16_t *k = (const uint16_t *)S->kb + (size_t)j0 * D;
    for (int dp = 0; dp < D / 2; dp++) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(qp + (size_t)dp * Rp));
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(qp + (size_t)dp * Rp + W));
        for (int u = 0; u < UK; u++) {
            int32_t pair;
            memcpy(&pair, k + (size_t)u * D + 2 * dp, sizeof pair);
            const __m512bh kv = (__m512bh)_mm512_set1_epi32(pair);
            a[u][0] = _mm512_dpbf16_ps(a[u][0], x0, kv);
            a[u][1] = _mm512_dpbf16_ps(a[u][1], x1, kv);
        }
    }
    vi pos[2];
    memcpy(pos, S->pos + r0, sizeof pos);
    for (int u = 0; u < UK; u++) {
        for (int v = 0; v < 2; v++) {
            vf x = (vf)a[u][v] * scale;
            if (masked) x = mask_keys(x, pos[v], (int32_t)(kb + j0 + u), window);
            const vi gt = x > bm[v];
            bm[v] = (vf)(((vi)x & gt) | ((vi)bm[v] & ~gt));
            st(S->s + (size_t)(j0 + u) * Rp + r0 + W * v, x);
        }
    }
}

/* r[c] = column c of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15] */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + j], 128-bit lane k: rows g..g+3 of column 4k + j */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i w2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(v, v2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(w, w2, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v, v2, 0xDD);
        r[12 + j] = _mm512_shuffle_i32x4(w, w2, 0xDD);
    }
}

/* the item's bf16 queries as pairs, transposed: Qp[d / 2][r] (rows q0 + idx[r]), 16 rows x
 * 16 pairs at a time (D / 2 is a multiple of 8) */
static void pairs_transposed(const uint16_t *q0, const int32_t *idx, int Rp, int D, uint32_t *qp) {
    for (int r0 = 0; r0 < Rp; r0 += 16) {
        for (int c0 = 0; c0 < D / 2; c0 += 16) {
            const int nc = D / 2 - c0 < 16 ? D / 2 - c0 : 16;
            const __mmask16 m = nc == 16 ? 0xFFFF : 0x00FF;
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi32(m, q0 + idx[r0 + i] + 2 * c0);
            transpose16(r);
            for (int c = 0; c < nc; c++) _mm512_storeu_si512((void *)(qp + (size_t)(c0 + c) * Rp + r0), r[c]);
        }
    }
}
#else
#define HAVE_BF16 0
#endif

#define MRV 6 /* rows per output tile: 6 x 4 accumulators, 4 V vectors and a broadcast in 32 registers */

/* O[r0 .. r0 + U) columns [c0, c0 + C W) += sum_j P[j][r] V[j][c] over the block's nk keys */
static inline __attribute__((always_inline)) void pv_tile(scratch_t *S, int Rp, int D, int nk, int r0, int c0,
                                                          const int U, const int C) {
    vf a[MRV][4];
    for (int u = 0; u < U; u++)
        for (int c = 0; c < C; c++) a[u][c] = ld(S->o + (size_t)(r0 + u) * D + c0 + W * c);
    for (int j = 0; j < nk; j++) {
        const float *v = S->vrow[j] + c0, *p = S->s + (size_t)j * Rp + r0;
        vf x[4];
        for (int c = 0; c < C; c++) x[c] = ld(v + W * c);
        for (int u = 0; u < U; u++) {
            const vf pu = (vf)_mm512_set1_ps(p[u]);
            for (int c = 0; c < C; c++) a[u][c] += pu * x[c];
        }
    }
    for (int u = 0; u < U; u++)
        for (int c = 0; c < C; c++) st(S->o + (size_t)(r0 + u) * D + c0 + W * c, a[u][c]);
}

#if HAVE_BF16
/* the block's probabilities and V rows (bf16, in S->vb) as bf16 pairs of consecutive keys:
 * Pp[j / 2][r] = (P[j][r], P[j + 1][r]) rounded to nearest even, Vp[j / 2][c] = (V[j][c],
 * V[j + 1][c]); nkp is even, keys past the block's end have P = 0 and V rows of zeros */
static inline __attribute__((always_inline)) void pv_pairs(scratch_t *S, int Rp, const int D, int nkp) {
    __m512i ilv; /* 16-bit element 2k <- k, 2k + 1 <- 16 + k: the halves of a vector interleaved */
    {
        uint16_t ix[32];
        for (int k = 0; k < 16; k++) ix[2 * k] = (uint16_t)k, ix[2 * k + 1] = (uint16_t)(16 + k);
        ilv = _mm512_loadu_si512((const void *)ix);
    }
    for (int jp = 0; jp < nkp / 2; jp++) {
        const float *s0 = S->s + (size_t)(2 * jp) * Rp, *s1 = s0 + Rp;
        for (int r0 = 0; r0 < Rp; r0 += W) {
            const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s1 + r0), _mm512_loadu_ps(s0 + r0));
            _mm512_storeu_si512((void *)(S->pp + (size_t)jp * Rp + r0), _mm512_permutexvar_epi16(ilv, b));
        }
        const uint16_t *v0 = (const uint16_t *)S->vb + (size_t)(2 * jp) * D, *v1 = v0 + D;
        for (int c0 = 0; c0 < D; c0 += W) {
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + c0))),
                                                  _mm256_loadu_si256((const __m256i *)(v1 + c0)), 1);
            _mm512_storeu_si512((void *)(S->vp + (size_t)jp * D + c0), _mm512_permutexvar_epi16(ilv, ab));
        }
    }
}

/* pv_tile from the pairs: O[r0 .. r0 + U) columns [c0, c0 + C W) += sum over key pairs */
static inline __attribute__((always_inline)) void pv_tile_bf16(scratch_t *S, int Rp, int D, int nkp, int r0, int c0,
                                                               const int U, const int C) {
    __m512 a[MRV][4];
    for (int u = 0; u < U; u++)
        for (int c = 0; c < C; c++) a[u][c] = _mm512_loadu_ps(S->o + (size_t)(r0 + u) * D + c0 + W * c);
    for (int jp = 0; jp < nkp / 2; jp++) {
        const uint32_t *v = S->vp + (size_t)jp * D + c0, *p = S->pp + (size_t)jp * Rp + r0;
        __m512bh x[4];
        for (int c = 0; c < C; c++) x[c] = (__m512bh)_mm512_loadu_si512((const void *)(v + W * c));
        for (int u = 0; u < U; u++) {
            const __m512bh pu = (__m512bh)_mm512_set1_epi32((int)p[u]);
            for (int c = 0; c < C; c++) a[u][c] = _mm512_dpbf16_ps(a[u][c], x[c], pu);
        }
    }
    for (int u = 0; u < U; u++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(S->o + (size_t)(r0 + u) * D + c0 + W * c, a[u][c]);
}

#endif

/* the block's scores (nk a multiple of UK) and each row's block maximum (bf16 > 0: from
 * bf16 query pairs and keys, multiplied by `scale`) */
static inline __attribute__((always_inline)) void scores(scratch_t *S, int Rp, const int D, int nk, int64_t kb,
                                                         int window, int masked, const int bf16, float scale) {
    (void)scale;
    for (int r0 = 0; r0 < Rp; r0 += 2 * W) {
        vf bm[2] = {(vf){0} - INFINITY, (vf){0} - INFINITY};
#if HAVE_BF16
        if (bf16)
            for (int j = 0; j < nk; j += UK) qk_tile_bf16(S, Rp, D, r0, j, kb, window, masked, bm, scale);
        else
#endif
            for (int j = 0; j < nk; j += UK) qk_tile(S, Rp, D, r0, j, kb, window, masked, bm);
        st(S->bmax + r0, bm[0]);
        st(S->bmax + r0 + W, bm[1]);
    }
}

/* one output tile from float32 probabilities and V rows, or (bf16) from their bf16 pairs */
static inline __attribute__((always_inline)) void pv_any(scratch_t *S, int Rp, int D, int nk, int r0, int c0,
                                                         const int U, const int C, const int bf16) {
#if HAVE_BF16
    if (bf16) {
        pv_tile_bf16(S, Rp, D, nk, r0, c0, U, C);
        return;
    }
#endif
    (void)bf16;
    pv_tile(S, Rp, D, nk, r0, c0, U, C);
}

/* the rows' weighted values over the block's nk keys (bf16: nk even, the pairs made here) */
static inline __attribute__((always_inline)) void values(scratch_t *S, int R, int Rp, const int D, int nk,
                                                         const int bf16) {
#if HAVE_BF16
    if (bf16) pv_pairs(S, Rp, D, nk);
#endif
    for (int c0 = 0; c0 < D; c0 += 4 * W) {
        const int C = (D - c0) / W < 4 ? (D - c0) / W : 4;
        int r = 0;
        if (C == 4) {
            for (; r + MRV <= R; r += MRV) pv_any(S, Rp, D, nk, r, c0, MRV, 4, bf16);
            for (; r < R; r++) pv_any(S, Rp, D, nk, r, c0, 1, 4, bf16);
        } else {
            for (; r < R; r++) pv_any(S, Rp, D, nk, r, c0, 1, C, bf16);
        }
    }
}

/* fold the block's nk (masked) scores into the running maximum and sum, leave the
 * probabilities in S->s and each row's rescale in S->corr */
static void softmax_block(scratch_t *S, int Rp, int nk) {
    for (int r0 = 0; r0 < Rp; r0 += W) {
        const vf m = ld(S->m + r0), bm = ld(S->bmax + r0);
        const vi gt = bm > m;
        const vf mn = (vf)(((vi)bm & gt) | ((vi)m & ~gt));
        const vi none = mn == (vf){0} - INFINITY; /* nothing visible yet: keep exponents finite */
        const vf ms = (vf)((vi)mn & ~none);
        vf sum = (vf){0};
        for (int j = 0; j < nk; j++) {
            float *sj = S->s + (size_t)j * Rp + r0;
            const vf x = ld(sj);
            const vi seen = x > (vf){0} - INFINITY;
            const vf e = (vf)((vi)vexp(x - ms) & seen);
            st(sj, e);
            sum += e;
        }
        /* the rows' previous maximum less the new one: exp(0) = 1 exactly when the block
         * raised nothing; rows with nothing visible yet keep 1 (their sums are still 0) */
        const vf cc = (vf)(((vi)((vf){0} + 1.f) & none) | ((vi)vexp(m - ms) & ~none));
        st(S->corr + r0, cc);
        st(S->l + r0, ld(S->l + r0) * cc + sum);
        st(S->m + r0, mn);
    }
}

/* one block of keys [kb, kb + nk) (padded to nkp) for the item's rows: scores, softmax,
 * the rescale of the rows' output, the weighted values */
static inline __attribute__((always_inline)) void block_body(scratch_t *S, int R, int Rp, const int D, int nk, int nkp,
                                                             int64_t kb, int window, int masked, const int bf16,
                                                             float scale) {
    scores(S, Rp, D, nkp, kb, window, masked, bf16, scale);
    softmax_block(S, Rp, nkp);
    for (int r = 0; r < R; r++) {
        const float c = S->corr[r];
        if (c != 1.f)
            for (int d = 0; d < D; d += W) st(S->o + (size_t)r * D + d, ld(S->o + (size_t)r * D + d) * c);
    }
    values(S, R, Rp, D, bf16 ? nkp : nk, bf16); /* the pairs take the block's whole tiles */
}

/* the block for the common head sizes compiled with the size a constant (unrolled tiles),
 * for float32 queries and for bf16 ones */
typedef void (*block_fn)(scratch_t *, int, int, int, int, int, int64_t, int, int, float);
#define BLOCK(name, DD, BF)                                                                                       \
    static void name(scratch_t *S, int R, int Rp, int D, int nk, int nkp, int64_t kb, int window, int masked,      \
                     float scale) {                                                                               \
        (void)D;                                                                                                  \
        block_body(S, R, Rp, DD, nk, nkp, kb, window, masked, BF, scale);                                         \
    }
BLOCK(block_d64, 64, 0)
BLOCK(block_d128, 128, 0)
BLOCK(block_any, D, 0)
#if HAVE_BF16
BLOCK(block_d64_bf16, 64, 1)
BLOCK(block_d128_bf16, 128, 1)
BLOCK(block_any_bf16, D, 1)
#endif
#undef BLOCK

/* one work item (see the file's comment) with the thread's scratch S */
static void item(const pjob_t *J, scratch_t *S, const item_t *it) {
    const int g = J->Hq / J->Hkv, D = J->D, sh = __builtin_ctz((unsigned)J->block_size);
    const int64_t t0 = J->cu_q[it->p] + (int64_t)it->qb * BQ, n_all = J->cu_q[it->p + 1] - J->cu_q[it->p];
    const int nq = (int)(n_all - (int64_t)it->qb * BQ < BQ ? n_all - (int64_t)it->qb * BQ : BQ);
    const int R = nq * g, Rp = (R + 2 * W - 1) / (2 * W) * (2 * W);
    const int64_t first = J->ctx[it->p] + (int64_t)it->qb * BQ, last = first + nq - 1;
    for (int r = 0; r < Rp; r++) { /* padding rows repeat the last row: finite, never stored */
        const int i = r < R ? r / g : nq - 1, gi = r < R ? r % g : g - 1;
        S->idx[r] = (int32_t)(i * J->q_tok + (it->h * g + gi) * J->q_head);
        S->pos[r] = (int32_t)(first + i);
        S->m[r] = -INFINITY;
        S->l[r] = 0.f;
    }
    if (J->qbf16) {
#if HAVE_BF16
        pairs_transposed((const uint16_t *)J->q + t0 * J->q_tok, S->idx, Rp, D, (uint32_t *)S->qt);
#endif
    } else {
        const float *q0 = (const float *)J->q + t0 * J->q_tok;
        for (int r0 = 0; r0 < Rp; r0 += W) { /* transposed: one gather per (d, vector of rows) */
            const __m512i idx = _mm512_loadu_si512((const void *)(S->idx + r0));
            for (int d = 0; d < D; d++)
                st(S->qt + (size_t)d * Rp + r0, (vf)_mm512_i32gather_ps(idx, q0 + d, 4) * J->scale);
        }
    }
    memset(S->o, 0, sizeof(float) * (size_t)R * D);
    const int64_t lo = J->window > 0 && first - J->window + 1 > 0 ? first - J->window + 1 : 0, hi = last + 1;
    const int64_t *tab = J->tables + (size_t)it->p * J->nb_stride;
    const size_t row = (size_t)J->Hkv * D, h0 = (size_t)it->h * D;
    block_fn block = D == 64 ? block_d64 : D == 128 ? block_d128 : block_any;
#if HAVE_BF16
    if (J->qbf16) block = D == 64 ? block_d64_bf16 : D == 128 ? block_d128_bf16 : block_any_bf16;
#endif
    const int direct = J->kind == KV_F32 && J->block_size >= UK;
    S->kstride = direct ? row : (size_t)D;
    if (!direct)
        for (int j = 0; j < BK; j++) S->krow[j] = S->kb + (size_t)j * D, S->vrow[j] = S->vb + (size_t)j * D;
    for (int64_t kb = lo / BK * BK; kb < hi; kb += BK) {
        const int nk = (int)(hi - kb < BK ? hi - kb : BK), nkp = (nk + UK - 1) / UK * UK;
        if (direct) {
            /* a float32 cache, rows read in place: a score tile's UK keys (from a multiple of
             * UK) lie in one cache block, at row stride, those past the end included (stale
             * rows of an allocated block, masked) */
            for (int j = 0; j < nk; j++) {
                const int64_t t = kb + j;
                const size_t off = (size_t)((tab[t >> sh] << sh) + (t & (J->block_size - 1))) * row + h0;
                S->krow[j] = (const float *)J->kc + off;
                S->vrow[j] = (const float *)J->vc + off;
            }
        } else {
            for (int j = 0; j < nk; j++) {
                const int64_t t = kb + j;
                const size_t off = (size_t)((tab[t >> sh] << sh) + (t & (J->block_size - 1))) * row + h0;
                if (J->qbf16)
                    memcpy((uint16_t *)S->kb + (size_t)j * D, (const uint16_t *)J->kc + off, sizeof(uint16_t) * D);
                else
                    widen_row(J->kc, J->kind, off, D, S->kb + (size_t)j * D);
                if (J->qbf16)
                    memcpy((uint16_t *)S->vb + (size_t)j * D, (const uint16_t *)J->vc + off, sizeof(uint16_t) * D);
                else
                    widen_row(J->vc, J->kind, off, D, S->vb + (size_t)j * D);
            }
            /* keys past the block's end up to a whole tile: zeros, masked (past every row) */
            if (J->qbf16) {
                memset((uint16_t *)S->kb + (size_t)nk * D, 0, sizeof(uint16_t) * (size_t)(nkp - nk) * D);
                memset((uint16_t *)S->vb + (size_t)nk * D, 0, sizeof(uint16_t) * (size_t)(nkp - nk) * D);
            } else
                memset(S->kb + (size_t)nk * D, 0, sizeof(float) * (size_t)(nkp - nk) * D);
        }
        const int masked = kb + nkp - 1 > first || (J->window > 0 && kb <= last - J->window);
        block(S, R, Rp, D, nk, nkp, kb, J->window, masked, J->scale);
    }
    for (int r = 0; r < R; r++) {
        const int i = r / g, gi = r % g;
        float *dst = J->out + ((t0 + i) * J->Hq + it->h * g + gi) * (int64_t)D;
        const float inv = 1.f / S->l[r];
        for (int d = 0; d < D; d += W) st(dst + d, ld(S->o + (size_t)r * D + d) * inv);
    }
}

/* the items, longest first, over nthreads threads, each with scratch of its own */
static int run_items(const pjob_t *J, const item_t *items, int n, int nthreads) {
    const int g = J->Hq / J->Hkv, D = J->D;
    const size_t Rp = (size_t)(g * BQ + 2 * W - 1) / (2 * W) * (2 * W);
    int rc = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : rc)
    {
        scratch_t S;
        const size_t floats = (size_t)D * Rp + (size_t)BK * Rp + Rp * D + 4 * Rp + 2 * (size_t)BK * D +
                              (size_t)BK / 2 * (Rp + D);
        float *buf = (float *)aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        int32_t *pos = (int32_t *)malloc(sizeof(int32_t) * Rp * 2);
        if (!buf || !pos) {
            rc = -1;
        } else {
            S.qt = buf;
            S.s = S.qt + (size_t)D * Rp;
            S.o = S.s + (size_t)BK * Rp;
            S.m = S.o + Rp * D;
            S.l = S.m + Rp;
            S.bmax = S.l + Rp;
            S.corr = S.bmax + Rp;
            S.kb = S.corr + Rp;
            S.vb = S.kb + (size_t)BK * D;
            S.pp = (uint32_t *)(S.vb + (size_t)BK * D);
            S.vp = S.pp + (size_t)BK / 2 * Rp;
            S.pos = pos;
            S.idx = pos + Rp;
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < n; i++) item(J, &S, &items[i]);
        }
        free(buf);
        free(pos);
    }
    return rc;
}

/* floats per vector used for head size D (0: D not taken) */
int dl_prefill_attn_width(int D) { return D % W == 0 && D <= 256 ? W : 0; }

/* 1 where bf16 queries over a bf16 cache are taken (q_kind 2: built with AVX512_BF16) */
int dl_prefill_attn_bf16(void) { return HAVE_BF16; }

/* q: rows of the step's prefill tokens, float32 (q_kind 0) or bfloat16 (q_kind 2, over a
 * bfloat16 cache, where dl_prefill_attn_bf16()), element (t, head, d) at
 * q[t * q_tok + head * q_head + d]; out (T, Hq, D) float32; kc, vc: (slots, Hkv, D) of
 * kv_kind; tables (P, nb_stride) int64 block ids of each chunk's sequence; cu_q (P + 1)
 * chunk boundaries in the tokens; ctx (P) cached positions before each chunk; window > 0:
 * a token sees only its last `window` positions. Returns 0, -1 without memory, -2 for
 * shapes it does not take (the caller uses its torch path). */
int dl_prefill_attn(const void *q, int64_t q_tok, int64_t q_head, const void *kc, const void *vc, float *out,
                    const int64_t *tables, int nb_stride, const int64_t *cu_q, const int64_t *ctx, int P,
                    int block_size, int window, int Hq, int Hkv, int D, float scale, int kv_kind, int nthreads,
                    int q_kind) {
    if (dl_prefill_attn_width(D) == 0 || Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAXG || kv_kind < 0 ||
        kv_kind > 2 || block_size <= 0 || (block_size & (block_size - 1)) ||
        !(q_kind == KV_F32 || (q_kind == KV_BF16 && kv_kind == KV_BF16 && HAVE_BF16)))
        return -2;
    int n_items = 0;
    for (int p = 0; p < P; p++) n_items += (int)((cu_q[p + 1] - cu_q[p] + BQ - 1) / BQ) * Hkv;
    if (n_items == 0) return 0;
    item_t *items = (item_t *)malloc(sizeof(item_t) * (size_t)n_items);
    if (!items) return -1;
    int k = 0;
    for (int p = 0; p < P; p++) {
        const int64_t n = cu_q[p + 1] - cu_q[p];
        for (int qb = 0; qb * (int64_t)BQ < n; qb++) {
            const int64_t end = (qb + 1) * (int64_t)BQ < n ? (qb + 1) * (int64_t)BQ : n;
            const int64_t keys = window > 0 && ctx[p] + end > window ? window + BQ : ctx[p] + end;
            for (int h = 0; h < Hkv; h++) items[k++] = (item_t){p, h, qb, keys};
        }
    }
    qsort(items, (size_t)n_items, sizeof(item_t), by_work);
    const pjob_t J = {q, q_tok, q_head, kc, vc, out, tables, cu_q, ctx, nb_stride, block_size, window, Hq, Hkv, D,
                      kv_kind, q_kind == KV_BF16, scale};
    if (nthreads < 1) nthreads = 1;
    if (nthreads > n_items) nthreads = n_items;
    const int rc = run_items(&J, items, n_items, nthreads);
    free(items);
    return rc;
}

#else /* no AVX-512 or no OpenMP: not built here */

int dl_prefill_attn_width(int D) {
    (void)D;
    return 0;
}

int dl_prefill_attn_bf16(void) { return 0; }

int dl_prefill_attn(const void *q, int64_t q_tok, int64_t q_head, const void *kc, const void *vc, float *out,
                    const int64_t *tables, int nb_stride, const int64_t *cu_q, const int64_t *ctx, int P,
                    int block_size, int window, int Hq, int Hkv, int D, float scale, int kv_kind, int nthreads,
                    int q_kind) {
    (void)q, (void)q_tok, (void)q_head, (void)kc, (void)vc, (void)out, (void)tables, (void)nb_stride, (void)cu_q;
    (void)ctx, (void)P, (void)block_size, (void)window, (void)Hq, (void)Hkv, (void)D, (void)scale, (void)kv_kind;
    (void)nthreads, (void)q_kind;
    return -2;
}
#endif
