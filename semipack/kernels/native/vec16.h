/* Sixteen float32 lanes, the width of one packed panel row (see maxplus.c), as one AVX-512
   register or two AVX2 registers.

   Why: a max-plus pair is an add and a max, and a core retires two vector operations per cycle
   whatever their width, so 16-lane registers do twice the pairs per cycle of 8-lane ones where
   the core runs 512-bit operations at full width (measured on AMD Zen 5: 12 vaddps, vmaxps or
   vfmadd231ps take 6 cycles in ymm and in zmm alike). The kernels are written once against
   this header; the library is built twice (see __init__.py), with and without AVX-512, and the
   wider build is loaded only where PyTorch reports AVX-512. Every operation here is lane-wise
   and exact (an IEEE add, a max, a compare), so both builds give the same bits.

   V16_ROWS / V16_ARGMAX_ROWS: rows of a register tile in the max-plus kernels, as many as the
   register file holds (AVX2: 16 ymm; AVX-512: 32 zmm). */

#ifndef SEMIPACK_VEC16_H
#define SEMIPACK_VEC16_H

#include <immintrin.h>
#include <math.h>

#if defined(__AVX512F__)

#define V16_ROWS 12
#define V16_ARGMAX_ROWS 8

typedef __m512 v16;

static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v16_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
/* at where s > best (ordered: a NaN never replaces), else keep */
static inline v16 v16_take_greater(v16 keep, v16 at, v16 s, v16 best) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, best, _CMP_GT_OQ), keep, at);
}
static inline float v16_min_lanes(v16 v) { return _mm512_reduce_min_ps(v); }

#else

#define V16_ROWS 6
#define V16_ARGMAX_ROWS 3

typedef struct {
    __m256 lo, hi;
} v16;

static inline v16 v16_set1(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return (v16){v, v};
}
static inline v16 v16_load(const float *p) {
    return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline void v16_store(float *p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline v16 v16_add(v16 a, v16 b) {
    return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline v16 v16_max(v16 a, v16 b) {
    return (v16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
static inline v16 v16_min(v16 a, v16 b) {
    return (v16){_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
}
static inline v16 v16_take_greater(v16 keep, v16 at, v16 s, v16 best) {
    return (v16){_mm256_blendv_ps(keep.lo, at.lo, _mm256_cmp_ps(s.lo, best.lo, _CMP_GT_OQ)),
                 _mm256_blendv_ps(keep.hi, at.hi, _mm256_cmp_ps(s.hi, best.hi, _CMP_GT_OQ))};
}
static inline float v16_min_lanes(v16 v) {
    const __m256 m = _mm256_min_ps(v.lo, v.hi);
    const __m128 h = _mm_min_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 q = _mm_min_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_min_ss(q, _mm_shuffle_ps(q, q, 1)));
}

#endif

/* One lane broadcast to all sixteen. */
static inline v16 v16_bcast(const float *p) { return v16_set1(*p); }

#endif
