/* Pair sums of the Entropy semiring through layer_norm / batch_norm rows (see
   ../normalization.py for the algebra), called through ctypes (see __init__.py).

   For each row and output j, over every input i (the diagonal is corrected by the caller):

       S_j = sum_i a_i c_ij,   T_j = sum_i a_i c_ij r_i,   U_j = sum_i a_i c_ij log c_ij,
       c_ij = |1 + xh_i xh_j|.

   Why hand-written: U needs one logarithm per pair (n^2 per row, 1.2 G for a BERT-base layer).
   Vectorised over j, each pair is a handful of FMAs and a polynomial logarithm, about 4x the
   speed inductor reached for the same expression. The logarithm is the classic range reduction
   x = m 2^e, m in [sqrt(1/2), sqrt(2)), with a degree-9 polynomial for log(m) (the Cephes logf
   coefficients), accurate to about one ulp for normal floats; c_ij below FLT_MIN is clamped to
   it, where a_i c_ij log c_ij is below 1e-36 either way. */

#include <float.h>
#include <immintrin.h>
#include <stdint.h>

static inline __m256 log_ps(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_sub_epi32(e, _mm256_castps_si256(big)); /* big lanes are -1: e + 1 */
    const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
    __m256 p = _mm256_set1_ps(7.0376836292e-2f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.1514610310e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.1676998740e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.2420140846e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.4249322787e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.6668057665e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.0000714765e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-2.4999993993e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(3.3333331174e-1f));
    const __m256 f2 = _mm256_mul_ps(f, f);
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f2), f);
    const __m256 ef = _mm256_cvtepi32_ps(e);
    y = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(f2, _mm256_set1_ps(0.5f), y);
    y = _mm256_add_ps(f, y);
    return _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), y);
}

/* One row, outputs j in [j0, j0 + 16) (xj holds their x̂, zero-padded past n): two vectors of
   outputs share each broadcast of a_i, r_i and x̂_i. */
static void row_sums(const float *a, const float *r, const float *xh, int64_t n, const float *xj,
                     float *s_out, float *t_out, float *u_out) {
    const __m256 one = _mm256_set1_ps(1.0f), tiny = _mm256_set1_ps(FLT_MIN);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 x0 = _mm256_loadu_ps(xj), x1 = _mm256_loadu_ps(xj + 8);
    __m256 s0 = _mm256_setzero_ps(), t0 = s0, u0 = s0, s1 = s0, t1 = s0, u1 = s0;
    for (int64_t i = 0; i < n; i++) {
        const __m256 xi = _mm256_set1_ps(xh[i]), ai = _mm256_set1_ps(a[i]);
        const __m256 ri = _mm256_set1_ps(r[i]);
        const __m256 c0 = _mm256_andnot_ps(sign, _mm256_fmadd_ps(xi, x0, one));
        const __m256 c1 = _mm256_andnot_ps(sign, _mm256_fmadd_ps(xi, x1, one));
        const __m256 w0 = _mm256_mul_ps(ai, c0), w1 = _mm256_mul_ps(ai, c1);
        s0 = _mm256_add_ps(s0, w0);
        s1 = _mm256_add_ps(s1, w1);
        t0 = _mm256_fmadd_ps(w0, ri, t0);
        t1 = _mm256_fmadd_ps(w1, ri, t1);
        u0 = _mm256_fmadd_ps(w0, log_ps(_mm256_max_ps(c0, tiny)), u0);
        u1 = _mm256_fmadd_ps(w1, log_ps(_mm256_max_ps(c1, tiny)), u1);
    }
    _mm256_storeu_ps(s_out, s0);
    _mm256_storeu_ps(s_out + 8, s1);
    _mm256_storeu_ps(t_out, t0);
    _mm256_storeu_ps(t_out + 8, t1);
    _mm256_storeu_ps(u_out, u0);
    _mm256_storeu_ps(u_out + 8, u1);
}

void semipack_norm_entropy_sums_f32(const float *a, const float *r, const float *xh, int64_t rows,
                                    int64_t n, float *s, float *t, float *u, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < rows; row++) {
        const float *ar = a + row * n, *rr = r + row * n, *xr = xh + row * n;
        for (int64_t j = 0; j < n; j += 16) {
            float xj[16] = {0}, so[16], to[16], uo[16];
            const int64_t lanes = n - j < 16 ? n - j : 16;
            for (int64_t c = 0; c < lanes; c++) xj[c] = xr[j + c];
            row_sums(ar, rr, xr, n, xj, so, to, uo);
            for (int64_t c = 0; c < lanes; c++) {
                s[row * n + j + c] = so[c];
                t[row * n + j + c] = to[c];
                u[row * n + j + c] = uo[c];
            }
        }
    }
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
