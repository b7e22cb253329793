/* MaxProd messages of a 2-D depthwise convolution (each output channel reads one input
   channel), called through ctypes (see __init__.py and rules/depthwise.py).

   Why a kernel: the per-tap path builds, for every tap, the sum of a message and a lifted
   weight or input as a tensor the size of the output and reduces it again; MobileNet's
   depthwise layers then cost 8-15 ns per multiply-add against 0.3 for a dense convolution.
   Here the work stays in registers: at stride 1 each block of 8 input entries gathers every
   tap's candidates (one store), and a kernel row's taps share the message's loads for the
   weight message; other strides sweep each plane once per tap (rules/depthwise.py gives
   these loops strided layers only with a dilation: at dilation 1 it splits a stride into
   stride-1 problems, one per phase).

   Shapes (row-major, contiguous): m [B, C*M, Ho, Wo] log-messages of the output (M output
   channels per input channel, channel c*M + u reads input channel c); lw [C*M, KH, KW]
   log|w|; lx [B, C, Hp, Wp] log|x| of the zero-padded input with -inf on the padding (no edge).
   Output position (oh, ow) of tap (kh, kw) reads padded input (oh*SH + kh*DH, ow*SW + kw*DW).

     input message   dx[b, c, ih, iw] = max over u, taps, and the outputs reading (ih, iw) of
                                        m[b, c*M+u, oh, ow] + lw[c*M+u, kh, kw]
     weight message  dw[c*M+u, kh, kw] = max over b, oh, ow of
                                        m[b, c*M+u, oh, ow] + lx[b, c, oh*SH+kh*DH, ow*SW+kw*DW]

   dx is over the padded input (the caller crops). Values equal the per-tap path bit for bit:
   each candidate is the same float sum, and a max does not round. The caller guarantees no NaN
   and no +inf in m, lw, lx (the max here does not propagate NaN). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

static inline float max1(float a, float b) { return a > b ? a : b; }

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* A row's last columns after the blocks of 32 that start at 0, from column iw (iw < width,
   width >= 8): up to four more vectors, the last ending at the row's end (it recomputes some
   columns; a max over the same candidates gives them again), run as independent chains (one
   chain of 8 columns waited on each maximum's latency). Fills at[] and returns how many. */
static inline int last_columns(int64_t iw, int64_t width, int64_t at[4]) {
    const int64_t last = width - 8;
    for (int j = 0; j < 4; j++) at[j] = iw + 8 * j < last ? iw + 8 * j : last;
    return (int)((width - iw + 7) / 8);
}

/* Columns of `rows` input rows of the gather below, row by row, n vectors from `base` and `dst`
   (the block's first column): vector j at column 8 j, the last at column `last` (8 (n - 1), or
   less where the row's end is no vector's: the last vector then ends at the row's end and
   recomputes some columns, as last_columns says). Every tap's candidates go into n independent
   chains of maxima, one store each. The rows loop sits here, inside, so that a row's setup is a
   pointer step (a 3x3 kernel's 56-column rows had spent as long on setup as on their maxima).
   Each candidate's load sits at a constant offset from its tap's pointer, and up to 9 weights
   stay in registers for all the rows: with offsets and dilations folded into each load, GCC
   kept a 3x3 kernel's weights and most offsets on the stack and reloaded them, 1.75 loads per
   candidate where the loads bound the loop (by hand: the hot 56 x 56 plane at 12-14 G pairs/s,
   16-18 this way, against 24 for the loads and maxima alone). `first` and n are constants
   where this is inlined. */
static inline __attribute__((always_inline)) void gather_block(
    const float *base, const float *lwo, float *dst, int64_t rows, int64_t wp, int64_t row,
    const int n, const int first, const int64_t kh_n, const int64_t kw_n, int64_t dh,
    int64_t dw, int64_t last) {
    /* up to 9 taps the weights stay in registers beside the 4 maxima; more would spill, and a
       spilled weight costs the load its broadcast does */
    const int kept = kh_n * kw_n <= 9;
    __m256 w[9];
    if (kept)
        for (int64_t t = 0; t < kh_n * kw_n; t++) w[t] = _mm256_set1_ps(lwo[t]);
    for (int64_t r = 0; r < rows; r++, base += row, dst += wp) {
        __m256 a[4];
#pragma GCC unroll 4
        for (int j = 0; j < n; j++)
            a[j] = first ? _mm256_set1_ps(-__builtin_inff())
                         : _mm256_loadu_ps(dst + (j < n - 1 ? 8 * j : last));
#pragma GCC unroll 8
        for (int64_t kh = 0; kh < kh_n; kh++) {
            const float *src = base - kh * dh * row;
            /* one register per kernel row, the loads at constant offsets from it (dw is 1, a
               constant, in the common case): without this barrier GCC folded kh * dh * row
               into each load's offset, one 64-bit value per candidate, and spilled them */
            __asm__("" : "+r"(src));
#pragma GCC unroll 8
            for (int64_t kw = 0; kw < kw_n; kw++) {
                const __m256 wt = kept ? w[kh * kw_n + kw] : _mm256_set1_ps(lwo[kh * kw_n + kw]);
#pragma GCC unroll 4
                for (int j = 0; j < n; j++)
                    a[j] = _mm256_max_ps(
                        a[j], _mm256_add_ps(
                                  _mm256_loadu_ps(src - kw * dw + (j < n - 1 ? 8 * j : last)), wt));
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < n; j++) _mm256_storeu_ps(dst + (j < n - 1 ? 8 * j : last), a[j]);
    }
}

/* gather_block with n as a constant (n vectors, 1 to 4), and `first` and a column dilation of
   1 as constants in the common case (a dilated kernel's column offsets are read at run time). */
static inline __attribute__((always_inline)) void gather_block_n(
    const float *base, const float *lwo, float *dst, int64_t rows, int64_t wp, int64_t row,
    int n, int first, const int64_t kh_n, const int64_t kw_n, int64_t dh, int64_t dw,
    int64_t last) {
#define SEMIPACK_GATHER_BLOCK(N)                                                                  \
    (dw != 1 ? gather_block(base, lwo, dst, rows, wp, row, N, first, kh_n, kw_n, dh, dw, last)    \
     : first ? gather_block(base, lwo, dst, rows, wp, row, N, 1, kh_n, kw_n, dh, 1, last)         \
             : gather_block(base, lwo, dst, rows, wp, row, N, 0, kh_n, kw_n, dh, 1, last))
    switch (n) {
    case 1: SEMIPACK_GATHER_BLOCK(1); break;
    case 2: SEMIPACK_GATHER_BLOCK(2); break;
    case 3: SEMIPACK_GATHER_BLOCK(3); break;
    default: SEMIPACK_GATHER_BLOCK(4);
    }
#undef SEMIPACK_GATHER_BLOCK
}

/* Stride 1: each input position gathers its candidates instead. With the output plane padded
   by -inf (no path) on every side, input (ih, iw) reads tap (kh, kw) at padded output
   (ih - kh*DH + PH, iw - kw*DW + PW), in range for every input position: a block of 8 inputs
   costs a load, an add and a max per tap in registers and one store, where the scatter loop
   loads and stores the destination for every tap. Same candidates, so the same maxima. `pad`
   is the caller's per-thread buffer, filled with -inf once: only its interior is written here,
   so its border stays -inf for every plane (filling the whole buffer per plane cost as much as
   the plane's maxima for a 5x5 kernel). Only the plane's entries that are inputs are gathered:
   the convolution's zero padding, `ch` rows and `cw` columns on each side, is no input and
   gets -inf (a 5x5 kernel on a 14 x 14 plane computed 18 x 24 entries for 14 x 14 inputs). */
static inline __attribute__((always_inline)) void input_plane_gather_k(
    const float *mo, const float *lwo, float *plane, float *pad, int first, int64_t ho,
    int64_t wo, int64_t hp, int64_t wp, const int64_t kh_n, const int64_t kw_n, int64_t dh,
    int64_t dw, int64_t ch, int64_t cw) {
    const int64_t ph = (kh_n - 1) * dh, pw = (kw_n - 1) * dw, row = wo + 2 * pw;
    const int64_t width = wp - 2 * cw;
    for (int64_t oh = 0; oh < ho; oh++)
        memcpy(pad + (oh + ph) * row + pw, mo + oh * wo, sizeof(float) * (size_t)wo);
    if (first) { /* the padding: no input, no message */
        for (int64_t i = 0; i < ch * wp; i++)
            plane[i] = plane[(hp - ch) * wp + i] = -__builtin_inff();
        for (int64_t ih = ch; ih < hp - ch; ih++)
            for (int64_t j = 0; j < cw; j++)
                plane[ih * wp + j] = plane[ih * wp + wp - 1 - j] = -__builtin_inff();
    }
    /* tap (0, 0) of input column iw of the first input row: base + iw */
    const float *base = pad + (ch + ph) * row + pw + cw;
    float *dst = plane + ch * wp + cw;
    const int64_t rows = hp - 2 * ch;
    if (width < 8) {
        for (int64_t ih = 0; ih < rows; ih++)
            for (int64_t iw = 0; iw < width; iw++) {
                float best = first ? -__builtin_inff() : dst[ih * wp + iw];
                for (int64_t kh = 0; kh < kh_n; kh++)
                    for (int64_t kw = 0; kw < kw_n; kw++)
                        best = max1(best, base[ih * row + iw - kh * dh * row - kw * dw] +
                                              lwo[kh * kw_n + kw]);
                dst[ih * wp + iw] = best;
            }
        return;
    }
    int64_t iw = 0;
    for (; iw + 32 <= width; iw += 32)
        gather_block_n(base + iw, lwo, dst + iw, rows, wp, row, 4, first, kh_n, kw_n, dh, dw, 24);
    if (iw == width) return;
    int64_t at[4];
    const int n = last_columns(iw, width, at);
    gather_block_n(base + iw, lwo, dst + iw, rows, wp, row, n, first, kh_n, kw_n, dh, dw,
                   at[n - 1] - iw);
}

/* input_plane_gather_k with the common kernel sizes as constants: their taps unroll and a 3x3
   kernel's weights stay in registers for the whole plane. */
static void input_plane_gather(const float *mo, const float *lwo, float *plane, float *pad,
                               int first, int64_t ho, int64_t wo, int64_t hp, int64_t wp,
                               int64_t kh_n, int64_t kw_n, int64_t dh, int64_t dw, int64_t ch,
                               int64_t cw) {
    if (kh_n == 3 && kw_n == 3)
        input_plane_gather_k(mo, lwo, plane, pad, first, ho, wo, hp, wp, 3, 3, dh, dw, ch, cw);
    else if (kh_n == 5 && kw_n == 5)
        input_plane_gather_k(mo, lwo, plane, pad, first, ho, wo, hp, wp, 5, 5, dh, dw, ch, cw);
    else
        input_plane_gather_k(mo, lwo, plane, pad, first, ho, wo, hp, wp, kh_n, kw_n, dh, dw, ch,
                             cw);
}

/* ch, cw: the convolution's padding (rows and columns on each side of the padded plane that
   are no input); the gather leaves them -inf, the other loops compute them too (the caller
   crops them either way). */
void semipack_depthwise_input_f32(const float *m, const float *lw, float *dx, int64_t batch,
                                  int64_t channels, int64_t mult, int64_t ho, int64_t wo,
                                  int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n, int64_t sh,
                                  int64_t sw, int64_t dh, int64_t dw, int64_t ch, int64_t cw,
                                  int threads) {
    /* the gather needs stride 1 and a padded input no larger than the outputs read */
    const int gather = sh == 1 && sw == 1 && hp == ho + (kh_n - 1) * dh &&
                       wp == wo + (kw_n - 1) * dw && 2 * ch < hp && 2 * cw < wp;
#pragma omp parallel num_threads(threads)
    {
        const int64_t padded = (ho + 2 * (kh_n - 1) * dh) * (wo + 2 * (kw_n - 1) * dw);
        float *pad = gather ? malloc(sizeof(float) * padded) : 0;
        if (pad) /* the border: -inf (no path) for every plane this thread gathers */
            for (int64_t i = 0; i < padded; i++) pad[i] = -__builtin_inff();
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < batch * channels; bc++) {
            const int64_t b = bc / channels, c = bc % channels;
            float *plane = dx + bc * hp * wp;
            if (pad) {
                for (int64_t u = 0; u < mult; u++) {
                    const int64_t o = c * mult + u;
                    input_plane_gather(m + (b * channels * mult + o) * ho * wo,
                                       lw + o * kh_n * kw_n, plane, pad, u == 0, ho, wo, hp, wp,
                                       kh_n, kw_n, dh, dw, ch, cw);
                }
                continue;
            }
            for (int64_t i = 0; i < hp * wp; i++) plane[i] = -__builtin_inff();
            for (int64_t u = 0; u < mult; u++) {
                const int64_t o = c * mult + u;
                const float *mo = m + (b * channels * mult + o) * ho * wo;
                for (int64_t kh = 0; kh < kh_n; kh++) {
                    for (int64_t kw = 0; kw < kw_n; kw++) {
                        const float w = lw[(o * kh_n + kh) * kw_n + kw];
                        const __m256 wv = _mm256_set1_ps(w);
                        for (int64_t oh = 0; oh < ho; oh++) {
                            const float *src = mo + oh * wo;
                            float *dst = plane + (oh * sh + kh * dh) * wp + kw * dw;
                            int64_t ow = 0;
                            if (sw == 1) {
                                for (; ow + 8 <= wo; ow += 8) {
                                    const __m256 cand =
                                        _mm256_add_ps(_mm256_loadu_ps(src + ow), wv);
                                    _mm256_storeu_ps(
                                        dst + ow, _mm256_max_ps(_mm256_loadu_ps(dst + ow), cand));
                                }
                            }
                            for (; ow < wo; ow++) dst[ow * sw] = max1(dst[ow * sw], src[ow] + w);
                        }
                    }
                }
            }
        }
        free(pad);
    }
}

/* The 8 entries of a row at columns j * SW from `at` (SW 1 or 2, a constant where inlined):
   at stride 2, at[0], at[2], ..., at[14] from two loads (at[0..7] and at[7..14]: nothing past
   the last entry read), a shuffle and a permutation, so that a stride-2 layer's weight message
   reads its input in place. */
static inline __attribute__((always_inline)) __m256 load_columns(const float *at, const int SW) {
    if (SW == 1) return _mm256_loadu_ps(at);
    /* [at0 at2 at8 at10 | at4 at6 at12 at14], then its 64-bit lanes in the order 0 2 1 3 */
    const __m256 picked = _mm256_shuffle_ps(_mm256_loadu_ps(at), _mm256_loadu_ps(at + 7), 0xD8);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(picked), 0xD8));
}

/* Unit column stride, up to 8 taps per kernel row: the taps of one kernel row share the message's
   loads (one load of m per 8 outputs feeds every tap's maximum), and a row's last columns are
   one more vector ending at the row's end (a maximum counts a candidate twice harmlessly).
   Inlined with kw_n a constant (weight_row): with a run-time tap count the compiler kept the
   accumulators in memory, and each maximum waited on a store and a load (half the dense
   product's rate). */
static inline __attribute__((always_inline)) void weight_row_taps(
    const float *m, const float *lx, float *out, int64_t batch, int64_t channels, int64_t mult,
    int64_t o, int64_t kh, int64_t ho, int64_t wo, int64_t hp, int64_t wp, const int kw_n,
    int64_t sh, int64_t dh, int64_t dw, const int SW) {
    const int64_t c = o / mult;
    __m256 acc[8], acc2[8];
    float best[8];
#pragma GCC unroll 8
    for (int kw = 0; kw < kw_n; kw++) {
        acc[kw] = acc2[kw] = _mm256_set1_ps(-__builtin_inff());
        best[kw] = -__builtin_inff();
    }
    for (int64_t b = 0; b < batch; b++) {
        const float *mo = m + (b * channels * mult + o) * ho * wo;
        const float *xc = lx + (b * channels + c) * hp * wp + kh * dh * wp;
        for (int64_t oh = 0; oh < ho; oh++) {
            const float *src = mo + oh * wo, *in = xc + oh * sh * wp;
            if (wo < 8) {
                for (int64_t ow = 0; ow < wo; ow++)
#pragma GCC unroll 8
                    for (int kw = 0; kw < kw_n; kw++)
                        best[kw] = max1(best[kw], src[ow] + in[ow * SW + kw * dw]);
                continue;
            }
            int64_t ow = 0;
            if (kw_n <= 5) /* two blocks of 8 at a time: twice the independent chains */
                for (; ow + 16 <= wo; ow += 16) {
                    const __m256 mv = _mm256_loadu_ps(src + ow), mv2 = _mm256_loadu_ps(src + ow + 8);
#pragma GCC unroll 8
                    for (int kw = 0; kw < kw_n; kw++) {
                        acc[kw] = _mm256_max_ps(
                            acc[kw], _mm256_add_ps(mv, load_columns(in + ow * SW + kw * dw, SW)));
                        acc2[kw] = _mm256_max_ps(
                            acc2[kw],
                            _mm256_add_ps(mv2, load_columns(in + (ow + 8) * SW + kw * dw, SW)));
                    }
                }
            for (; ow < wo; ow += 8) {
                if (ow + 8 > wo) ow = wo - 8;
                const __m256 mv = _mm256_loadu_ps(src + ow);
#pragma GCC unroll 8
                for (int kw = 0; kw < kw_n; kw++)
                    acc[kw] = _mm256_max_ps(
                        acc[kw], _mm256_add_ps(mv, load_columns(in + ow * SW + kw * dw, SW)));
            }
        }
    }
#pragma GCC unroll 8
    for (int kw = 0; kw < kw_n; kw++)
        out[kh * kw_n + kw] = max1(best[kw], hmax8(_mm256_max_ps(acc[kw], acc2[kw])));
}

/* weight_row_taps for 1 to 8 taps per kernel row, each with its tap count a constant. */
static void weight_row(const float *m, const float *lx, float *out, int64_t batch,
                       int64_t channels, int64_t mult, int64_t o, int64_t kh, int64_t ho,
                       int64_t wo, int64_t hp, int64_t wp, int64_t kw_n, int64_t sh, int64_t dh,
                       int64_t dw, int64_t sw) {
#define SEMIPACK_ROW(n)                                                                        \
    case n:                                                                                    \
        if (sw == 2)                                                                           \
            weight_row_taps(m, lx, out, batch, channels, mult, o, kh, ho, wo, hp, wp, n, sh,  \
                            dh, dw, 2);                                                        \
        else                                                                                   \
            weight_row_taps(m, lx, out, batch, channels, mult, o, kh, ho, wo, hp, wp, n, sh,  \
                            dh, dw, 1);                                                        \
        return;
    switch (kw_n) {
        SEMIPACK_ROW(1)
        SEMIPACK_ROW(2)
        SEMIPACK_ROW(3)
        SEMIPACK_ROW(4)
        SEMIPACK_ROW(5)
        SEMIPACK_ROW(6)
        SEMIPACK_ROW(7)
        SEMIPACK_ROW(8)
    }
#undef SEMIPACK_ROW
}

/* Stride 1 and undilated rows, KH x KW taps in registers (KH * KW + R + 1 of the 16): R rows
   of the message at a time, so each load of a row of lx serves every (message row, kernel row)
   pair that reads it, up to min(R, KH) of them. The load of each tap's input was the limit
   (loads per candidate: (1 + KW) / (8 KW) row by row, (R + (R + KH - 1) KW) / (8 R KH KW) here),
   not the adds and maxima. Rows left over (ho not a multiple of R) run with R = 1. */
static inline __attribute__((always_inline)) void weight_taps_block(
    const float *mo, const float *xc, int64_t wo, int64_t wp, int64_t dw, const int R,
    const int KH, const int KW, __m256 *acc, float *best) {
    if (wo < 8) {
        for (int i = 0; i < R; i++)
            for (int64_t ow = 0; ow < wo; ow++)
                for (int kh = 0; kh < KH; kh++)
                    for (int kw = 0; kw < KW; kw++)
                        best[kh * KW + kw] = max1(best[kh * KW + kw],
                                                  mo[i * wo + ow] + xc[(i + kh) * wp + ow + kw * dw]);
        return;
    }
    for (int64_t ow = 0; ow < wo; ow += 8) {
        if (ow + 8 > wo) ow = wo - 8;
        __m256 mv[4];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) mv[i] = _mm256_loadu_ps(mo + i * wo + ow);
#pragma GCC unroll 8
        for (int q = 0; q < R + KH - 1; q++) {
#pragma GCC unroll 8
            for (int kw = 0; kw < KW; kw++) {
                const __m256 x = _mm256_loadu_ps(xc + q * wp + ow + kw * dw);
#pragma GCC unroll 4
                for (int i = 0; i < R; i++) {
                    const int kh = q - i;
                    if (kh >= 0 && kh < KH)
                        acc[kh * KW + kw] =
                            _mm256_max_ps(acc[kh * KW + kw], _mm256_add_ps(mv[i], x));
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void weight_all_taps(
    const float *m, const float *lx, float *out, int64_t batch, int64_t channels, int64_t mult,
    int64_t o, int64_t ho, int64_t wo, int64_t hp, int64_t wp, int64_t dw, const int KH,
    const int KW) {
    enum { R = 3 };
    const int64_t c = o / mult;
    __m256 acc[KH * KW];
    float best[KH * KW];
#pragma GCC unroll 16
    for (int t = 0; t < KH * KW; t++) {
        acc[t] = _mm256_set1_ps(-__builtin_inff());
        best[t] = -__builtin_inff();
    }
    for (int64_t b = 0; b < batch; b++) {
        const float *mo = m + (b * channels * mult + o) * ho * wo;
        const float *xc = lx + (b * channels + c) * hp * wp;
        int64_t oh = 0;
        for (; oh + R <= ho; oh += R)
            weight_taps_block(mo + oh * wo, xc + oh * wp, wo, wp, dw, R, KH, KW, acc, best);
        for (; oh < ho; oh++)
            weight_taps_block(mo + oh * wo, xc + oh * wp, wo, wp, dw, 1, KH, KW, acc, best);
    }
#pragma GCC unroll 16
    for (int t = 0; t < KH * KW; t++) out[t] = max1(best[t], hmax8(acc[t]));
}

void semipack_depthwise_weight_f32(const float *m, const float *lx, float *out, int64_t batch,
                                   int64_t channels, int64_t mult, int64_t ho, int64_t wo,
                                   int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n, int64_t sh,
                                   int64_t sw, int64_t dh, int64_t dw, int threads) {
    const int64_t taps = kh_n * kw_n;
    if (sw == 1 && sh == 1 && dh == 1 && kh_n == 3 && kw_n == 3) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o = 0; o < channels * mult; o++)
            weight_all_taps(m, lx, out + o * taps, batch, channels, mult, o, ho, wo, hp, wp, dw,
                            3, 3);
        return;
    }
    if ((sw == 1 || sw == 2) && kw_n <= 8) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < channels * mult * kh_n; t++) {
            const int64_t o = t / kh_n, kh = t % kh_n;
            weight_row(m, lx, out + o * taps, batch, channels, mult, o, kh, ho, wo, hp, wp, kw_n,
                       sh, dh, dw, sw);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < channels * mult * taps; t++) {
        const int64_t o = t / taps, kh = (t % taps) / kw_n, kw = t % kw_n, c = o / mult;
        __m256 best8 = _mm256_set1_ps(-__builtin_inff());
        float best = -__builtin_inff();
        for (int64_t b = 0; b < batch; b++) {
            const float *mo = m + (b * channels * mult + o) * ho * wo;
            const float *xc = lx + (b * channels + c) * hp * wp + kh * dh * wp + kw * dw;
            for (int64_t oh = 0; oh < ho; oh++) {
                const float *src = mo + oh * wo, *in = xc + oh * sh * wp;
                int64_t ow = 0;
                if (sw == 1) {
                    for (; ow + 8 <= wo; ow += 8) {
                        const __m256 cand =
                            _mm256_add_ps(_mm256_loadu_ps(src + ow), _mm256_loadu_ps(in + ow));
                        best8 = _mm256_max_ps(best8, cand);
                    }
                }
                for (; ow < wo; ow++) best = max1(best, src[ow] + in[ow * sw]);
            }
        }
        out[t] = max1(best, hmax8(best8));
    }
}

/* TopPath's input message at stride 1, vectorised: the maxima as in the MaxProd kernels, and
   beside each lane where the first candidate attaining it lies (a strictly larger candidate
   replaces, as the scalar loops below do), kept as a float (exact below 2^24, which the
   callers check). The successor id is read once per result from there, not carried through
   every comparison (decoding a candidate's number into its tap and plane per result took
   longer than the maxima). */

/* The 8 maxima `best` of a gather and their entries' successor ids: lane i's id loaded from
   `at_input[i + offset]`, the offset (`order`, a float) where its first best candidate lies; a
   lane without a path takes `no_successor` by a blend (branches on that, at random, cost more
   than the maxima; AVX2's gathers were slower than these loads). */
static inline __attribute__((always_inline)) void store_best_ids(
    __m256 best, __m256 order, float *dst, int64_t *dst_ids, const int64_t *at_input,
    int64_t no_successor) {
    _mm256_storeu_ps(dst, best);
    const __m256i k = _mm256_cvttps_epi32(order);
    const __m128i k0 = _mm256_castsi256_si128(k), k1 = _mm256_extracti128_si256(k, 1);
    const __m256i lo = _mm256_setr_epi64x(
        at_input[0 + _mm_extract_epi32(k0, 0)], at_input[1 + _mm_extract_epi32(k0, 1)],
        at_input[2 + _mm_extract_epi32(k0, 2)], at_input[3 + _mm_extract_epi32(k0, 3)]);
    const __m256i hi = _mm256_setr_epi64x(
        at_input[4 + _mm_extract_epi32(k1, 0)], at_input[5 + _mm_extract_epi32(k1, 1)],
        at_input[6 + _mm_extract_epi32(k1, 2)], at_input[7 + _mm_extract_epi32(k1, 3)]);
    const __m256i none =
        _mm256_castps_si256(_mm256_cmp_ps(best, _mm256_set1_ps(-__builtin_inff()), _CMP_EQ_OQ));
    const __m256i successor = _mm256_set1_epi64x(no_successor);
    _mm256_storeu_si256(
        (__m256i *)dst_ids,
        _mm256_blendv_epi8(lo, successor, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(none))));
    _mm256_storeu_si256(
        (__m256i *)(dst_ids + 4),
        _mm256_blendv_epi8(hi, successor, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(none, 1))));
}

/* Columns of `rows` input rows, `mult` message planes of one input channel (padded copies,
   `psize` floats apart), candidates in the scalar loop's order: taps (kh, kw), then the plane
   u. n vectors from the block's first column (`base`, `dst`, `dst_ids`, input column iw0 +
   `first_col`): vector j at column 8 j, the last at `last` (as in gather_block); each
   candidate's load at a constant offset from one pointer per tap and plane (the same barrier
   as there: GCC otherwise kept one 64-bit offset per candidate and spilled them). */
static inline __attribute__((always_inline)) void gather_ids_block(
    const float *base, int64_t psize, const float *lwc, float *dst, int64_t *dst_ids,
    const int64_t *ids_c, int64_t no_successor, int64_t rows, int64_t wp, const int n,
    int64_t row, const int64_t kh_n, const int64_t kw_n, const int64_t mult, int64_t dh,
    int64_t dw, int64_t ih0, int64_t iw0, int64_t first_col, int64_t last, int64_t ho,
    int64_t wo) {
    for (int64_t r = 0; r < rows; r++, base += row, dst += wp, dst_ids += wp) {
        const int64_t ih = ih0 + r;
        __m256 a[4], t[4];
#pragma GCC unroll 4
        for (int j = 0; j < n; j++) {
            const int64_t col = first_col + (j < n - 1 ? 8 * j : last);
            a[j] = _mm256_set1_ps(-__builtin_inff());
            /* a lane without a path reads ids_c[0], in bounds, and takes no successor */
            t[j] = _mm256_sub_ps(_mm256_set1_ps((float)-(ih * wo + iw0 + col)),
                                 _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
        }
#pragma GCC unroll 8
        for (int64_t kh = 0; kh < kh_n; kh++) {
#pragma GCC unroll 8
            for (int64_t kw = 0; kw < kw_n; kw++) {
                for (int64_t u = 0; u < mult; u++) {
                    const float *src = base - kh * dh * row - kw * dw + u * psize;
                    __asm__("" : "+r"(src));
                    const __m256 w = _mm256_set1_ps(lwc[(u * kh_n + kh) * kw_n + kw]);
                    /* where this candidate's id lies from the input's ih * wo + iw */
                    const __m256 at_order =
                        _mm256_set1_ps((float)(u * ho * wo - kh * dh * wo - kw * dw));
#pragma GCC unroll 4
                    for (int j = 0; j < n; j++) {
                        const __m256 c = _mm256_add_ps(
                            _mm256_loadu_ps(src + (j < n - 1 ? 8 * j : last)), w);
                        t[j] = _mm256_blendv_ps(t[j], at_order, _mm256_cmp_ps(c, a[j], _CMP_GT_OQ));
                        a[j] = _mm256_max_ps(a[j], c);
                    }
                }
            }
        }
        for (int j = 0; j < n; j++) {
            const int64_t off = j < n - 1 ? 8 * j : last;
            store_best_ids(a[j], t[j], dst + off, dst_ids + off,
                           ids_c + ih * wo + iw0 + first_col + off, no_successor);
        }
    }
}

/* TopPath's input message of one input channel at stride 1 (see input_plane_gather_k): `pad`
   holds mult padded planes with a -inf border; only inputs are gathered, the padding gets -inf
   and no successor. */
static inline __attribute__((always_inline)) void input_plane_gather_ids_k(
    const float *m_c, const int64_t *ids_c, const float *lwc, float *plane, int64_t *plane_ids,
    float *pad, int64_t no_successor, const int64_t mult, int64_t ho, int64_t wo, int64_t hp,
    int64_t wp, const int64_t kh_n, const int64_t kw_n, int64_t dh, int64_t dw, int64_t ch,
    int64_t cw) {
    const int64_t ph = (kh_n - 1) * dh, pw = (kw_n - 1) * dw, row = wo + 2 * pw;
    const int64_t psize = (ho + 2 * ph) * row, width = wp - 2 * cw;
    for (int64_t u = 0; u < mult; u++)
        for (int64_t oh = 0; oh < ho; oh++)
            memcpy(pad + u * psize + (oh + ph) * row + pw, m_c + (u * ho + oh) * wo,
                   sizeof(float) * (size_t)wo);
    /* the padding: no input, no message (its rows, then its columns, not a test and a branch
       at every entry of the plane) */
    for (int64_t i = 0; i < ch * wp; i++) {
        plane[i] = plane[(hp - ch) * wp + i] = -__builtin_inff();
        plane_ids[i] = plane_ids[(hp - ch) * wp + i] = no_successor;
    }
    for (int64_t ih = ch; ih < hp - ch; ih++)
        for (int64_t j = 0; j < cw; j++) {
            plane[ih * wp + j] = plane[ih * wp + wp - 1 - j] = -__builtin_inff();
            plane_ids[ih * wp + j] = plane_ids[ih * wp + wp - 1 - j] = no_successor;
        }
    const float *base = pad + (ch + ph) * row + pw + cw;
    float *dst = plane + ch * wp + cw;
    int64_t *dst_ids = plane_ids + ch * wp + cw;
    const int64_t rows = hp - 2 * ch;
    int64_t iw = 0;
#define SEMIPACK_IDS_BLOCK(n, last)                                                            \
    gather_ids_block(base + iw, psize, lwc, dst + iw, dst_ids + iw, ids_c, no_successor, rows, \
                     wp, n, row, kh_n, kw_n, mult, dh, dw, ch, cw, iw, last, ho, wo)
    for (; iw + 32 <= width; iw += 32) SEMIPACK_IDS_BLOCK(4, 24);
    if (iw == width) return;
    int64_t at[4];
    const int n = last_columns(iw, width, at);
    const int64_t last = at[n - 1] - iw;
    switch (n) {
    case 1: SEMIPACK_IDS_BLOCK(1, last); break;
    case 2: SEMIPACK_IDS_BLOCK(2, last); break;
    case 3: SEMIPACK_IDS_BLOCK(3, last); break;
    default: SEMIPACK_IDS_BLOCK(4, last);
    }
#undef SEMIPACK_IDS_BLOCK
}

/* input_plane_gather_ids_k with one plane per channel and a 3x3 or 5x5 kernel as constants
   (MobileNets' depthwise layers): unrolled taps, and fewer values live across them. */
static void input_plane_gather_ids(const float *m_c, const int64_t *ids_c, const float *lwc,
                                   float *plane, int64_t *plane_ids, float *pad,
                                   int64_t no_successor, int64_t mult, int64_t ho, int64_t wo,
                                   int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n, int64_t dh,
                                   int64_t dw, int64_t ch, int64_t cw) {
#define SEMIPACK_IDS_PLANE(u, kh, kw)                                                          \
    input_plane_gather_ids_k(m_c, ids_c, lwc, plane, plane_ids, pad, no_successor, u, ho, wo,  \
                             hp, wp, kh, kw, dh, dw, ch, cw)
    if (mult == 1 && kh_n == 3 && kw_n == 3)
        SEMIPACK_IDS_PLANE(1, 3, 3);
    else if (mult == 1 && kh_n == 5 && kw_n == 5)
        SEMIPACK_IDS_PLANE(1, 5, 5);
    else
        SEMIPACK_IDS_PLANE(mult, kh_n, kw_n);
#undef SEMIPACK_IDS_PLANE
}

/* TopPath's weight message of one kernel row of output channel o, unit column stride, kw_n <= 8
   taps a constant where inlined (weight_row_ids): as weight_row_taps, with each lane's first
   position attaining its maximum (position b * ho * wo + oh * wo + ow, the scalar loop's order);
   the lanes then give the largest value and, among equal ones, the smallest position. With a
   run-time tap count the accumulators and positions lived in memory, and every candidate's
   compare, blend and maximum waited on a store and a load: a third of the rate. */
static inline __attribute__((always_inline)) void weight_row_taps_ids(
    const float *m, const int64_t *ids, const float *lx, float *out, int64_t *out_ids,
    int64_t batch, int64_t channels, int64_t mult, int64_t o, int64_t kh, int64_t ho, int64_t wo,
    int64_t hp, int64_t wp, const int kw_n, int64_t sh, int64_t dh, int64_t dw, const int SW) {
    const int64_t c = o / mult;
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[8], pos[8];
    float best[8], best_at[8];
#pragma GCC unroll 8
    for (int kw = 0; kw < kw_n; kw++) {
        acc[kw] = _mm256_set1_ps(-__builtin_inff());
        pos[kw] = _mm256_setzero_ps();
        best[kw] = -__builtin_inff();
        best_at[kw] = 0.0f;
    }
    for (int64_t b = 0; b < batch; b++) {
        const float *mo = m + (b * channels * mult + o) * ho * wo;
        const float *xc = lx + (b * channels + c) * hp * wp + kh * dh * wp;
        for (int64_t oh = 0; oh < ho; oh++) {
            const float *src = mo + oh * wo, *in = xc + oh * sh * wp;
            const int64_t first = (b * ho + oh) * wo;
            if (wo < 8) {
                for (int64_t ow = 0; ow < wo; ow++)
#pragma GCC unroll 8
                    for (int kw = 0; kw < kw_n; kw++) {
                        const float v = src[ow] + in[ow * SW + kw * dw];
                        if (v > best[kw]) {
                            best[kw] = v;
                            best_at[kw] = (float)(first + ow);
                        }
                    }
                continue;
            }
            for (int64_t ow = 0; ow < wo; ow += 8) {
                if (ow + 8 > wo) ow = wo - 8;
                const __m256 mv = _mm256_loadu_ps(src + ow);
                const __m256 here = _mm256_add_ps(_mm256_set1_ps((float)(first + ow)), lanes);
#pragma GCC unroll 8
                for (int kw = 0; kw < kw_n; kw++) {
                    const __m256 v = _mm256_add_ps(mv, load_columns(in + ow * SW + kw * dw, SW));
                    pos[kw] =
                        _mm256_blendv_ps(pos[kw], here, _mm256_cmp_ps(v, acc[kw], _CMP_GT_OQ));
                    acc[kw] = _mm256_max_ps(acc[kw], v);
                }
            }
        }
    }
    const int64_t plane = ho * wo;
#pragma GCC unroll 8
    for (int kw = 0; kw < kw_n; kw++) {
        float v[8], p[8];
        _mm256_storeu_ps(v, acc[kw]);
        _mm256_storeu_ps(p, pos[kw]);
        float top = best[kw], at = best_at[kw];
        for (int lane = 0; lane < 8; lane++)
            if (v[lane] > top || (v[lane] == top && p[lane] < at)) {
                top = v[lane];
                at = p[lane];
            }
        const int64_t k = (int64_t)at, b = k / plane;
        out[kh * kw_n + kw] = top;
        out_ids[kh * kw_n + kw] = ids[(b * channels * mult + o) * plane + k % plane];
    }
}

/* weight_row_taps_ids for 1 to 8 taps per kernel row, each with its tap count a constant. */
static void weight_row_ids(const float *m, const int64_t *ids, const float *lx, float *out,
                           int64_t *out_ids, int64_t batch, int64_t channels, int64_t mult,
                           int64_t o, int64_t kh, int64_t ho, int64_t wo, int64_t hp, int64_t wp,
                           int64_t kw_n, int64_t sh, int64_t dh, int64_t dw, int64_t sw) {
#define SEMIPACK_ROW_IDS(n)                                                                    \
    case n:                                                                                    \
        if (sw == 2)                                                                           \
            weight_row_taps_ids(m, ids, lx, out, out_ids, batch, channels, mult, o, kh, ho,   \
                                wo, hp, wp, n, sh, dh, dw, 2);                                 \
        else                                                                                   \
            weight_row_taps_ids(m, ids, lx, out, out_ids, batch, channels, mult, o, kh, ho,   \
                                wo, hp, wp, n, sh, dh, dw, 1);                                 \
        return;
    switch (kw_n) {
        SEMIPACK_ROW_IDS(1)
        SEMIPACK_ROW_IDS(2)
        SEMIPACK_ROW_IDS(3)
        SEMIPACK_ROW_IDS(4)
        SEMIPACK_ROW_IDS(5)
        SEMIPACK_ROW_IDS(6)
        SEMIPACK_ROW_IDS(7)
        SEMIPACK_ROW_IDS(8)
    }
#undef SEMIPACK_ROW_IDS
}

/* Stride 2, dilation 1, one output channel per input channel: the input message gathered
   straight into the unpadded input's layout [B, C, H, W] (MobileNets' and EfficientNets'
   downsampling layers). Splitting the stride into its four phases (rules/depthwise.py) ran four
   stride-1 problems on sub-kernels of one to four taps, each over the whole message, then
   copied each phase's entries to their strided places: about a fifth of the stride-1 rate.
   Here padded input column iw reads tap kw at output column (iw - kw) / 2 where that is whole,
   so of 16 neighbouring inputs from column c, the 8 at c + 2j read taps kw of c's parity at
   output columns (c - kw) / 2 + j, and the 8 at c + 1 + 2j the other taps at (c + 1 - kw) / 2 + j:
   two vectors of neighbouring message entries each, interleaved once at the store. Rows
   likewise: input row ih reads the kernel rows kh of its parity, at output row (ih - kh) / 2.
   The message plane is copied into a buffer with a -inf border (no path) wide enough for every
   read; a row's last 16 columns end at its end (some again: a maximum over the same candidates
   gives them again). Same candidates in the same order (taps by (kh, kw)) as the per-tap path,
   so the same maxima and, for TopPath, the same first candidates. */

/* The 16 results of two vectors of 8, the first's at even offsets, the second's at odd. */
static inline void store_interleaved(float *dst, __m256 first, __m256 second) {
    const __m256 lo = _mm256_unpacklo_ps(first, second), hi = _mm256_unpackhi_ps(first, second);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* The message buffer of a stride-2 plane: rows above output row 0 and columns left of output
   column 0 (the border), and its size. Output row (ih - kh) / 2 spans -(KH - 1) / 2 to
   (hp - 1) / 2, column likewise with the 16 columns of a row's last block. */
typedef struct {
    int64_t top, left, rows, cols;
} stride_two_frame;

static stride_two_frame stride_two_frame_of(int64_t ho, int64_t wo, int64_t hp, int64_t wp,
                                            int64_t kh_n, int64_t kw_n) {
    stride_two_frame f;
    f.top = (kh_n + 1) / 2 + 1;
    f.left = (kw_n + 1) / 2 + 1;
    const int64_t bottom = (hp + 1) / 2 + 1, right = (wp + 17) / 2 + 1;
    f.rows = f.top + (bottom > ho ? bottom : ho) + 1;
    f.cols = f.left + (right > wo ? right : wo) + 1;
    return f;
}

/* The message plane mo [ho, wo] into its frame's interior (the border stays -inf). */
static inline void copy_into_frame(const float *mo, float *buf, stride_two_frame f, int64_t ho,
                                   int64_t wo) {
    for (int64_t oh = 0; oh < ho; oh++)
        memcpy(buf + (oh + f.top) * f.cols + f.left, mo + oh * wo, sizeof(float) * (size_t)wo);
}

/* One plane, MaxProd, KH x KW taps (constants where inlined); the input's h x w entries
   (w >= 16), padded coordinates (y + ch, x + cw). */
static inline __attribute__((always_inline)) void stride_two_input_plane(
    const float *mo, const float *lwo, float *out, float *buf, stride_two_frame f, int64_t ho,
    int64_t wo, int64_t h, int64_t w, int64_t ch, int64_t cw, const int64_t KH,
    const int64_t KW) {
    copy_into_frame(mo, buf, f, ho, wo);
    for (int64_t y = 0; y < h; y++) {
        const int64_t ih = y + ch;
        for (int64_t x0 = 0; x0 < w; x0 += 16) {
            if (x0 + 16 > w) x0 = w - 16;
            const int64_t c = x0 + cw; /* the first vector's padded columns: c + 2j */
            __m256 first = _mm256_set1_ps(-__builtin_inff()), second = first;
#pragma GCC unroll 8
            for (int64_t kh = 0; kh < KH; kh++) {
                if ((ih - kh) & 1) continue;
                const float *row = buf + ((ih - kh) / 2 + f.top) * f.cols + f.left;
#pragma GCC unroll 8
                for (int64_t kw = 0; kw < KW; kw++) {
                    const __m256 wv = _mm256_broadcast_ss(lwo + kh * KW + kw);
                    if (((c - kw) & 1) == 0)
                        first = _mm256_max_ps(
                            first, _mm256_add_ps(_mm256_loadu_ps(row + (c - kw) / 2), wv));
                    else
                        second = _mm256_max_ps(
                            second, _mm256_add_ps(_mm256_loadu_ps(row + (c + 1 - kw) / 2), wv));
                }
            }
            store_interleaved(out + y * w + x0, first, second);
        }
    }
}

/* As stride_two_input_plane for TopPath: beside each lane's maximum the message position
   oh * wo + ow of its first candidate, as a float (exact below 2^24, which the caller checks);
   its id is read from there, no_successor where no candidate has a path. */
static inline __attribute__((always_inline)) void stride_two_input_plane_ids(
    const float *mo, const int64_t *ids_o, const float *lwo, float *out, int64_t *out_ids,
    int64_t no_successor, float *buf, stride_two_frame f, int64_t ho, int64_t wo, int64_t h,
    int64_t w, int64_t ch, int64_t cw, const int64_t KH, const int64_t KW) {
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    copy_into_frame(mo, buf, f, ho, wo);
    for (int64_t y = 0; y < h; y++) {
        const int64_t ih = y + ch;
        float *dst = out + y * w;
        int64_t *dst_ids = out_ids + y * w;
        for (int64_t x0 = 0; x0 < w; x0 += 16) {
            if (x0 + 16 > w) x0 = w - 16;
            const int64_t c = x0 + cw;
            __m256 first = _mm256_set1_ps(-__builtin_inff()), second = first;
            __m256 first_at = _mm256_setzero_ps(), second_at = first_at;
#pragma GCC unroll 8
            for (int64_t kh = 0; kh < KH; kh++) {
                if ((ih - kh) & 1) continue;
                const int64_t oh = (ih - kh) / 2;
                const float *row = buf + (oh + f.top) * f.cols + f.left;
#pragma GCC unroll 8
                for (int64_t kw = 0; kw < KW; kw++) {
                    const __m256 wv = _mm256_broadcast_ss(lwo + kh * KW + kw);
                    const int even = ((c - kw) & 1) == 0;
                    const int64_t ow = even ? (c - kw) / 2 : (c + 1 - kw) / 2;
                    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(row + ow), wv);
                    const __m256 at = _mm256_add_ps(_mm256_set1_ps((float)(oh * wo + ow)), lanes);
                    if (even) {
                        first_at =
                            _mm256_blendv_ps(first_at, at, _mm256_cmp_ps(v, first, _CMP_GT_OQ));
                        first = _mm256_max_ps(first, v);
                    } else {
                        second_at =
                            _mm256_blendv_ps(second_at, at, _mm256_cmp_ps(v, second, _CMP_GT_OQ));
                        second = _mm256_max_ps(second, v);
                    }
                }
            }
            store_interleaved(dst + x0, first, second);
            float at[16];
            store_interleaved(at, first_at, second_at);
            for (int l = 0; l < 16; l++)
                dst_ids[x0 + l] =
                    dst[x0 + l] == -__builtin_inff() ? no_successor : ids_o[(int64_t)at[l]];
        }
    }
}

/* m [B, C, Ho, Wo], lw [C, KH, KW], dx [B, C, hp - 2 ch, wp - 2 cw] (the unpadded input), and
   with ids (TopPath; NULL for MaxProd) ids like m and dx_ids like dx. */
void semipack_depthwise_input_stride2_f32(const float *m, const int64_t *ids, const float *lw,
                                          float *dx, int64_t *dx_ids, int64_t no_successor,
                                          int64_t batch, int64_t channels, int64_t ho,
                                          int64_t wo, int64_t hp, int64_t wp, int64_t kh_n,
                                          int64_t kw_n, int64_t ch, int64_t cw, int threads) {
    const stride_two_frame f = stride_two_frame_of(ho, wo, hp, wp, kh_n, kw_n);
    const int64_t h = hp - 2 * ch, w = wp - 2 * cw, taps = kh_n * kw_n;
#pragma omp parallel num_threads(threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)(f.rows * f.cols));
        for (int64_t i = 0; i < f.rows * f.cols; i++) buf[i] = -__builtin_inff();
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < batch * channels; bc++) {
            const float *mo = m + bc * ho * wo, *lwo = lw + (bc % channels) * taps;
            float *out = dx + bc * h * w;
            if (ids) {
                const int64_t *ids_o = ids + bc * ho * wo;
                int64_t *out_ids = dx_ids + bc * h * w;
#define SEMIPACK_S2_IDS(KH, KW)                                                                \
    stride_two_input_plane_ids(mo, ids_o, lwo, out, out_ids, no_successor, buf, f, ho, wo, h, w, \
                               ch, cw, KH, KW)
                if (kh_n == 3 && kw_n == 3)
                    SEMIPACK_S2_IDS(3, 3);
                else if (kh_n == 5 && kw_n == 5)
                    SEMIPACK_S2_IDS(5, 5);
                else
                    SEMIPACK_S2_IDS(kh_n, kw_n);
#undef SEMIPACK_S2_IDS
            } else if (kh_n == 3 && kw_n == 3) {
                stride_two_input_plane(mo, lwo, out, buf, f, ho, wo, h, w, ch, cw, 3, 3);
            } else if (kh_n == 5 && kw_n == 5) {
                stride_two_input_plane(mo, lwo, out, buf, f, ho, wo, h, w, ch, cw, 5, 5);
            } else {
                stride_two_input_plane(mo, lwo, out, buf, f, ho, wo, h, w, ch, cw, kh_n, kw_n);
            }
        }
        free(buf);
    }
}

/* TopPath's messages: the same maxima and the successor id of the first candidate attaining
   each, in the per-tap path's order (taps in order, then the channel multiplier; a later
   candidate replaces only when strictly larger, as TopPath's plus does). ids [B, C*M, Ho, Wo]
   are the message's successor ids; dx_ids starts at no_successor. The weight message's id is
   the message's id at the first (b, oh, ow) attaining the max (position 0 when no pair has a
   path, as torch.max gives). Stride 1 (rows of at least 8 inputs) and unit column stride (at
   most 8 taps per kernel row) take the vector kernels above; the rest the scalar loops. */
static void input_plane_ids_scalar(const float *m, const int64_t *ids, const float *lw,
                                   float *plane, int64_t *plane_ids, int64_t no_successor,
                                   int64_t b, int64_t c, int64_t channels, int64_t mult,
                                   int64_t ho, int64_t wo, int64_t hp, int64_t wp, int64_t kh_n,
                                   int64_t kw_n, int64_t sh, int64_t sw, int64_t dh, int64_t dw) {
    for (int64_t i = 0; i < hp * wp; i++) {
        plane[i] = -__builtin_inff();
        plane_ids[i] = no_successor;
    }
    for (int64_t kh = 0; kh < kh_n; kh++) {
        for (int64_t kw = 0; kw < kw_n; kw++) {
            for (int64_t oh = 0; oh < ho; oh++) {
                for (int64_t ow = 0; ow < wo; ow++) {
                    const int64_t at = (oh * sh + kh * dh) * wp + ow * sw + kw * dw;
                    for (int64_t u = 0; u < mult; u++) {
                        const int64_t o = c * mult + u;
                        const int64_t from = ((b * channels * mult + o) * ho + oh) * wo + ow;
                        const float v = m[from] + lw[(o * kh_n + kh) * kw_n + kw];
                        if (v > plane[at]) {
                            plane[at] = v;
                            plane_ids[at] = ids[from];
                        }
                    }
                }
            }
        }
    }
}

void semipack_depthwise_input_ids_f32(const float *m, const int64_t *ids, const float *lw,
                                      float *dx, int64_t *dx_ids, int64_t no_successor,
                                      int64_t batch, int64_t channels, int64_t mult, int64_t ho,
                                      int64_t wo, int64_t hp, int64_t wp, int64_t kh_n,
                                      int64_t kw_n, int64_t sh, int64_t sw, int64_t dh,
                                      int64_t dw, int64_t ch, int64_t cw, int threads) {
    const int gather = sh == 1 && sw == 1 && hp == ho + (kh_n - 1) * dh &&
                       wp == wo + (kw_n - 1) * dw && 2 * ch < hp && wp - 2 * cw >= 8 &&
                       /* the lanes' id offsets (at most ih * wo + iw, or a candidate's
                          u * ho * wo - kh * dh * wo - kw * dw) exact as floats */
                       (mult * ho + hp + (kh_n - 1) * dh) * wo + 2 * wp < ((int64_t)1 << 23);
    const int64_t psize = (ho + 2 * (kh_n - 1) * dh) * (wo + 2 * (kw_n - 1) * dw);
#pragma omp parallel num_threads(threads)
    {
        float *pad = gather ? malloc(sizeof(float) * psize * mult) : 0;
        if (pad) /* the border: -inf (no path) for every plane this thread gathers */
            for (int64_t i = 0; i < psize * mult; i++) pad[i] = -__builtin_inff();
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < batch * channels; bc++) {
            const int64_t b = bc / channels, c = bc % channels;
            float *plane = dx + bc * hp * wp;
            int64_t *plane_ids = dx_ids + bc * hp * wp;
            if (pad) {
                const int64_t first = (b * channels + c) * mult * ho * wo;
                input_plane_gather_ids(m + first, ids + first, lw + c * mult * kh_n * kw_n,
                                       plane, plane_ids, pad, no_successor, mult, ho, wo, hp,
                                       wp, kh_n, kw_n, dh, dw, ch, cw);
            } else {
                input_plane_ids_scalar(m, ids, lw, plane, plane_ids, no_successor, b, c,
                                       channels, mult, ho, wo, hp, wp, kh_n, kw_n, sh, sw, dh,
                                       dw);
            }
        }
        free(pad);
    }
}

void semipack_depthwise_weight_ids_f32(const float *m, const int64_t *ids, const float *lx,
                                       float *out, int64_t *out_ids, int64_t batch,
                                       int64_t channels, int64_t mult, int64_t ho, int64_t wo,
                                       int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n,
                                       int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                                       int threads) {
    const int64_t taps = kh_n * kw_n;
    if ((sw == 1 || sw == 2) && kw_n <= 8 && batch * ho * wo < ((int64_t)1 << 24)) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < channels * mult * kh_n; t++) {
            const int64_t o = t / kh_n, kh = t % kh_n;
            weight_row_ids(m, ids, lx, out + o * taps, out_ids + o * taps, batch, channels, mult,
                           o, kh, ho, wo, hp, wp, kw_n, sh, dh, dw, sw);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < channels * mult * taps; t++) {
        const int64_t o = t / taps, kh = (t % taps) / kw_n, kw = t % kw_n, c = o / mult;
        float best = -__builtin_inff();
        int64_t best_id = ids[o * ho * wo]; /* b = 0, position 0 */
        for (int64_t b = 0; b < batch; b++) {
            const int64_t base = (b * channels * mult + o) * ho * wo;
            const float *xc = lx + (b * channels + c) * hp * wp + kh * dh * wp + kw * dw;
            for (int64_t oh = 0; oh < ho; oh++) {
                for (int64_t ow = 0; ow < wo; ow++) {
                    const float v = m[base + oh * wo + ow] + xc[oh * sh * wp + ow * sw];
                    if (v > best) {
                        best = v;
                        best_id = ids[base + oh * wo + ow];
                    }
                }
            }
        }
        out[t] = best;
        out_ids[t] = best_id;
    }
}
