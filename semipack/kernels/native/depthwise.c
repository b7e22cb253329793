/* MaxProd messages of a 2-D depthwise convolution (each output channel reads one input
   channel), called through ctypes (see __init__.py and rules/convolution.py).

   Why a kernel: the per-tap path builds, for every tap, the sum of a message and a lifted
   weight or input as a tensor the size of the output and reduces it again; MobileNet's
   depthwise layers then cost 8-15 ns per multiply-add against 0.3 for a dense convolution.
   Here the work stays in registers: at stride 1 each block of 8 input entries gathers every
   tap's candidates (one store), and a kernel row's taps share the message's loads for the
   weight message; other strides sweep each plane once per tap.

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

/* Columns at[0..n) (8 each) of one input row of the gather below: every tap's candidates in
   n independent chains of maxima, one store each. n is a constant where this is inlined. */
static inline __attribute__((always_inline)) void gather_columns(
    const float *base, const float *lwo, float *dst, const int64_t *at, const int n, int first,
    int64_t row, int64_t kh_n, int64_t kw_n, int64_t dh, int64_t dw) {
    __m256 a[4];
#pragma GCC unroll 4
    for (int j = 0; j < n; j++)
        a[j] = first ? _mm256_set1_ps(-__builtin_inff()) : _mm256_loadu_ps(dst + at[j]);
    for (int64_t kh = 0; kh < kh_n; kh++) {
        const float *src = base - kh * dh * row;
        for (int64_t kw = 0; kw < kw_n; kw++) {
            const __m256 w = _mm256_set1_ps(lwo[kh * kw_n + kw]);
#pragma GCC unroll 4
            for (int j = 0; j < n; j++)
                a[j] = _mm256_max_ps(a[j], _mm256_add_ps(_mm256_loadu_ps(src - kw * dw + at[j]), w));
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < n; j++) _mm256_storeu_ps(dst + at[j], a[j]);
}

/* Stride 1: each input position gathers its candidates instead. With the output plane padded
   by -inf (no path) on every side, input (ih, iw) reads tap (kh, kw) at padded output
   (ih - kh*DH + PH, iw - kw*DW + PW), in range for every input position: a block of 8 inputs
   costs a load, an add and a max per tap in registers and one store, where the scatter loop
   loads and stores the destination for every tap. Same candidates, so the same maxima. `pad`
   is the caller's per-thread buffer, filled with -inf once: only its interior is written here,
   so its border stays -inf for every plane (filling the whole buffer per plane cost as much as
   the plane's maxima for a 5x5 kernel). */
static void input_plane_gather(const float *mo, const float *lwo, float *plane, float *pad,
                               int first, int64_t ho, int64_t wo, int64_t hp, int64_t wp,
                               int64_t kh_n, int64_t kw_n, int64_t dh, int64_t dw) {
    const int64_t ph = (kh_n - 1) * dh, pw = (kw_n - 1) * dw, row = wo + 2 * pw;
    for (int64_t oh = 0; oh < ho; oh++)
        memcpy(pad + (oh + ph) * row + pw, mo + oh * wo, sizeof(float) * (size_t)wo);
    for (int64_t ih = 0; ih < hp; ih++) {
        const float *base = pad + (ih + ph) * row + pw; /* tap (0, 0) of column iw: base + iw */
        float *dst = plane + ih * wp;
        int64_t iw = 0;
        for (; iw + 32 <= wp; iw += 32) {
            const int64_t at[4] = {iw, iw + 8, iw + 16, iw + 24};
            gather_columns(base, lwo, dst, at, 4, first, row, kh_n, kw_n, dh, dw);
        }
        if (iw == wp) continue;
        if (wp < 8) {
            for (; iw < wp; iw++) {
                float best = first ? -__builtin_inff() : dst[iw];
                for (int64_t kh = 0; kh < kh_n; kh++)
                    for (int64_t kw = 0; kw < kw_n; kw++)
                        best = max1(best, base[iw - kh * dh * row - kw * dw] + lwo[kh * kw_n + kw]);
                dst[iw] = best;
            }
            continue;
        }
        /* the last columns: up to four more vectors, the last ending at the row's end (it
           recomputes some columns; a max over the same candidates gives them again), as
           independent chains too (one chain of 8 columns waited on each maximum's latency) */
        const int64_t at[4] = {iw < wp - 8 ? iw : wp - 8, iw + 8 < wp - 8 ? iw + 8 : wp - 8,
                               iw + 16 < wp - 8 ? iw + 16 : wp - 8, wp - 8};
        switch ((wp - iw + 7) / 8) {
        case 1: gather_columns(base, lwo, dst, at, 1, first, row, kh_n, kw_n, dh, dw); break;
        case 2: gather_columns(base, lwo, dst, at, 2, first, row, kh_n, kw_n, dh, dw); break;
        case 3: gather_columns(base, lwo, dst, at, 3, first, row, kh_n, kw_n, dh, dw); break;
        default: gather_columns(base, lwo, dst, at, 4, first, row, kh_n, kw_n, dh, dw);
        }
    }
}

void semipack_depthwise_input_f32(const float *m, const float *lw, float *dx, int64_t batch,
                                  int64_t channels, int64_t mult, int64_t ho, int64_t wo,
                                  int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n, int64_t sh,
                                  int64_t sw, int64_t dh, int64_t dw, int threads) {
    /* the gather needs stride 1 and a padded input no larger than the outputs read */
    const int gather = sh == 1 && sw == 1 && hp == ho + (kh_n - 1) * dh &&
                       wp == wo + (kw_n - 1) * dw;
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
                                       kh_n, kw_n, dh, dw);
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

/* Unit column stride, up to 8 taps per kernel row: the taps of one kernel row share the message's
   loads (one load of m per 8 outputs feeds every tap's maximum), and a row's last columns are
   one more vector ending at the row's end (a maximum counts a candidate twice harmlessly).
   Inlined with kw_n a constant (weight_row): with a run-time tap count the compiler kept the
   accumulators in memory, and each maximum waited on a store and a load (half the dense
   product's rate). */
static inline __attribute__((always_inline)) void weight_row_taps(
    const float *m, const float *lx, float *out, int64_t batch, int64_t channels, int64_t mult,
    int64_t o, int64_t kh, int64_t ho, int64_t wo, int64_t hp, int64_t wp, const int kw_n,
    int64_t sh, int64_t dh, int64_t dw) {
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
                        best[kw] = max1(best[kw], src[ow] + in[ow + kw * dw]);
                continue;
            }
            int64_t ow = 0;
            if (kw_n <= 5) /* two blocks of 8 at a time: twice the independent chains */
                for (; ow + 16 <= wo; ow += 16) {
                    const __m256 mv = _mm256_loadu_ps(src + ow), mv2 = _mm256_loadu_ps(src + ow + 8);
#pragma GCC unroll 8
                    for (int kw = 0; kw < kw_n; kw++) {
                        acc[kw] = _mm256_max_ps(
                            acc[kw], _mm256_add_ps(mv, _mm256_loadu_ps(in + ow + kw * dw)));
                        acc2[kw] = _mm256_max_ps(
                            acc2[kw], _mm256_add_ps(mv2, _mm256_loadu_ps(in + ow + 8 + kw * dw)));
                    }
                }
            for (; ow < wo; ow += 8) {
                if (ow + 8 > wo) ow = wo - 8;
                const __m256 mv = _mm256_loadu_ps(src + ow);
#pragma GCC unroll 8
                for (int kw = 0; kw < kw_n; kw++)
                    acc[kw] = _mm256_max_ps(
                        acc[kw], _mm256_add_ps(mv, _mm256_loadu_ps(in + ow + kw * dw)));
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
                       int64_t dw) {
#define SEMIPACK_ROW(n)                                                                        \
    case n:                                                                                    \
        weight_row_taps(m, lx, out, batch, channels, mult, o, kh, ho, wo, hp, wp, n, sh, dh,  \
                        dw);                                                                   \
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

void semipack_depthwise_weight_f32(const float *m, const float *lx, float *out, int64_t batch,
                                   int64_t channels, int64_t mult, int64_t ho, int64_t wo,
                                   int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n, int64_t sh,
                                   int64_t sw, int64_t dh, int64_t dw, int threads) {
    const int64_t taps = kh_n * kw_n;
    if (sw == 1 && kw_n <= 8) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < channels * mult * kh_n; t++) {
            const int64_t o = t / kh_n, kh = t % kh_n;
            weight_row(m, lx, out + o * taps, batch, channels, mult, o, kh, ho, wo, hp, wp, kw_n,
                       sh, dh, dw);
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

/* TopPath's messages: the same maxima and the successor id of the first candidate attaining
   each, in the per-tap path's order (taps in order, then the channel multiplier; a later
   candidate replaces only when strictly larger, as TopPath's plus does). ids [B, C*M, Ho, Wo]
   are the message's successor ids; dx_ids starts at no_successor. The weight message's id is
   the message's id at the first (b, oh, ow) attaining the max (position 0 when no pair has a
   path, as torch.max gives). Scalar loops: these are rarer than MaxProd's. */
void semipack_depthwise_input_ids_f32(const float *m, const int64_t *ids, const float *lw,
                                      float *dx, int64_t *dx_ids, int64_t no_successor,
                                      int64_t batch, int64_t channels, int64_t mult, int64_t ho,
                                      int64_t wo, int64_t hp, int64_t wp, int64_t kh_n,
                                      int64_t kw_n, int64_t sh, int64_t sw, int64_t dh,
                                      int64_t dw, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bc = 0; bc < batch * channels; bc++) {
        const int64_t b = bc / channels, c = bc % channels;
        float *plane = dx + bc * hp * wp;
        int64_t *plane_ids = dx_ids + bc * hp * wp;
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
}

void semipack_depthwise_weight_ids_f32(const float *m, const int64_t *ids, const float *lx,
                                       float *out, int64_t *out_ids, int64_t batch,
                                       int64_t channels, int64_t mult, int64_t ho, int64_t wo,
                                       int64_t hp, int64_t wp, int64_t kh_n, int64_t kw_n,
                                       int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                                       int threads) {
    const int64_t taps = kh_n * kw_n;
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
