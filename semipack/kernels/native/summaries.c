/* A training monitor's per-layer summaries (monitor.py, _summaries) over float32 values, each in
   one or two reading passes, called through ctypes (see __init__.py).

   Why hand-written: the monitor summarises every parameter's values on each sampled step, and
   with torch's reductions that was about a dozen passes over them, several writing a temporary
   as large (the shifted exponentials, two NaN-free copies, a mask) and two converting every
   entry to float64 for its sum: 100-160 ms per sampled step on ResNet-18's 11 million entries
   (`benchmarks/bench_monitor.py --model resnet18`), about half a plain training step.

   The results are torch's: the same first index of the maximum (a NaN counts as the largest,
   its first one wins, as torch.argmax gives), the same maxima and counts, and sums in float64
   of the same float32 terms (the exponentials within one ulp of torch's, exp_readout_ps), in
   another order (by blocks of entries, then in order of the blocks). Work is split in blocks
   of whole units (best_entries) or entries (the others), each thread's blocks in order, and the
   partial results are combined in block order: the same results whatever the thread count. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define SUMMARY_BLOCK 16384 /* entries per block of the entrywise reductions */

/* The 8 entries from x + i, with -inf in the lanes past the `left` entries that remain. */
static inline __m256 load_or_low(const float *x, int64_t i, int64_t left) {
    if (left >= 8) return _mm256_loadu_ps(x + i);
    const __m256i mask = tail_mask(left);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + i, mask),
                            _mm256_castsi256_ps(mask));
}

static inline float hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* The largest of x[0..n) ignoring NaN (-inf when n is 0), and whether a NaN is among them. */
static float max_and_nan(const float *x, int64_t n, int *nan) {
    __m256 top = _mm256_set1_ps(-INFINITY), top2 = top, unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        top = _mm256_max_ps(a, top); /* max_ps gives its second operand (top) at a NaN */
        top2 = _mm256_max_ps(b, top2);
    }
    for (; i < n; i += 8) {
        const __m256 a = load_or_low(x, i, n - i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        top = _mm256_max_ps(a, top);
    }
    *nan = _mm256_movemask_ps(unordered) != 0;
    return hmax(_mm256_max_ps(top, top2));
}

/* The first i in [0, n) with x[i] == value, or where x[i] is NaN when value is NaN. */
static int64_t first_at(const float *x, int64_t n, float value) {
    const int nan = value != value;
    for (int64_t i = 0; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == value) return i;
    return 0;
}

typedef struct {
    float top;     /* the largest entry of the block's units (NaN where one is NaN) */
    int64_t at;    /* the first index attaining it */
    int64_t dead;  /* units whose largest entry is -inf */
} best_part;

/* best_entries over units [u0, u1). */
static best_part best_of_units(const float *x, int64_t u0, int64_t u1, int64_t size) {
    best_part part = {-INFINITY, u0 * size, 0};
    for (int64_t u = u0; u < u1; u++) {
        const float *unit = x + u * size;
        int nan = 0;
        const float top = max_and_nan(unit, size, &nan);
        if (nan) { /* the first NaN of the first unit holding one is torch.argmax's answer */
            if (part.top == part.top) {
                part.top = NAN;
                part.at = u * size + first_at(unit, size, NAN);
            }
            continue; /* a unit with a NaN is not dead (its amax is NaN) */
        }
        if (top == -INFINITY) part.dead++;
        if (part.top == part.top && top > part.top) {
            part.top = top;
            part.at = u * size + first_at(unit, size, top);
        }
    }
    return part;
}

/* x [units, size]: the first index of the largest entry (a NaN counting as largest), that
   entry, and how many units have only -inf entries. All -inf gives index 0. */
void semipack_best_entries_f32(const float *x, int64_t units, int64_t size, int64_t *at,
                               float *top, int64_t *dead, int threads) {
    const int64_t per_block = size >= SUMMARY_BLOCK ? 1 : SUMMARY_BLOCK / (size > 0 ? size : 1);
    const int64_t blocks = (units + per_block - 1) / per_block;
    best_part *parts = malloc(sizeof(best_part) * (size_t)(blocks > 0 ? blocks : 1));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t u1 = (b + 1) * per_block < units ? (b + 1) * per_block : units;
        parts[b] = best_of_units(x, b * per_block, u1, size);
    }
    best_part all = {-INFINITY, 0, 0};
    for (int64_t b = 0; b < blocks; b++) {
        all.dead += parts[b].dead;
        if (all.top != all.top) continue; /* a NaN came first */
        if (parts[b].top != parts[b].top || parts[b].top > all.top) {
            all.top = parts[b].top;
            all.at = parts[b].at;
        }
    }
    free(parts);
    *at = all.at;
    *top = all.top;
    *dead = all.dead;
}

/* Σ of the 8 float lanes of v into two double accumulators. */
static inline void add_to_doubles(__m256 v, __m256d *lo, __m256d *hi) {
    *lo = _mm256_add_pd(*lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    *hi = _mm256_add_pd(*hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double hsum_doubles(__m256d lo, __m256d hi) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(lo, hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* log Σ exp(x) over x[0..n): shifted by the largest entry, as monitor._log_sum_exp (the
   exponentials exp(x - top) in float32, their sum in float64); the largest itself where it is
   infinite, NaN where an entry is NaN. */
double semipack_log_sum_exp_f32(const float *x, int64_t n, int threads) {
    const int64_t blocks = (n + SUMMARY_BLOCK - 1) / SUMMARY_BLOCK;
    float *tops = malloc(sizeof(float) * (size_t)(blocks > 0 ? blocks : 1));
    int *nans = malloc(sizeof(int) * (size_t)(blocks > 0 ? blocks : 1));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * SUMMARY_BLOCK < n ? (b + 1) * SUMMARY_BLOCK : n;
        tops[b] = max_and_nan(x + b * SUMMARY_BLOCK, end - b * SUMMARY_BLOCK, &nans[b]);
    }
    float top = -INFINITY;
    int nan = 0;
    for (int64_t b = 0; b < blocks; b++) {
        nan |= nans[b];
        top = tops[b] > top ? tops[b] : top;
    }
    free(tops);
    free(nans);
    if (nan) return NAN;
    if (isinf(top)) return (double)top;
    double *sums = malloc(sizeof(double) * (size_t)blocks);
    const __m256 shift = _mm256_set1_ps(top);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * SUMMARY_BLOCK < n ? (b + 1) * SUMMARY_BLOCK : n;
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (int64_t i = b * SUMMARY_BLOCK; i < end; i += 8) /* exp(-inf) = 0 past the end */
            add_to_doubles(exp_readout_ps(_mm256_sub_ps(load_or_low(x, i, end - i), shift)),
                           &lo, &hi);
        sums[b] = hsum_doubles(lo, hi);
    }
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) total += sums[b];
    free(sums);
    return log(total) + (double)top;
}

/* Over the entries of x[0..n) that are not NaN: how many, their sum in float64 (infinities
   included) and the largest (-inf where none). */
void semipack_number_stats_f32(const float *x, int64_t n, int64_t *count, double *total,
                               float *top, int threads) {
    const int64_t blocks = (n + SUMMARY_BLOCK - 1) / SUMMARY_BLOCK;
    const int64_t slots = blocks > 0 ? blocks : 1;
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)slots);
    double *sums = malloc(sizeof(double) * (size_t)slots);
    float *tops = malloc(sizeof(float) * (size_t)slots);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * SUMMARY_BLOCK < n ? (b + 1) * SUMMARY_BLOCK : n;
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        __m256 best = _mm256_set1_ps(-INFINITY);
        int64_t numbers = 0;
        for (int64_t i = b * SUMMARY_BLOCK; i < end; i += 8) {
            const int64_t left = end - i;
            const __m256 v = left >= 8 ? _mm256_loadu_ps(x + i)
                                       : _mm256_maskload_ps(x + i, tail_mask(left));
            __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
            if (left < 8) ordered = _mm256_and_ps(ordered, _mm256_castsi256_ps(tail_mask(left)));
            numbers += __builtin_popcount((unsigned)_mm256_movemask_ps(ordered));
            add_to_doubles(_mm256_and_ps(v, ordered), &lo, &hi); /* 0 at a NaN */
            best = _mm256_max_ps(best, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, ordered));
        }
        counts[b] = numbers;
        sums[b] = hsum_doubles(lo, hi);
        tops[b] = hmax(best);
    }
    int64_t all = 0;
    double sum = 0.0;
    float largest = -INFINITY;
    for (int64_t b = 0; b < blocks; b++) {
        all += counts[b];
        sum += sums[b];
        largest = tops[b] > largest ? tops[b] : largest;
    }
    free(counts);
    free(sums);
    free(tops);
    *count = all;
    *total = sum;
    *top = largest;
}
