/* LogSum messages through softmax rows, called through ctypes (see __init__.py).

   For a row with log-probabilities lp (p = exp(lp), exact where a probability underflows) and
   incoming log-messages m, softmax's Jacobian is J_ij = p_i (delta_ij - p_j), so the message to
   input j is

       out_j = log( e^{m_j} p_j (1 - p_j) + p_j sum_{i != j} e^{m_i} p_i )
             = logaddexp( m_j + lp_j + R_j,  X_j + lp_j ),
       R_j   = log sum_{i != j} p_i          (= log(1 - p_j), never computed as 1 - p_j),
       X_j   = log sum_{i != j} e^{u_i},  u_i = m_i + lp_i.

   R and X are exclusive log-sum-exps, taken the cancellation-free way of ../rowwise.py
   (exclusive_logsumexp): with k the argmax of a row a, `first` = a_k and `second` the largest
   other entry, e_i = exp(a_i - second) (e_k = 0) and S = sum e_i, the exclusive sum at k is
   second + log S and, for j != k, first + log1p(r (S - e_j)) with r = exp(second - first).
   Per entry that is six vectorised exponentials and logarithms (see vector_math.h). The caller
   guarantees no NaN in m or lp (rows may be all -inf). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

static inline float hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static float row_max(const float *u, int64_t padded) {
    __m256 best = _mm256_set1_ps(-__builtin_inff());
    for (int64_t i = 0; i < padded; i += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(u + i));
    return hmax(best);
}

/* out_j = log sum_{i != j} exp(a_i) for a row a of n entries padded with -inf to `padded`;
   e is a work buffer of `padded` floats. a is restored before returning. */
static void exclusive_log_sum_exp(float *a, int64_t n, int64_t padded, float *e, float *out) {
    const float neg_inf = -__builtin_inff();
    const float first = row_max(a, padded);
    int64_t top = 0;
    while (top < n - 1 && !(a[top] == first)) top++; /* the first argmax (or 0: all -inf) */
    a[top] = neg_inf;
    const float second = row_max(a, padded);
    a[top] = first;
    const float shift = isfinite(second) ? second : 0.0f;
    const __m256 vshift = _mm256_set1_ps(shift);
    for (int64_t i = 0; i < padded; i += 8) {
        _mm256_storeu_ps(e + i, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(a + i), vshift)));
    }
    e[top] = 0.0f;
    __m256 total = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(e + i));
    const float s = hsum(total);
    const float ratio = isfinite(second) ? expf(second - (isfinite(first) ? first : 0.0f)) : 0.0f;
    const __m256 vfirst = _mm256_set1_ps(first), vs = _mm256_set1_ps(s);
    const __m256 vratio = _mm256_set1_ps(ratio), zero = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256 rest = _mm256_max_ps(_mm256_sub_ps(vs, _mm256_loadu_ps(e + j)), zero);
        const __m256 x = _mm256_add_ps(vfirst, log1p_ps(_mm256_mul_ps(vratio, rest)));
        _mm256_storeu_ps(out + j, x);
    }
    if (top < n) out[top] = shift + logf(s); /* the sum simply leaves out the top entry */
}

/* One row; m, lp, u, e, r, x, out are work buffers of `padded` floats. */
static void softmax_log_sum_row(const float *m_in, const float *lp_in, int64_t n, int64_t padded,
                                float *m, float *lp, float *u, float *e, float *r, float *x,
                                float *out) {
    const float neg_inf = -__builtin_inff();
    memcpy(m, m_in, n * sizeof(float));
    memcpy(lp, lp_in, n * sizeof(float));
    for (int64_t i = n; i < padded; i++) {
        m[i] = neg_inf; /* padding: no path, probability 0 */
        lp[i] = neg_inf;
    }
    exclusive_log_sum_exp(lp, n, padded, e, r); /* r_j = log(1 - p_j) */
    for (int64_t i = 0; i < padded; i += 8) {
        const __m256 ui = _mm256_add_ps(_mm256_loadu_ps(m + i), _mm256_loadu_ps(lp + i));
        _mm256_storeu_ps(u + i, ui);
    }
    exclusive_log_sum_exp(u, n, padded, e, x);
    const __m256 vinf = _mm256_set1_ps(neg_inf);
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256 lpj = _mm256_loadu_ps(lp + j);
        const __m256 diag = _mm256_add_ps(_mm256_loadu_ps(u + j), _mm256_loadu_ps(r + j));
        const __m256 off = _mm256_add_ps(_mm256_loadu_ps(x + j), lpj);
        const __m256 hi = _mm256_max_ps(diag, off), lo = _mm256_min_ps(diag, off);
        const __m256 none = _mm256_cmp_ps(hi, vinf, _CMP_EQ_OQ); /* both terms -inf */
        const __m256 sum = _mm256_add_ps(hi, log1p_ps(exp_ps(_mm256_sub_ps(lo, hi))));
        _mm256_storeu_ps(out + j, _mm256_blendv_ps(sum, vinf, none));
    }
}

/* Returns 0, or -1 when a thread could not allocate its work buffers. */
int semipack_softmax_log_sum_f32(const float *m, const float *lp, int64_t rows, int64_t n,
                                 float *out, int threads) {
    const int64_t padded = (n + 7) & ~(int64_t)7;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = (float *)malloc(7 * (size_t)padded * sizeof(float));
        if (work == NULL) {
            failed = 1;
        } else {
            float *mp = work, *lpp = mp + padded, *u = lpp + padded, *e = u + padded;
            float *r = e + padded, *x = r + padded, *o = x + padded;
#pragma omp for schedule(static)
            for (int64_t row = 0; row < rows; row++) {
                softmax_log_sum_row(m + row * n, lp + row * n, n, padded, mp, lpp, u, e, r, x, o);
                memcpy(out + row * n, o, n * sizeof(float));
            }
            free(work);
        }
    }
    return failed ? -1 : 0;
}
