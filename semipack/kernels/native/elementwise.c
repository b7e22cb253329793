/* Exponentials and logarithms of whole log-space tensors (readouts, shifted sums), float32,
   called through ctypes (see __init__.py).

   Why hand-written: a semiring backward on a short input ends with one pass over every weight
   matrix (MaxProd's exp of its log-space weight messages, LogSum's log of its products), and
   the vectorised exp and log that ATen and inductor use cost about 1 ns per entry on a Zen 3
   core, and each compiled call pays its guards; these loops take about half that on tensors
   that fit in the cache (beyond it all are bound by memory) and no guards. Unlike exp_ps in
   vector_math.h (which flushes results below 2^-126 to 0, harmless inside a sum), every value
   here is what a readout needs:

   exp: within one ulp (the final 1 + s rounds once, r's own rounding is carried by the
        TwoSum, and the polynomial adds a fraction of an ulp), results in the subnormal range
        kept (the scale 2^n is applied as 2^(n - n/2) * 2^(n/2), so the only rounding into the
        subnormal grid is the last product's), 0 only where exp(x) rounds to 0, +inf where it
        overflows, exp(-inf) = 0, exp(+inf) = +inf, NaN kept.
   log: of magnitudes (x >= 0 or NaN), within one ulp: log 0 = log -0 = -inf (no path),
        subnormal x rescaled by 2^23 first (finite logs), log(+inf) = +inf, NaN kept, x < 0
        gives NaN as torch's log does.

   The loops are split over `threads` OpenMP threads in blocks of whole vectors; the tail of
   fewer than 8 entries goes through masked loads and stores, so nothing is read or written
   outside the given ranges. The same bits whatever the number of threads. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

#define BLOCK 4096 /* entries per scheduled block: a few microseconds of work */

/* out[i] = exp(x[i] - shift) for i < n (out may be x); the subtraction is one float operation,
   as torch's x - shift, and shift 0 leaves x as it is. */
void semipack_exp_f32(const float *x, float *out, int64_t n, float shift, int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    const __m256 s = _mm256_set1_ps(shift);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        int64_t i = b * BLOCK;
        for (; i + 8 <= end; i += 8)
            _mm256_storeu_ps(out + i, exp_readout_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
        if (i < end) {
            const __m256i m = tail_mask(end - i);
            const __m256 v = _mm256_sub_ps(_mm256_maskload_ps(x + i, m), s);
            _mm256_maskstore_ps(out + i, m, exp_readout_ps(v));
        }
    }
}

/* mag[r, c] = log(mag[r, c]) + shift[r * shift_row + c * shift_col] over rows x cols entries
   (mag contiguous; shift_col is 0 or 1, both strides 0 for one shift), or the log alone when
   shift is NULL. Work is split into blocks of about BLOCK entries: whole short rows, or
   stretches of a long row (a flat range is one row). */
void semipack_log_plus_f32(float *mag, const float *shift, int64_t rows, int64_t cols,
                           int64_t shift_row, int64_t shift_col, int threads) {
    if (rows <= 0 || cols <= 0) return;
    const int64_t col_chunks = cols > BLOCK ? (cols + BLOCK - 1) / BLOCK : 1;
    const int64_t chunk = ((cols + col_chunks - 1) / col_chunks + 7) / 8 * 8;
    const int64_t rows_per = cols >= BLOCK ? 1 : BLOCK / cols;
    const int64_t blocks = (rows + rows_per - 1) / rows_per * col_chunks;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b / col_chunks * rows_per;
        const int64_t last = first + rows_per < rows ? first + rows_per : rows;
        const int64_t from = b % col_chunks * chunk;
        const int64_t to = from + chunk < cols ? from + chunk : cols;
        for (int64_t r = first; r < last; r++) {
            float *row = mag + r * cols;
            const float *srow = shift ? shift + r * shift_row : 0;
            int64_t c = from;
            for (; c + 8 <= to; c += 8) {
                __m256 y = log_readout_ps(_mm256_loadu_ps(row + c));
                if (srow)
                    y = _mm256_add_ps(y, shift_col ? _mm256_loadu_ps(srow + c)
                                                   : _mm256_set1_ps(srow[0]));
                _mm256_storeu_ps(row + c, y);
            }
            if (c < to) {
                const __m256i m = tail_mask(to - c);
                __m256 y = log_readout_ps(_mm256_maskload_ps(row + c, m));
                if (srow)
                    y = _mm256_add_ps(y, shift_col ? _mm256_maskload_ps(srow + c, m)
                                                   : _mm256_set1_ps(srow[0]));
                _mm256_maskstore_ps(row + c, m, y);
            }
        }
    }
}

/* 1 where no entry of x[0, n) is NaN or +inf, else 0: what every max-plus kernel asks of its
   operands (their max does not propagate NaN). x < +inf is false for exactly those entries, as
   torch's amax(x) < inf is. Why here: that reduction, a 0-d result and its read back cost
   about 30 us per operand through torch, on every product of a small model's pass. */
int semipack_below_inf_f32(const float *x, int64_t n) {
    const __m256 inf = _mm256_set1_ps(INFINITY);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(x + i), inf, _CMP_LT_OQ);
        const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), inf, _CMP_LT_OQ);
        const __m256 c = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), inf, _CMP_LT_OQ);
        const __m256 d = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), inf, _CMP_LT_OQ);
        if (_mm256_movemask_ps(_mm256_and_ps(_mm256_and_ps(a, b), _mm256_and_ps(c, d))) != 0xff)
            return 0;
    }
    for (; i < n; i++)
        if (!(x[i] < INFINITY)) return 0;
    return 1;
}

/* One channel of max_affine_f32, entry by entry with libm's logf: NaN wherever torch's amax
   gives NaN (a NaN message or x̂, or +inf + log 0 = NaN), log of an infinite |x̂| = +inf. */
static void max_affine_channel_scalar(const float *m, const float *x, float mean, float invstd,
                                      int64_t outer, int64_t channels, int64_t inner,
                                      int64_t c, float *gain, float *bias) {
    float g = -INFINITY, b = -INFINITY;
    int g_nan = 0, b_nan = 0;
    for (int64_t a = 0; a < outer; a++) {
        const int64_t base = (a * channels + c) * inner;
        for (int64_t k = 0; k < inner; k++) {
            const float v = m[base + k] + logf(fabsf((x[base + k] - mean) * invstd));
            if (v != v) g_nan = 1;
            else if (v > g) g = v;
            if (m[base + k] != m[base + k]) b_nan = 1;
            else if (m[base + k] > b) b = m[base + k];
        }
    }
    gain[c] = g_nan ? NAN : g;
    bias[c] = b_nan ? NAN : b;
}

/* MaxProd's gain and bias messages of a per-channel affine map (kernels/affine_params.py
   max_plus): for m and x of layout [outer, channels, inner] (contiguous float32) and each
   channel c, gain[c] = max of m + log|(x - mean[c]) * invstd[c]| and bias[c] = max of m over
   the channel's outer x inner entries. x̂ is formed as torch's two ops do (a subtraction, then a
   product: no fused multiply-add), its log within one ulp (log0_ps: subnormals kept, log 0 =
   -inf). A channel whose vector pass meets a NaN, or an x̂ that is not finite, is summed again
   entry by entry with libm's logf, so that NaN and infinities come out as torch's amax gives
   them. Why: at MobileNetV3-small's batch-norm shapes the compiled reduction took 165-825 us
   per call on one core, this loop 93-533 us (``bench_kernel_costs.py --only affine_max``,
   2026-11-28, Zen 3); most of either is the logarithm of every entry. */
void semipack_max_affine_f32(const float *m, const float *x, const float *mean,
                             const float *invstd, int64_t outer, int64_t channels,
                             int64_t inner, float *gain, float *bias, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < channels; c++) {
        const __m256 mu = _mm256_set1_ps(mean[c]), inv = _mm256_set1_ps(invstd[c]);
        const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
        __m256 g = _mm256_set1_ps(-INFINITY), b = g;
        __m256 usual = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        float gs = -INFINITY, bs = -INFINITY;
        int unusual = 0;
        for (int64_t a = 0; a < outer && !unusual; a++) {
            const float *mr = m + (a * channels + c) * inner, *xr = x + (a * channels + c) * inner;
            int64_t k = 0;
            for (; k + 8 <= inner; k += 8) {
                const __m256 mv = _mm256_loadu_ps(mr + k);
                const __m256 mag = _mm256_andnot_ps(
                    sign, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + k), mu), inv));
                const __m256 v = _mm256_add_ps(mv, log0_ps(mag));
                /* mag < inf is false for NaN and inf; v == v false for NaN (+inf + -inf) */
                usual = _mm256_and_ps(usual, _mm256_cmp_ps(mag, inf, _CMP_LT_OQ));
                usual = _mm256_and_ps(usual, _mm256_cmp_ps(v, v, _CMP_EQ_OQ));
                usual = _mm256_and_ps(usual, _mm256_cmp_ps(mv, mv, _CMP_EQ_OQ));
                g = _mm256_max_ps(g, v);
                b = _mm256_max_ps(b, mv);
            }
            for (; k < inner; k++) {
                const float mag = fabsf((xr[k] - mean[c]) * invstd[c]);
                const float v = mr[k] + logf(mag);
                if (!(mag < INFINITY) || v != v || mr[k] != mr[k]) unusual = 1;
                if (v > gs) gs = v;
                if (mr[k] > bs) bs = mr[k];
            }
            if (_mm256_movemask_ps(usual) != 0xff) unusual = 1;
        }
        if (unusual) {
            max_affine_channel_scalar(m, x, mean[c], invstd[c], outer, channels, inner, c, gain,
                                      bias);
            continue;
        }
        float lanes[8], blanes[8];
        _mm256_storeu_ps(lanes, g);
        _mm256_storeu_ps(blanes, b);
        for (int i = 0; i < 8; i++) {
            if (lanes[i] > gs) gs = lanes[i];
            if (blanes[i] > bs) bs = blanes[i];
        }
        gain[c] = gs;
        bias[c] = bs;
    }
}

/* out[i] = zero where x[i] <= threshold, else part[i], for i < n (out may be part): a ReLU's
   cut of a state (kernels/cuts.py). A select copies, it does not round, so the bits are
   torch.where's; NaN in x keeps part (the comparison is false), as threshold_backward does.
   Why here: the compiled select cost a compilation on a process's first ReLU (inductor's
   start-up, most of what a first ResNet or MobileNet MaxProd backward took beyond the
   transformers import, benchmarks/bench_first_call.py) and guards on every call. */
void semipack_cut_below_f32(const float *part, const float *x, float *out, int64_t n,
                            float threshold, float zero, int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    const __m256 t = _mm256_set1_ps(threshold), z = _mm256_set1_ps(zero);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        int64_t i = b * BLOCK;
        for (; i + 8 <= end; i += 8) {
            const __m256 off = _mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_LE_OQ);
            _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_loadu_ps(part + i), z, off));
        }
        for (; i < end; i++) out[i] = x[i] <= threshold ? zero : part[i];
    }
}
