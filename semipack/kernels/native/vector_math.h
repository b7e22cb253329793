/* Vectorised single-precision math shared by the native kernels (AVX2 + FMA, 8 lanes).

   log_ps: the classic range reduction x = m 2^e, m in [sqrt(1/2), sqrt(2)), with a degree-9
   polynomial for log(m) (the Cephes logf coefficients), about one ulp for normal positive x.
   log0_ps extends it to every x >= 0: log 0 = -inf, subnormals rescaled by 2^23 first.
   exp_ps: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact reduction) and the
   Cephes expf polynomial; exp(x) for x < -87.3 is flushed to 0 (a subnormal result carries less
   than one part in 2^126 of any sum it joins here), -inf gives 0; x is capped at 88.
   log1p_ps: log(1 + x) for x >= -1 with the correction log(u) * x / (u - 1), u = 1 + x, which
   keeps full relative precision for small x (Goldberg's trick). */

#ifndef SEMIPACK_VECTOR_MATH_H
#define SEMIPACK_VECTOR_MATH_H

#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* The Cephes logf polynomial after its leading 7.0376836292e-2: STEP(c) for each coefficient
   in Horner order, shared by log_ps and log_ps16 so that both evaluate the same polynomial. */
#define SEMIPACK_LOG_POLY(STEP)                                                                  \
    STEP(-1.1514610310e-1f) STEP(1.1676998740e-1f) STEP(-1.2420140846e-1f)                        \
    STEP(1.4249322787e-1f) STEP(-1.6668057665e-1f) STEP(2.0000714765e-1f)                         \
    STEP(-2.4999993993e-1f) STEP(3.3333331174e-1f)

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
#define SEMIPACK_LOG_STEP(c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    SEMIPACK_LOG_POLY(SEMIPACK_LOG_STEP)
#undef SEMIPACK_LOG_STEP
    const __m256 f2 = _mm256_mul_ps(f, f);
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f2), f);
    const __m256 ef = _mm256_cvtepi32_ps(e);
    y = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(f2, _mm256_set1_ps(0.5f), y);
    y = _mm256_add_ps(f, y);
    return _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), y);
}

#if defined(__AVX512F__)
/* log_ps on 16 lanes: the same operations lane by lane (so the same bits per lane). */
static inline __m512 log_ps16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127));
    __m512 m = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x3f800000)));
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_epi32(e, big, e, _mm512_set1_epi32(1));
    const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
    __m512 p = _mm512_set1_ps(7.0376836292e-2f);
#define SEMIPACK_LOG_STEP(c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    SEMIPACK_LOG_POLY(SEMIPACK_LOG_STEP)
#undef SEMIPACK_LOG_STEP
    const __m512 f2 = _mm512_mul_ps(f, f);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f2), f);
    const __m512 ef = _mm512_cvtepi32_ps(e);
    y = _mm512_fmadd_ps(ef, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(f2, _mm512_set1_ps(0.5f), y);
    y = _mm512_add_ps(f, y);
    return _mm512_fmadd_ps(ef, _mm512_set1_ps(0.693359375f), y);
}
#endif

/* The sums of one row, each unordered pair {i, j} visited once: c_ij and its logarithm are
   symmetric in i and j, so the pair's terms go to output j (weight a_i, mean r_i) and to output
   i (weight a_j, mean r_j) from one evaluation, which halves the logarithms, the bulk of the
   work. For each i the lanes j >= i are swept in vectors of 8: terms for j accumulate in the
   row's outputs (kept in L1), terms for i in three vector accumulators summed at the end. The
   diagonal pair i = j counts once. Inputs are padded to whole vectors with a = r = x̂ = 0, whose
   terms are zero (a = 0) and whose outputs are dropped. */

static inline __m256 log0_ps(__m256 x) {
    const __m256 tiny = _mm256_set1_ps(1.17549435e-38f);
    const __m256 sub = _mm256_cmp_ps(x, tiny, _CMP_LT_OQ);
    const __m256 scaled = _mm256_blendv_ps(x, _mm256_mul_ps(x, _mm256_set1_ps(8388608.0f)), sub);
    __m256 y = log_ps(scaled);
    y = _mm256_sub_ps(y, _mm256_and_ps(sub, _mm256_set1_ps(15.942385152878742f))); /* 23 ln 2 */
    const __m256 zero = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ);
    return _mm256_blendv_ps(y, _mm256_set1_ps(-__builtin_inff()), zero);
}

/* (exp(r) - 1 - r) / r^2 on |r| <= ln2 / 2: the Cephes expf polynomial, shared by exp_ps and
   the readout exponential of elementwise.c. */
static inline __m256 exp_poly_ps(__m256 r) {
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    return _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
}

static inline __m256 exp_ps(__m256 x) {
    const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = exp_poly_ps(r);
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(low, y);
}

static inline __m256 log1p_ps(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 u = _mm256_add_ps(one, x);
    const __m256 d = _mm256_sub_ps(u, one);
    const __m256 exact = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ); /* u == 1 */
    const __m256 safe = _mm256_blendv_ps(d, one, exact);
    const __m256 y = _mm256_mul_ps(log0_ps(u), _mm256_div_ps(x, safe));
    /* u == 0 (x = -1): log0 gives -inf and x / d = 1 */
    return _mm256_blendv_ps(y, x, exact);
}

/* The exponential and logarithm with every special value handled (elementwise.c's doc comment
   states their contract: within one ulp, subnormal results kept, specials as torch's), shared by
   the readouts of elementwise.c and the log-derivatives of log_derivatives.c; tail_mask: the
   lanes of a last, partial vector of `left` entries. */
static inline __m256 exp_readout_ps(__m256 x) {
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    /* exp(x) below -104 (< 2^-150) rounds to 0: those lanes (-inf, "no path", among them)
       compute exp(0) and are zeroed at the end, so no subnormal intermediate (a slow
       microcode assist on x86) is made for them. exp(89) overflows: the clamp keeps n in
       [-150, 128]. */
    const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_LT_OQ);
    const __m256 c = _mm256_andnot_ps(low, _mm256_min_ps(x, _mm256_set1_ps(89.0f)));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = c - n ln 2 as hi + lo: hi exact (a 9-bit part of ln 2), the rest's product rounded
       (n ln2's remaining bits, at most 150 * 2.1e-4), then an exact TwoSum, so that no
       rounding of r itself reaches the result */
    const __m256 hi = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c);
    const __m256 lo = _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f));
    const __m256 r = _mm256_add_ps(hi, lo);
    const __m256 back = _mm256_sub_ps(r, hi);
    const __m256 r_err = _mm256_add_ps(_mm256_sub_ps(hi, _mm256_sub_ps(r, back)),
                                       _mm256_sub_ps(lo, back));
    const __m256 p = exp_poly_ps(r); /* (exp(r) - 1 - r) / r^2 */
    /* 1 + r + r_err + p r^2 with one rounding that matters: 1 + r exactly as head + tail */
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 head = _mm256_add_ps(one, r);
    const __m256 tail = _mm256_add_ps(_mm256_sub_ps(one, head), r); /* exact: |r| < 1 */
    const __m256 y = _mm256_add_ps(
        head, _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(tail, r_err))); /* [0.70, 1.42] */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256i rest = _mm256_sub_epi32(ni, half);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    const __m256 out = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2); /* y * s1 exact, one rounding */
    return _mm256_blendv_ps(_mm256_andnot_ps(low, out), x, nan);
}

static inline __m256 log_readout_ps(__m256 x) {
    /* Eight normal, positive, finite lanes (a product's sums, nearly always): log_ps alone gives
       the bits the full form below gives them (its corrections add 0 or blend x away), with
       a quarter fewer operations (a MiniLM weight message's log, 590k entries on one AVX2
       core: 1.04 -> 0.79 ns an entry). */
    const __m256 normal = _mm256_and_ps(
        _mm256_cmp_ps(x, _mm256_set1_ps(1.17549435e-38f), _CMP_GE_OQ),
        _mm256_cmp_ps(x, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ));
    if (_mm256_movemask_ps(normal) == 0xff) return log_ps(x);
    const __m256 y = log0_ps(x); /* zeros and subnormals; wrong only for inf, NaN and x < 0 */
    const __m256 inf = _mm256_set1_ps(__builtin_inff());
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q),
                                     _mm256_cmp_ps(x, inf, _CMP_EQ_OQ));
    const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 out = _mm256_blendv_ps(y, x, keep);
    return _mm256_blendv_ps(out, _mm256_set1_ps(__builtin_nanf("")), negative);
}

static inline __m256i tail_mask(int64_t left) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), lanes);
}

#endif
