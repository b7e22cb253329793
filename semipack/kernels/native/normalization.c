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

struct pair_row { __m256 x, a, r; };   /* x̂_i, a_i, r_i broadcast */
struct pair_acc { __m256 s, t, u; };   /* output i's partial sums */

/* The pairs (i, j..j+7): terms for outputs j (masked by keep_j) into s, t, u; terms for output
   i (masked by keep_i) into acc. */
static inline void pair_block(const struct pair_row *p, const float *a, const float *r,
                              const float *xh, float *s, float *t, float *u, int64_t j,
                              __m256 keep_j, __m256 keep_i, struct pair_acc *acc) {
    const __m256 one = _mm256_set1_ps(1.0f), tiny = _mm256_set1_ps(FLT_MIN);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 xj = _mm256_loadu_ps(xh + j), aj = _mm256_loadu_ps(a + j);
    const __m256 rj = _mm256_loadu_ps(r + j);
    const __m256 c = _mm256_andnot_ps(sign, _mm256_fmadd_ps(p->x, xj, one));
    const __m256 lc = log_ps(_mm256_max_ps(c, tiny));
    const __m256 to_j = _mm256_and_ps(_mm256_mul_ps(p->a, c), keep_j);
    const __m256 to_i = _mm256_and_ps(_mm256_mul_ps(aj, c), keep_i);
    _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(s + j), to_j));
    _mm256_storeu_ps(t + j, _mm256_fmadd_ps(to_j, p->r, _mm256_loadu_ps(t + j)));
    _mm256_storeu_ps(u + j, _mm256_fmadd_ps(to_j, lc, _mm256_loadu_ps(u + j)));
    acc->s = _mm256_add_ps(acc->s, to_i);
    acc->t = _mm256_fmadd_ps(to_i, rj, acc->t);
    acc->u = _mm256_fmadd_ps(to_i, lc, acc->u);
}

static void row_sums_symmetric(const float *a, const float *r, const float *xh, int64_t padded,
                               int64_t n, float *s, float *t, float *u) {
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j++) s[j] = t[j] = u[j] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const struct pair_row p = {_mm256_set1_ps(xh[i]), _mm256_set1_ps(a[i]),
                                   _mm256_set1_ps(r[i])};
        struct pair_acc acc0 = {zero, zero, zero}, acc1 = acc0, acc2 = acc0, acc3 = acc0;
        const int64_t first = i & ~(int64_t)7;
        /* the block holding i: lanes before i take no part; lane i counts once, as output j */
        const __m256 index = _mm256_add_ps(lane, _mm256_set1_ps((float)(first - i)));
        pair_block(&p, a, r, xh, s, t, u, first, _mm256_cmp_ps(index, zero, _CMP_GE_OQ),
                   _mm256_cmp_ps(index, zero, _CMP_GT_OQ), &acc0);
        const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        int64_t j = first + 8;
        for (; j + 32 <= padded; j += 32) { /* four independent blocks: their chains overlap */
            pair_block(&p, a, r, xh, s, t, u, j, all, all, &acc0);
            pair_block(&p, a, r, xh, s, t, u, j + 8, all, all, &acc1);
            pair_block(&p, a, r, xh, s, t, u, j + 16, all, all, &acc2);
            pair_block(&p, a, r, xh, s, t, u, j + 24, all, all, &acc3);
        }
        for (; j < padded; j += 8) pair_block(&p, a, r, xh, s, t, u, j, all, all, &acc1);
        s[i] += hsum(_mm256_add_ps(_mm256_add_ps(acc0.s, acc1.s), _mm256_add_ps(acc2.s, acc3.s)));
        t[i] += hsum(_mm256_add_ps(_mm256_add_ps(acc0.t, acc1.t), _mm256_add_ps(acc2.t, acc3.t)));
        u[i] += hsum(_mm256_add_ps(_mm256_add_ps(acc0.u, acc1.u), _mm256_add_ps(acc2.u, acc3.u)));
    }
}

#if defined(__AVX512F__)
/* row_sums_symmetric on 16 lanes (the AVX-512 build): the same pairs and terms; output j's
   terms from i < j add in the same order, output i's own partial sums group into other
   lanes, so those sums round differently (tests compare both builds with float64). */
#define SUMS_LANES 16
struct pair_row16 { __m512 x, a, r; };
struct pair_acc16 { __m512 s, t, u; };

static inline void pair_block16(const struct pair_row16 *p, const float *a, const float *r,
                                const float *xh, float *s, float *t, float *u, int64_t j,
                                __mmask16 keep_j, __mmask16 keep_i, struct pair_acc16 *acc) {
    const __m512 one = _mm512_set1_ps(1.0f), tiny = _mm512_set1_ps(FLT_MIN);
    const __m512 xj = _mm512_loadu_ps(xh + j), aj = _mm512_loadu_ps(a + j);
    const __m512 rj = _mm512_loadu_ps(r + j);
    const __m512 c = _mm512_abs_ps(_mm512_fmadd_ps(p->x, xj, one));
    const __m512 lc = log_ps16(_mm512_max_ps(c, tiny));
    const __m512 to_j = _mm512_maskz_mul_ps(keep_j, p->a, c);
    const __m512 to_i = _mm512_maskz_mul_ps(keep_i, aj, c);
    _mm512_storeu_ps(s + j, _mm512_add_ps(_mm512_loadu_ps(s + j), to_j));
    _mm512_storeu_ps(t + j, _mm512_fmadd_ps(to_j, p->r, _mm512_loadu_ps(t + j)));
    _mm512_storeu_ps(u + j, _mm512_fmadd_ps(to_j, lc, _mm512_loadu_ps(u + j)));
    acc->s = _mm512_add_ps(acc->s, to_i);
    acc->t = _mm512_fmadd_ps(to_i, rj, acc->t);
    acc->u = _mm512_fmadd_ps(to_i, lc, acc->u);
}

static void row_sums_symmetric16(const float *a, const float *r, const float *xh, int64_t padded,
                                 int64_t n, float *s, float *t, float *u) {
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j++) s[j] = t[j] = u[j] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const struct pair_row16 p = {_mm512_set1_ps(xh[i]), _mm512_set1_ps(a[i]),
                                     _mm512_set1_ps(r[i])};
        struct pair_acc16 acc0 = {zero, zero, zero}, acc1 = acc0;
        const int64_t first = i & ~(int64_t)15;
        /* the block holding i: lanes before i take no part; lane i counts once, as output j */
        const int at = (int)(i - first);
        const __mmask16 from_i = (__mmask16)(0xFFFFu << at), after_i = (__mmask16)(0xFFFEu << at);
        pair_block16(&p, a, r, xh, s, t, u, first, from_i, after_i, &acc0);
        int64_t j = first + 16;
        for (; j + 32 <= padded; j += 32) { /* two independent blocks: their chains overlap */
            pair_block16(&p, a, r, xh, s, t, u, j, 0xFFFF, 0xFFFF, &acc0);
            pair_block16(&p, a, r, xh, s, t, u, j + 16, 0xFFFF, 0xFFFF, &acc1);
        }
        for (; j < padded; j += 16) pair_block16(&p, a, r, xh, s, t, u, j, 0xFFFF, 0xFFFF, &acc1);
        s[i] += _mm512_reduce_add_ps(_mm512_add_ps(acc0.s, acc1.s));
        t[i] += _mm512_reduce_add_ps(_mm512_add_ps(acc0.t, acc1.t));
        u[i] += _mm512_reduce_add_ps(_mm512_add_ps(acc0.u, acc1.u));
    }
}
#define ROW_SUMS row_sums_symmetric16
#else
#define SUMS_LANES 8
#define ROW_SUMS row_sums_symmetric
#endif

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
                ROW_SUMS(ap, rp, xp, padded, n, sp, tp, up);
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
