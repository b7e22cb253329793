/* Entropy's and LogSum's elementwise steps over float32 tensors, called through ctypes (see
   __init__.py; the Python side is kernels/log_space_native.py).

   Why hand-written: each of these steps was a compiled kernel (kernels/compiled.py), and the
   first compiled call of a process pays inductor's start-up (1.4-1.5 s on this project's Zen 3
   VM) and then about 0.1-0.4 s per kernel: most of a first Entropy backward (3.7 s on the
   MiniLM sentence against 0.5 s for the next one) and of a first LogSum backward of a CNN.
   These loops build with the other native kernels, once per source version, and pay no
   guards per call.

   Each loop computes the compiled form's expression in its order, with the vectorised exp and
   log of vector_math.h (exp_readout_ps and log_readout_ps: within one ulp, subnormals kept,
   every special value as torch's), no fused multiply-add (the library builds with -std=c11,
   whose default is -ffp-contract=off), and selects where the compiled form selects; so
   results are within an ulp or two of the compiled and the eager forms', and the arithmetic
   ones (the mean, the readout) are their bits. NaN and infinities land where the compiled
   form puts them. All take n entries of one dense block each; the tail of fewer than 8
   entries goes through masked loads and stores. The same bits whatever the thread count. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

#define BLOCK 4096 /* entries per scheduled block */

/* The loop shared by every kernel below: STEP(i, mask) handles the 8 entries from i, with
   `mask` all ones for a whole vector and the tail's lanes for the last, partial one. */
#define SEMIPACK_FOR_VECTORS(n, threads, STEP)                                                   \
    do {                                                                                         \
        const int64_t blocks_ = ((n) + BLOCK - 1) / BLOCK;                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")       \
        for (int64_t b_ = 0; b_ < blocks_; b_++) {                                               \
            const int64_t end_ = (b_ + 1) * BLOCK < (n) ? (b_ + 1) * BLOCK : (n);                \
            const __m256i all_ = _mm256_set1_epi32(-1);                                          \
            int64_t i_ = b_ * BLOCK;                                                             \
            for (; i_ + 8 <= end_; i_ += 8) STEP(i_, all_)                                       \
            if (i_ < end_) STEP(i_, tail_mask(end_ - i_))                                        \
        }                                                                                        \
    } while (0)

#define LOAD(p, i, m) _mm256_maskload_ps((p) + (i), (m))
#define STORE(p, i, m, v) _mm256_maskstore_ps((p) + (i), (m), (v))

static inline __m256 abs_ps(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

/* mag log mag where mag > 0; +0.0 at 0 and NaN (xlogx's 0 log 0 = 0; NaN > 0 is false). */
static inline __m256 xlogx_ps(__m256 mag) {
    const __m256 positive = _mm256_cmp_ps(mag, _mm256_setzero_ps(), _CMP_GT_OQ);
    return _mm256_and_ps(positive, _mm256_mul_ps(mag, log_readout_ps(mag)));
}

/* log(e^a + e^b) as logspace.fused_log_add_exp: big + log(1 + e^(small - big)), big + log 2
   where the two are equal (infinities included), NaN where either is NaN. */
static inline __m256 log_add_exp_ps(__m256 a, __m256 b) {
    const __m256 big = _mm256_max_ps(a, b), small = _mm256_min_ps(a, b);
    const __m256 e = exp_readout_ps(_mm256_sub_ps(small, big));
    __m256 out = _mm256_add_ps(big, log_readout_ps(_mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    const __m256 equal = _mm256_cmp_ps(small, big, _CMP_EQ_OQ);
    out = _mm256_blendv_ps(out, _mm256_add_ps(big, _mm256_set1_ps(0.693147182f)), equal);
    return _mm256_blendv_ps(out, _mm256_set1_ps(NAN), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

/* x where finite, else 0 (torch.nan_to_num(x, 0, 0, 0)). */
static inline __m256 finite_or_zero_ps(__m256 x) {
    return _mm256_and_ps(_mm256_cmp_ps(abs_ps(x), _mm256_set1_ps(INFINITY), _CMP_LT_OQ), x);
}

/* mag = |w|, out = xlogx(|w|), negated where `negate` (torch.neg: -0.0 at 0): Entropy's edge
   magnitudes and |w| log|w| (logspace.abs_and_xlogx, stacked_magnitudes). With mag NULL,
   out = xlogx(w) of magnitudes as they are (logspace.xlogx: a negative entry, which no
   magnitude is, gives 0 as the fused form's mag > 0 test does). */
void semipack_abs_xlogx_f32(const float *w, float *mag, float *out, int64_t n, int negate,
                            int threads) {
    const __m256 flip = _mm256_set1_ps(negate ? -0.0f : 0.0f);
#define STEP(i, m)                                                                               \
    {                                                                                            \
        const __m256 a = mag ? abs_ps(LOAD(w, i, m)) : LOAD(w, i, m);                            \
        if (mag) STORE(mag, i, m, a);                                                            \
        STORE(out, i, m, _mm256_xor_ps(xlogx_ps(a), flip));                                      \
    }
    SEMIPACK_FOR_VECTORS(n, threads, STEP);
#undef STEP
}

/* weighted = (weighted - less) / total where total > 0, else 0: Entropy's mean surprisal
   (entropy._mean_fused); less_step 0 reads one `less` for all entries. */
void semipack_entropy_mean_f32(const float *total, float *weighted, const float *less,
                               int64_t less_step, int64_t n, int threads) {
#define STEP(i, m)                                                                               \
    {                                                                                            \
        const __m256 t = LOAD(total, i, m);                                                      \
        const __m256 l = less_step ? LOAD(less, i, m) : _mm256_set1_ps(less[0]);                 \
        const __m256 v = _mm256_div_ps(_mm256_sub_ps(LOAD(weighted, i, m), l), t);               \
        const __m256 some = _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GT_OQ);                   \
        STORE(weighted, i, m, _mm256_and_ps(some, v));                                           \
    }
    SEMIPACK_FOR_VECTORS(n, threads, STEP);
#undef STEP
}

/* out = log_z + mean where log_z is finite, else NaN (no path): Entropy's readout. */
void semipack_entropy_readout_f32(const float *log_z, const float *mean, float *out, int64_t n,
                                  int threads) {
#define STEP(i, m)                                                                               \
    {                                                                                            \
        const __m256 z = LOAD(log_z, i, m);                                                      \
        const __m256 finite = _mm256_cmp_ps(abs_ps(z), _mm256_set1_ps(INFINITY), _CMP_LT_OQ);   \
        const __m256 v = _mm256_add_ps(z, LOAD(mean, i, m));                                     \
        STORE(out, i, m, _mm256_blendv_ps(_mm256_set1_ps(NAN), v, finite));                      \
    }
    SEMIPACK_FOR_VECTORS(n, threads, STEP);
#undef STEP
}

/* out = log(e^a + e^b) (LogSum's plus, logspace.log_add_exp). */
void semipack_log_add_exp_f32(const float *a, const float *b, float *out, int64_t n,
                              int threads) {
#define STEP(i, m) STORE(out, i, m, log_add_exp_ps(LOAD(a, i, m), LOAD(b, i, m)));
    SEMIPACK_FOR_VECTORS(n, threads, STEP);
#undef STEP
}

/* Entropy's plus (entropy._plus_fused): log_z = log(e^la + e^lb), and with s = log_z where
   finite (else 0) the mean surprisal r = e^(la - s) ra + e^(lb - s) rb. */
void semipack_entropy_plus_f32(const float *la, const float *ra, const float *lb,
                               const float *rb, float *log_z, float *r, int64_t n, int threads) {
#define STEP(i, m)                                                                               \
    {                                                                                            \
        const __m256 a = LOAD(la, i, m), b = LOAD(lb, i, m);                                     \
        const __m256 z = log_add_exp_ps(a, b);                                                   \
        const __m256 s = finite_or_zero_ps(z);                                                   \
        const __m256 wa = _mm256_mul_ps(exp_readout_ps(_mm256_sub_ps(a, s)), LOAD(ra, i, m));    \
        const __m256 wb = _mm256_mul_ps(exp_readout_ps(_mm256_sub_ps(b, s)), LOAD(rb, i, m));    \
        STORE(log_z, i, m, z);                                                                   \
        STORE(r, i, m, _mm256_add_ps(wa, wb));                                                   \
    }
    SEMIPACK_FOR_VECTORS(n, threads, STEP);
#undef STEP
}

/* The smallest non-zero |x| over n entries: +inf where there is none, NaN where an entry is
   NaN (shared_shift._nonzero_magnitude_min: torch's amin propagates NaN). A minimum does not
   round: the bits of torch's. One thread: a reduction over an activation, a fraction of a
   product's cost. */
float semipack_nonzero_abs_min_f32(const float *x, int64_t n) {
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 low = inf, nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 a = abs_ps(_mm256_loadu_ps(x + i));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        const __m256 zero = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ);
        low = _mm256_min_ps(low, _mm256_blendv_ps(a, inf, zero));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    float lanes[8], best = INFINITY;
    _mm256_storeu_ps(lanes, low);
    for (int k = 0; k < 8; k++)
        if (lanes[k] < best) best = lanes[k];
    for (; i < n; i++) {
        const float a = fabsf(x[i]);
        if (a != a) return NAN;
        if (a != 0.0f && a < best) best = a;
    }
    return best;
}

/* Per-lane sums in double: two accumulators of 4 for the 8 float lanes. */
typedef struct {
    __m256d lo, hi;
} dsum;

static inline void dsum_add(dsum *s, __m256 v) {
    s->lo = _mm256_add_pd(s->lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    s->hi = _mm256_add_pd(s->hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double dsum_total(dsum s) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s.lo, s.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* LogSum's and Entropy's per-channel (gain, bias) messages of an affine map y = g_c x̂ + b_c
   (kernels/affine_params.py log_sum and entropy, whose _Shifted steps this follows): for m, x
   (and Entropy's mean surprisal r, NULL for LogSum) of layout [outer, channels, inner],
   contiguous, and each channel c, with x̂ = (x - mean[c]) * invstd[c] (a subtraction, then a
   product), M = the channel's largest m (0 where not finite) and A = its largest |x̂| (1 where
   0 or not finite):
     gain_log = log Σ e^(m - M) |x̂| / A + (M + log A),   bias_log = log Σ e^(m - M) + M,
   and for Entropy the masses' mean surprisals Σ e |x̂|/A (r - log|x̂|) / Σ e |x̂|/A (terms with
   x̂ = 0 left out) and Σ e r / Σ e (0 where the mass is 0). recompute[c] = 1 for the channels
   the generic ops must redo, as _Shifted.recompute says: a NaN or +inf message, a non-finite
   x̂, or a gain sum whose log under its shift lies below `floor` while the bias has a path.
   Sums run in double per lane (then rounded to float32 once), exponentials and logarithms
   within an ulp (exp_readout_ps, log_readout_ps); a flagged channel's values are whatever the
   loop gives, the caller replaces them. Why native: the compiled reduction was the only
   compiled call left in a first LogSum or Entropy backward of a CNN with batch norms (2-3 s of
   inductor start-up at its first call). */
void semipack_affine_log_sums_f32(const float *m, const float *r, const float *x,
                                  const float *mean, const float *invstd, int64_t outer,
                                  int64_t channels, int64_t inner, float floor, float *gain_log,
                                  float *bias_log, float *gain_mean, float *bias_mean,
                                  uint8_t *recompute, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < channels; c++) {
        const __m256 mu = _mm256_set1_ps(mean[c]), inv = _mm256_set1_ps(invstd[c]);
        const __m256 inf = _mm256_set1_ps(INFINITY);
        __m256 top = _mm256_set1_ps(-INFINITY), widest = _mm256_setzero_ps();
        __m256 usual = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        /* pass 1: the largest message and the widest |x̂|; NaN or +inf anywhere flags */
        for (int64_t a = 0; a < outer; a++) {
            const float *mr = m + (a * channels + c) * inner, *xr = x + (a * channels + c) * inner;
            for (int64_t k = 0; k < inner; k += 8) {
                const __m256i lanes = k + 8 <= inner ? _mm256_set1_epi32(-1) : tail_mask(inner - k);
                const __m256 live = _mm256_castsi256_ps(lanes);
                const __m256 mv = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                   _mm256_maskload_ps(mr + k, lanes), live);
                const __m256 mag = _mm256_and_ps(
                    live, abs_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(xr + k, lanes), mu),
                                               inv)));
                usual = _mm256_and_ps(usual, _mm256_cmp_ps(mv, inf, _CMP_LT_OQ));
                usual = _mm256_and_ps(usual, _mm256_cmp_ps(mag, inf, _CMP_LT_OQ));
                top = _mm256_max_ps(top, mv);
                widest = _mm256_max_ps(widest, mag);
            }
        }
        float tops[8], widths[8], shift = -INFINITY, scale = 0.0f;
        _mm256_storeu_ps(tops, top);
        _mm256_storeu_ps(widths, widest);
        for (int i = 0; i < 8; i++) {
            if (tops[i] > shift) shift = tops[i];
            if (widths[i] > scale) scale = widths[i];
        }
        const int unusual = _mm256_movemask_ps(usual) != 0xff;
        if (!(fabsf(shift) < INFINITY)) shift = 0.0f;
        if (!(scale > 0.0f && scale < INFINITY)) scale = 1.0f;
        /* pass 2: the shifted sums */
        const __m256 s = _mm256_set1_ps(shift), w = _mm256_set1_ps(scale);
        const __m256 zero = _mm256_setzero_ps();
        dsum gain = {_mm256_setzero_pd(), _mm256_setzero_pd()}, bias = gain, gain_r = gain,
             bias_r = gain;
        for (int64_t a = 0; a < outer && !unusual; a++) {
            const size_t row = (size_t)((a * channels + c) * inner);
            for (int64_t k = 0; k < inner; k += 8) {
                const __m256i lanes = k + 8 <= inner ? _mm256_set1_epi32(-1) : tail_mask(inner - k);
                const __m256 live = _mm256_castsi256_ps(lanes);
                const __m256 e = _mm256_and_ps(
                    live, exp_readout_ps(_mm256_sub_ps(_mm256_maskload_ps(m + row + k, lanes), s)));
                /* the lanes past the row's end hold 0: no entry, no term (|0 - mean| invstd
                   may overflow, and 0 * inf would be NaN) */
                const __m256 mag = _mm256_and_ps(
                    live, abs_ps(_mm256_mul_ps(
                              _mm256_sub_ps(_mm256_maskload_ps(x + row + k, lanes), mu), inv)));
                const __m256 weighted = _mm256_mul_ps(e, _mm256_div_ps(mag, w));
                dsum_add(&gain, weighted);
                dsum_add(&bias, e);
                if (r) {
                    const __m256 rv = _mm256_maskload_ps(r + row + k, lanes);
                    const __m256 edge = _mm256_and_ps(live, _mm256_cmp_ps(mag, zero, _CMP_GT_OQ));
                    const __m256 less = _mm256_sub_ps(rv, log_readout_ps(mag));
                    dsum_add(&gain_r, _mm256_and_ps(edge, _mm256_mul_ps(weighted, less)));
                    dsum_add(&bias_r, _mm256_and_ps(live, _mm256_mul_ps(e, rv)));
                }
            }
        }
        const float gain_mass = (float)dsum_total(gain), bias_mass = (float)dsum_total(bias);
        const float gain_shift = shift + logf(scale);
        gain_log[c] = logf(gain_mass) + gain_shift;
        bias_log[c] = logf(bias_mass) + shift;
        if (r) {
            gain_mean[c] = gain_mass == 0.0f ? 0.0f : (float)dsum_total(gain_r) / gain_mass;
            bias_mean[c] = bias_mass == 0.0f ? 0.0f : (float)dsum_total(bias_r) / bias_mass;
        }
        const int low = gain_log[c] - gain_shift < floor && bias_log[c] > -INFINITY;
        recompute[c] = (uint8_t)(unusual || low);
    }
}

/* --- the readouts of a normalisation's row sums (kernels/normalization.py), rows x n entries
   row-major, one shift per row. Each is the torch expression it replaces, op by op, with the
   log of log_readout_ps and n a float32 number; a row's off-diagonal formula puts
   off_j = (1 + x̂_j²) / n at i = j, the true diagonal is |1 - off_j|. */

/* off_j of entries x̂ (n as a vector), rounded as torch's (1 + x * x) / n. */
static inline __m256 diagonal_off_ps(__m256 x, __m256 n) {
    return _mm256_div_ps(_mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(x, x)), n);
}

/* kind 0 (MaxProd, _max_prod_from_best): out = log(max(total / n, a |1 - off|)) + shift;
   kind 1 (LogSum, _log_sum_from_total): out = log(max(total / n - a off + a |1 - off|, 0))
   + shift. NaN propagates as torch.maximum and clamp_min propagate it. */
void semipack_norm_readout_f32(int kind, const float *a, const float *shift, const float *x_hat,
                               const float *total, float *out, int64_t rows, int64_t n,
                               int threads) {
    const __m256 nn = _mm256_set1_ps((float)n), one = _mm256_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) {
        const __m256 s = _mm256_set1_ps(shift[row]);
        const int64_t base = row * n;
        for (int64_t k = 0; k < n; k += 8) {
            const __m256i m = k + 8 <= n ? _mm256_set1_epi32(-1) : tail_mask(n - k);
            const __m256 x = LOAD(x_hat + base, k, m), av = LOAD(a + base, k, m);
            const __m256 off = diagonal_off_ps(x, nn);
            const __m256 right = _mm256_mul_ps(av, abs_ps(_mm256_sub_ps(one, off)));
            const __m256 scaled = _mm256_div_ps(LOAD(total + base, k, m), nn);
            __m256 v;
            if (kind == 0) {
                const __m256 nan = _mm256_cmp_ps(scaled, right, _CMP_UNORD_Q);
                v = _mm256_blendv_ps(_mm256_max_ps(scaled, right), _mm256_set1_ps(NAN), nan);
            } else {
                v = _mm256_add_ps(_mm256_sub_ps(scaled, _mm256_mul_ps(av, off)), right);
                const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
                v = _mm256_blendv_ps(_mm256_max_ps(v, _mm256_setzero_ps()), v, nan);
            }
            STORE(out + base, k, m, _mm256_add_ps(log_readout_ps(v), s));
        }
    }
}

/* Entropy's rows (_entropy_rows): shift = the row's largest log_z where finite, else 0 (a
   NaN anywhere in the row gives 0, as amax's NaN does); a = exp(log_z - shift); r = surprisal
   where a > 0, else 0. */
void semipack_entropy_rows_f32(const float *log_z, const float *surprisal, float *a,
                               float *shift, float *r, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t base = row * n;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        for (int64_t k = 0; k < n; k += 8) {
            const __m256i m = k + 8 <= n ? _mm256_set1_epi32(-1) : tail_mask(n - k);
            const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), LOAD(log_z + base, k, m),
                                              _mm256_castsi256_ps(m));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, v);
        }
        float lanes[8], best = -INFINITY;
        _mm256_storeu_ps(lanes, top);
        for (int i = 0; i < 8; i++)
            if (lanes[i] > best) best = lanes[i];
        const float sh = (_mm256_movemask_ps(nan) || !(fabsf(best) < INFINITY)) ? 0.0f : best;
        shift[row] = sh;
        const __m256 s = _mm256_set1_ps(sh);
        for (int64_t k = 0; k < n; k += 8) {
            const __m256i m = k + 8 <= n ? _mm256_set1_epi32(-1) : tail_mask(n - k);
            const __m256 e = exp_readout_ps(_mm256_sub_ps(LOAD(log_z + base, k, m), s));
            const __m256 mass = _mm256_cmp_ps(e, _mm256_setzero_ps(), _CMP_GT_OQ);
            STORE(a + base, k, m, e);
            STORE(r + base, k, m, _mm256_and_ps(mass, LOAD(surprisal + base, k, m)));
        }
    }
}

/* Entropy's readout of the native row sums (_entropy_readout_of_sums_eager, then
   _entropy_from_sums), op by op:
     s = s_c / n - wrong + right,  t = t_c / n + (right - wrong) r,
     u = (u_c - log_n s_c) / n - wrong log(off) + right log|1 - off|  (a log term 0 where its
     magnitude is 0), s = max(s, 0), log_z = log s + shift, mean = (t - u) / s where s > 0,
   else 0; wrong = a off, right = a |1 - off|. */
void semipack_entropy_readout_of_sums_f32(const float *a, const float *r, const float *shift,
                                          const float *x_hat, const float *s_c, const float *t_c,
                                          const float *u_c, float log_n, float *log_z,
                                          float *mean, int64_t rows, int64_t n, int threads) {
    const __m256 nn = _mm256_set1_ps((float)n), one = _mm256_set1_ps(1.0f);
    const __m256 ln = _mm256_set1_ps(log_n), zero = _mm256_setzero_ps();
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) {
        const __m256 sh = _mm256_set1_ps(shift[row]);
        const int64_t base = row * n;
        for (int64_t k = 0; k < n; k += 8) {
            const __m256i m = k + 8 <= n ? _mm256_set1_epi32(-1) : tail_mask(n - k);
            const __m256 x = LOAD(x_hat + base, k, m), av = LOAD(a + base, k, m);
            const __m256 sc = LOAD(s_c + base, k, m);
            const __m256 off = diagonal_off_ps(x, nn);
            const __m256 right_mag = abs_ps(_mm256_sub_ps(one, off));
            const __m256 wrong = _mm256_mul_ps(av, off), right = _mm256_mul_ps(av, right_mag);
            __m256 u = _mm256_div_ps(_mm256_sub_ps(LOAD(u_c + base, k, m), _mm256_mul_ps(ln, sc)),
                                     nn);
            __m256 s = _mm256_add_ps(_mm256_sub_ps(_mm256_div_ps(sc, nn), wrong), right);
            const __m256 t = _mm256_add_ps(
                _mm256_div_ps(LOAD(t_c + base, k, m), nn),
                _mm256_mul_ps(_mm256_sub_ps(right, wrong), LOAD(r + base, k, m)));
            const __m256 log_off = _mm256_and_ps(_mm256_cmp_ps(off, zero, _CMP_GT_OQ),
                                                 log_readout_ps(off));
            const __m256 log_right = _mm256_and_ps(_mm256_cmp_ps(right_mag, zero, _CMP_GT_OQ),
                                                   log_readout_ps(right_mag));
            u = _mm256_sub_ps(u, _mm256_mul_ps(wrong, log_off));
            u = _mm256_add_ps(u, _mm256_mul_ps(right, log_right));
            const __m256 s_nan = _mm256_cmp_ps(s, s, _CMP_UNORD_Q);
            s = _mm256_blendv_ps(_mm256_max_ps(s, zero), s, s_nan);
            const __m256 some = _mm256_cmp_ps(s, zero, _CMP_GT_OQ);
            const __m256 safe = _mm256_blendv_ps(one, s, some);
            const __m256 mv = _mm256_and_ps(some, _mm256_div_ps(_mm256_sub_ps(t, u), safe));
            STORE(log_z + base, k, m, _mm256_add_ps(log_readout_ps(s), sh));
            STORE(mean + base, k, m, mv);
        }
    }
}
