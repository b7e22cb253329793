/* GELU's and SiLU's exact log|derivative| in one native pass (see ../log_derivatives.py for
   the algebra: SignChangingDerivative, _gelu_direct, _mills_ratio, _silu_direct), float32,
   called through ctypes.

   Why hand-written: the same expression compiled by inductor cost a compilation on a process's
   first GELU or SiLU (inductor's start-up: most of a sentence's first MaxProd backward through
   MiniLM, 5.2 s with the compiled kernel against 0.45 s with this loop, bench_first_call.py)
   and a compiled call's guards on every call. Here the error function comes from torch (its vectorised erf,
   passed in as aux = erf(x / sqrt 2)), the rest is one loop.

   Per entry, with the caller's constants (the root r = hi + lo of the derivative's bracket, the
   polynomial q of the bracket near it, for GELU the Chebyshev series of the Mills ratio):

     GELU: log p = log phi = -x^2 / 2 - log sqrt(2 pi)
           x >= -2:  value = (1 + erf(x / sqrt 2)) / 2 + x e^{log p},   prefix = 0
           x < -2:   value = R(t) - t (t = -x, R by the series),        prefix = log p
     SiLU: log p = log sigma(x) = min(x, 0) - log(1 + e^{-|x|})
           value = 1 + x sigma(-x), sigma(-x) = 1 / (1 + e^x),          prefix = log p
     both: |delta| < window, delta = (x - hi) - lo:  value = delta q(delta), prefix = log p
           log = prefix + log|value|,  sign = sign(value) (0 for NaN, as torch.sign)

   the operations of the torch form in the same order (a multiply and an add may be one fused
   multiply-add here), exp and log within one ulp (vector_math.h): the logs agree with the
   torch form's within 4e-7 times max(1, |log|), a few ulps of the derivative itself (tests),
   and NaN and infinities come out where they do there. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

#define BLOCK 4096         /* entries per scheduled block */
#define MAX_COEFFICIENTS 32 /* of either series */

/* Which derivative (the `kind` argument). */
#define KIND_GELU 0
#define KIND_SILU 1

typedef struct {
    __m256 near[MAX_COEFFICIENTS], mills[MAX_COEFFICIENTS];
    int64_t near_n, mills_n;
    __m256 hi, lo, window;
} constants;

/* The direct form's value and prefix and log p, by kind (see the table above). */
static inline void gelu_direct(__m256 x, __m256 erf_half, const constants *k,
                               __m256 *out_value, __m256 *out_prefix, __m256 *out_log_p) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    /* log phi = (-0.5 x) x - log sqrt(2 pi), as torch's -0.5 * x * x - c */
    const __m256 log_phi = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(-0.5f), x), x),
                                         _mm256_set1_ps(0.91893853320467274f));
    /* direct: 0.5 (1 + erf) + x e^{log phi} */
    const __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_add_ps(one, erf_half)),
                                   _mm256_mul_ps(x, exp_readout_ps(log_phi)));
    /* the tail, for vectors with a lane below -2 (GELU's inputs mostly are not): t = max(-x,
       2), R(t) by Clenshaw's recurrence in y = 8 / t^2 - 1 */
    const __m256 tail = _mm256_cmp_ps(x, _mm256_set1_ps(-2.0f), _CMP_LT_OQ);
    __m256 value = d;
    if (_mm256_movemask_ps(tail)) {
        const __m256 t = _mm256_max_ps(_mm256_sub_ps(zero, x), _mm256_set1_ps(2.0f));
        const __m256 v = _mm256_div_ps(one, _mm256_mul_ps(t, t));
        const __m256 y = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(8.0f), v), one);
        const __m256 two_y = _mm256_mul_ps(_mm256_set1_ps(2.0f), y);
        __m256 later = zero, last = zero;
        for (int64_t i = k->mills_n - 1; i >= 1; i--) {
            const __m256 next = _mm256_add_ps(_mm256_sub_ps(_mm256_mul_ps(two_y, later), last),
                                              k->mills[i]);
            last = later;
            later = next;
        }
        const __m256 mills = _mm256_div_ps(
            _mm256_sub_ps(_mm256_add_ps(k->mills[0], _mm256_mul_ps(y, later)), last), t);
        value = _mm256_blendv_ps(d, _mm256_sub_ps(mills, t), tail);
    }
    *out_value = value;
    *out_prefix = _mm256_and_ps(tail, log_phi);
    *out_log_p = log_phi;
}

static inline void silu_direct(__m256 x, __m256 *value, __m256 *prefix, __m256 *log_p) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* min(x, 0) - log(1 + e^{-|x|}) and 1 + x sigma(-x), in the torch form's operations */
    const __m256 neg_abs = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(x, abs_mask));
    const __m256 soft = log_readout_ps(_mm256_add_ps(one, exp_readout_ps(neg_abs)));
    *log_p = _mm256_sub_ps(_mm256_min_ps(x, _mm256_setzero_ps()), soft);
    *prefix = *log_p;
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp_readout_ps(x)));
    *value = _mm256_add_ps(one, _mm256_mul_ps(x, sig));
}

/* The lanes' log|d| (and sign, into *sign) from the direct form, the bracket's polynomial
   taking over near its root. */
static inline __m256 finish(__m256 x, __m256 value, __m256 prefix, __m256 log_p,
                            const constants *k, __m256 *sign) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* near the root (vectors with a lane there): delta q(delta) */
    const __m256 delta = _mm256_sub_ps(_mm256_sub_ps(x, k->hi), k->lo);
    const __m256 near = _mm256_cmp_ps(_mm256_and_ps(delta, abs_mask), k->window, _CMP_LT_OQ);
    if (_mm256_movemask_ps(near)) {
        __m256 b = k->near[k->near_n - 1];
        for (int64_t i = k->near_n - 2; i >= 0; i--) b = _mm256_fmadd_ps(b, delta, k->near[i]);
        value = _mm256_blendv_ps(value, _mm256_mul_ps(b, delta), near);
        prefix = _mm256_blendv_ps(prefix, log_p, near);
    }
    /* sign(value): +1, -1, or 0 (zero and NaN) */
    *sign = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(value, zero, _CMP_GT_OQ), one),
                          _mm256_and_ps(_mm256_cmp_ps(value, zero, _CMP_LT_OQ), one));
    return _mm256_add_ps(prefix, log_readout_ps(_mm256_and_ps(value, abs_mask)));
}

static inline __m256 lanes(int kind, __m256 x, __m256 aux, const constants *k, __m256 *sign) {
    __m256 value, prefix, log_p;
    if (kind == KIND_GELU)
        gelu_direct(x, aux, k, &value, &prefix, &log_p);
    else
        silu_direct(x, &value, &prefix, &log_p);
    return finish(x, value, prefix, log_p, k, sign);
}

/* log[i] (and sign[i] unless sign is NULL) of the derivative of `kind` at x[i], i < n. GELU
   reads aux[i] = erf(x[i] / sqrt 2) (aux may be log: each entry is read before it is written);
   SiLU reads no aux (NULL). near: the bracket's polynomial near its root, constant first;
   mills: the Mills ratio's Chebyshev coefficients (GELU's; at most MAX_COEFFICIENTS each). */
void semipack_sign_changing_log_derivative_f32(int kind, const float *x, const float *aux,
                                               float *log, float *sign, int64_t n,
                                               const float *near, int64_t near_n,
                                               const float *mills, int64_t mills_n,
                                               float root_hi, float root_lo, float window,
                                               int threads) {
    constants k;
    k.near_n = near_n < MAX_COEFFICIENTS ? near_n : MAX_COEFFICIENTS;
    k.mills_n = mills_n < MAX_COEFFICIENTS ? mills_n : MAX_COEFFICIENTS;
    for (int64_t i = 0; i < k.near_n; i++) k.near[i] = _mm256_set1_ps(near[i]);
    for (int64_t i = 0; i < k.mills_n; i++) k.mills[i] = _mm256_set1_ps(mills[i]);
    k.hi = _mm256_set1_ps(root_hi);
    k.lo = _mm256_set1_ps(root_lo);
    k.window = _mm256_set1_ps(window);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        int64_t i = b * BLOCK;
        __m256 s;
        for (; i + 8 <= end; i += 8) {
            const __m256 a = aux ? _mm256_loadu_ps(aux + i) : _mm256_setzero_ps();
            const __m256 out = lanes(kind, _mm256_loadu_ps(x + i), a, &k, &s);
            _mm256_storeu_ps(log + i, out);
            if (sign) _mm256_storeu_ps(sign + i, s);
        }
        if (i < end) {
            const __m256i m = tail_mask(end - i);
            const __m256 a = aux ? _mm256_maskload_ps(aux + i, m) : _mm256_setzero_ps();
            const __m256 out = lanes(kind, _mm256_maskload_ps(x + i, m), a, &k, &s);
            _mm256_maskstore_ps(log + i, m, out);
            if (sign) _mm256_maskstore_ps(sign + i, m, s);
        }
    }
}
