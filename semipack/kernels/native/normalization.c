/* Pair sums of the Entropy semiring through layer_norm / batch_norm rows (see
   ../normalization.py for the algebra), called through ctypes (see __init__.py).

   For each row and output j, over every input i (the diagonal is corrected by the caller):

       S_j = sum_i a_i c_ij,   T_j = sum_i a_i c_ij r_i,   U_j = sum_i a_i c_ij log c_ij,
       c_ij = |1 + xh_i xh_j|.

   Why hand-written: U needs one logarithm per pair (n^2 per row, 1.2 G for a BERT-base layer).
   Vectorised over j, each pair is a handful of FMAs and a polynomial logarithm (log_ps of
   vector_math.h, about one ulp), several times the speed inductor reached for the same
   expression; c_ij below FLT_MIN is clamped to it, where a_i c_ij log c_ij is below 1e-36
   either way. */

#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* The sums take SUMS_LANES outputs j per vector: 8 (AVX2) or 16 (AVX-512), through the few
   operations below, written once. Output j's terms from i < j add in the same order in both
   builds; output i's own partial sums group over the lanes (four 8-lane or two 16-lane
   accumulators), so those sums round differently in the two builds (both are checked against
   float64 in the tests). */
#if defined(__AVX512F__)
#define SUMS_LANES 16
typedef __m512 vf;
typedef __mmask16 vfmask;
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_andnot(vf a, vf b) { return _mm512_andnot_ps(a, b); }
static inline vf vf_keep(vfmask m, vf a) { return _mm512_maskz_mov_ps(m, a); }
static inline vf vf_log(vf x) { return log_ps16(x); }
static inline float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vfmask vfm_from_bits(int bits) { return (vfmask)bits; }
#else
#define SUMS_LANES 8
typedef __m256 vf;
typedef __m256 vfmask;
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_andnot(vf a, vf b) { return _mm256_andnot_ps(a, b); }
static inline vf vf_keep(vfmask m, vf a) { return _mm256_and_ps(a, m); }
static inline vf vf_log(vf x) { return log_ps(x); }
static inline float vf_hsum(vf v) { return hsum(v); }
static inline vfmask vfm_from_bits(int bits) {
    const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_and_si256(lane_bits, _mm256_set1_epi32(bits)), lane_bits));
}
#endif
/* independent accumulators per sweep of 32 outputs: their chains overlap */
#define SUMS_BLOCKS (32 / SUMS_LANES)

struct pair_row { vf x, a, r; };   /* x̂_i, a_i, r_i broadcast */
struct pair_acc { vf s, t, u; };   /* output i's partial sums */

/* The pairs (i, j..j+SUMS_LANES-1): terms for outputs j (masked by keep_j) into s, t, u; terms
   for output i (masked by keep_i) into acc. */
static inline void pair_block(const struct pair_row *p, const float *a, const float *r,
                              const float *xh, float *s, float *t, float *u, int64_t j,
                              vfmask keep_j, vfmask keep_i, struct pair_acc *acc) {
    const vf one = vf_set1(1.0f), tiny = vf_set1(FLT_MIN), sign = vf_set1(-0.0f);
    const vf xj = vf_load(xh + j), aj = vf_load(a + j), rj = vf_load(r + j);
    const vf c = vf_andnot(sign, vf_fmadd(p->x, xj, one));
    const vf lc = vf_log(vf_max(c, tiny));
    const vf to_j = vf_keep(keep_j, vf_mul(p->a, c));
    const vf to_i = vf_keep(keep_i, vf_mul(aj, c));
    vf_store(s + j, vf_add(vf_load(s + j), to_j));
    vf_store(t + j, vf_fmadd(to_j, p->r, vf_load(t + j)));
    vf_store(u + j, vf_fmadd(to_j, lc, vf_load(u + j)));
    acc->s = vf_add(acc->s, to_i);
    acc->t = vf_fmadd(to_i, rj, acc->t);
    acc->u = vf_fmadd(to_i, lc, acc->u);
}

/* The accumulators of output i added pairwise, then across the lanes. */
static inline float acc_total(const struct pair_acc *acc, int which) {
    vf v[SUMS_BLOCKS];
    for (int b = 0; b < SUMS_BLOCKS; b++) v[b] = which == 0 ? acc[b].s : which == 1 ? acc[b].t : acc[b].u;
#if SUMS_BLOCKS == 4
    return vf_hsum(vf_add(vf_add(v[0], v[1]), vf_add(v[2], v[3])));
#else
    return vf_hsum(vf_add(v[0], v[1]));
#endif
}

static void row_sums_symmetric(const float *a, const float *r, const float *xh, int64_t padded,
                               int64_t n, float *s, float *t, float *u) {
    const vf zero = vf_set1(0.0f);
    const int full = (1 << SUMS_LANES) - 1;
    const vfmask all = vfm_from_bits(full);
    for (int64_t j = 0; j < padded; j++) s[j] = t[j] = u[j] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const struct pair_row p = {vf_set1(xh[i]), vf_set1(a[i]), vf_set1(r[i])};
        struct pair_acc acc[SUMS_BLOCKS];
        for (int b = 0; b < SUMS_BLOCKS; b++) acc[b] = (struct pair_acc){zero, zero, zero};
        const int64_t first = i & ~(int64_t)(SUMS_LANES - 1);
        /* the block holding i: lanes before i take no part; lane i counts once, as output j */
        const int at = (int)(i - first);
        pair_block(&p, a, r, xh, s, t, u, first, vfm_from_bits(full & (full << at)),
                   vfm_from_bits(full & (full << (at + 1))), &acc[0]);
        int64_t j = first + SUMS_LANES;
        for (; j + 32 <= padded; j += 32)
            for (int b = 0; b < SUMS_BLOCKS; b++)
                pair_block(&p, a, r, xh, s, t, u, j + b * SUMS_LANES, all, all, &acc[b]);
        for (; j < padded; j += SUMS_LANES)
            pair_block(&p, a, r, xh, s, t, u, j, all, all, &acc[1]);
        s[i] += acc_total(acc, 0);
        t[i] += acc_total(acc, 1);
        u[i] += acc_total(acc, 2);
    }
}

/* Returns 0, or -1 when a thread could not allocate its work buffers. */
int semipack_norm_entropy_sums_f32(const float *a, const float *r, const float *xh, int64_t rows,
                                    int64_t n, float *s, float *t, float *u, int threads) {
    const int64_t padded = (n + SUMS_LANES - 1) / SUMS_LANES * SUMS_LANES;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* per thread: padded copies of a, r, x̂ and the row's three outputs */
        float *work = (float *)malloc(6 * (size_t)padded * sizeof(float));
        if (work == NULL) {
            failed = 1;
        } else {
            float *ap = work, *rp = ap + padded, *xp = rp + padded;
            float *sp = xp + padded, *tp = sp + padded, *up = tp + padded;
            for (int64_t c = n; c < padded; c++) ap[c] = rp[c] = xp[c] = 0.0f;
#pragma omp for schedule(static)
            for (int64_t row = 0; row < rows; row++) {
                memcpy(ap, a + row * n, n * sizeof(float));
                memcpy(rp, r + row * n, n * sizeof(float));
                memcpy(xp, xh + row * n, n * sizeof(float));
                row_sums_symmetric(ap, rp, xp, padded, n, sp, tp, up);
                memcpy(s + row * n, sp, n * sizeof(float));
                memcpy(t + row * n, tp, n * sizeof(float));
                memcpy(u + row * n, up, n * sizeof(float));
            }
            free(work);
        }
    }
    return failed ? -1 : 0;
}

/* LogSum and MaxProd through the same rows: per output j, over every input i,

       P_j = sum_i a_i c_ij   (reduce_max = 0)   or   max_i a_i c_ij   (reduce_max = 1),

   with c_ij = |1 + xh_i xh_j|. Four vectors of outputs (32 j) share each broadcast of a_i and
   xh_i, so a pair costs one FMA, one AND and one FMA (or MUL and MAX): about three times the
   pair rate of the inductor kernel for the same expression. */
static void row_reduce(const float *a, const float *xh, int64_t n, const float *xj, float *out,
                       int reduce_max) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], acc[4];
    for (int v = 0; v < 4; v++) {
        x[v] = _mm256_loadu_ps(xj + 8 * v);
        acc[v] = _mm256_setzero_ps();
    }
    if (reduce_max) {
        for (int64_t i = 0; i < n; i++) {
            const __m256 xi = _mm256_set1_ps(xh[i]), ai = _mm256_set1_ps(a[i]);
            for (int v = 0; v < 4; v++) {
                const __m256 c = _mm256_andnot_ps(sign, _mm256_fmadd_ps(xi, x[v], one));
                acc[v] = _mm256_max_ps(acc[v], _mm256_mul_ps(ai, c));
            }
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            const __m256 xi = _mm256_set1_ps(xh[i]), ai = _mm256_set1_ps(a[i]);
            for (int v = 0; v < 4; v++) {
                const __m256 c = _mm256_andnot_ps(sign, _mm256_fmadd_ps(xi, x[v], one));
                acc[v] = _mm256_fmadd_ps(ai, c, acc[v]);
            }
        }
    }
    for (int v = 0; v < 4; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

void semipack_norm_abs_reduce_f32(const float *a, const float *xh, int64_t rows, int64_t n,
                                  float *out, int reduce_max, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < rows; row++) {
        const float *ar = a + row * n, *xr = xh + row * n;
        for (int64_t j = 0; j < n; j += 32) {
            float xj[32] = {0}, o[32];
            const int64_t lanes = n - j < 32 ? n - j : 32;
            for (int64_t c = 0; c < lanes; c++) xj[c] = xr[j + c];
            row_reduce(ar, xr, n, xj, o, reduce_max);
            for (int64_t c = 0; c < lanes; c++) out[row * n + j + c] = o[c];
        }
    }
}
