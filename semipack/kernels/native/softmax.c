/* LogSum messages through softmax rows, called through ctypes (see __init__.py).

   For a row with probabilities p and incoming log-messages m, softmax's Jacobian is
   J_ij = p_i (delta_ij - p_j), so the message to input j is

       out_j = log( e^{m_j} p_j (1 - p_j) + p_j sum_{i != j} e^{m_i} p_i )
             = logaddexp( m_j + log p_j + log1p(-p_j),  X_j + log p_j ),
       X_j   = log sum_{i != j} e^{u_i},  u_i = m_i + log p_i,

   with the diagonal term taken as m_j + log(p_j (1 - p_j)).

   X is the exclusive log-sum-exp of ../rowwise.py, taken the same cancellation-free way: with
   k the argmax of u, `first` = u_k and `second` the largest other u, e_i = exp(u_i - second)
   (e_k = 0) and S = sum e_i, X_k = second + log S, and for j != k,
   X_j = first + log1p(r (S - e_j)) with r = exp(second - first). Per entry that is five
   vectorised logarithms and exponentials (see vector_math.h). The caller guarantees no NaN in m or p (rows may be all -inf). */

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

/* One row; m, p, lp, u, e, out are work buffers of `padded` floats. */
static void softmax_log_sum_row(const float *m_in, const float *p_in, int64_t n, int64_t padded,
                                float *m, float *p, float *lp, float *u, float *e, float *out) {
    const float neg_inf = -__builtin_inff();
    memcpy(m, m_in, n * sizeof(float));
    memcpy(p, p_in, n * sizeof(float));
    for (int64_t i = n; i < padded; i++) {
        m[i] = neg_inf; /* padding: no path, probability 0 */
        p[i] = 0.0f;
    }
    for (int64_t i = 0; i < padded; i += 8) {
        const __m256 l = log0_ps(_mm256_loadu_ps(p + i));
        _mm256_storeu_ps(lp + i, l);
        _mm256_storeu_ps(u + i, _mm256_add_ps(_mm256_loadu_ps(m + i), l));
    }
    const float first = row_max(u, padded);
    int64_t top = 0;
    while (top < n - 1 && !(u[top] == first)) top++; /* the first argmax (or 0: all -inf) */
    u[top] = neg_inf;
    const float second = row_max(u, padded);
    u[top] = first;
    const float shift = isfinite(second) ? second : 0.0f;
    const __m256 vshift = _mm256_set1_ps(shift);
    __m256 total = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
        const __m256 ei = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(u + i), vshift));
        _mm256_storeu_ps(e + i, ei);
    }
    e[top] = 0.0f;
    for (int64_t i = 0; i < padded; i += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(e + i));
    const float s = hsum(total);
    const float ratio = isfinite(second) ? expf(second - (isfinite(first) ? first : 0.0f)) : 0.0f;
    const __m256 vfirst = _mm256_set1_ps(first), vs = _mm256_set1_ps(s);
    const __m256 vratio = _mm256_set1_ps(ratio), zero = _mm256_setzero_ps();
    const __m256 one = _mm256_set1_ps(1.0f), vinf = _mm256_set1_ps(neg_inf);
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256 pj = _mm256_loadu_ps(p + j), lpj = _mm256_loadu_ps(lp + j);
        const __m256 rest = _mm256_max_ps(_mm256_sub_ps(vs, _mm256_loadu_ps(e + j)), zero);
        const __m256 x = _mm256_add_ps(vfirst, log1p_ps(_mm256_mul_ps(vratio, rest)));
        /* p (1 - p) is exact to an ulp: 1 - p is exact for p >= 1/2 (Sterbenz) */
        const __m256 jac = _mm256_mul_ps(pj, _mm256_sub_ps(one, pj));
        const __m256 diag = _mm256_add_ps(_mm256_loadu_ps(m + j), log0_ps(jac));
        const __m256 off = _mm256_add_ps(x, lpj);
        const __m256 hi = _mm256_max_ps(diag, off), lo = _mm256_min_ps(diag, off);
        const __m256 none = _mm256_cmp_ps(hi, vinf, _CMP_EQ_OQ); /* both terms -inf */
        const __m256 sum = _mm256_add_ps(hi, log1p_ps(exp_ps(_mm256_sub_ps(lo, hi))));
        _mm256_storeu_ps(out + j, _mm256_blendv_ps(sum, vinf, none));
    }
    if (top < n) { /* X_top leaves out the top entry itself */
        const float x_top = shift + logf(s);
        const float jac = p[top] * (1.0f - p[top]);
        const float diag = m[top] + (jac > 0.0f ? logf(jac) : neg_inf);
        const float off = x_top + lp[top];
        const float hi = diag > off ? diag : off, lo = diag > off ? off : diag;
        out[top] = hi == neg_inf ? neg_inf : hi + log1pf(expf(lo - hi));
    }
}

/* Returns 0, or -1 when a thread could not allocate its work buffers. */
int semipack_softmax_log_sum_f32(const float *m, const float *p, int64_t rows, int64_t n,
                                 float *out, int threads) {
    const int64_t padded = (n + 7) & ~(int64_t)7;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = (float *)malloc(6 * (size_t)padded * sizeof(float));
        if (work == NULL) {
            failed = 1;
        } else {
            float *mp = work, *pp = mp + padded, *lp = pp + padded, *u = lp + padded;
            float *e = u + padded, *o = e + padded;
#pragma omp for schedule(static)
            for (int64_t row = 0; row < rows; row++) {
                softmax_log_sum_row(m + row * n, p + row * n, n, padded, mp, pp, lp, u, e, o);
                memcpy(out + row * n, o, n * sizeof(float));
            }
            free(work);
        }
    }
    return failed ? -1 : 0;
}
