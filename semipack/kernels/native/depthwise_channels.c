/* MaxProd and TopPath messages of a 2-D depthwise convolution with the channels in the vector
   lanes, for small planes (called through ctypes, see __init__.py and rules/depthwise.py).

   Why: the plane kernels of depthwise.c put 8 neighbouring columns of one channel in a vector.
   A 7 x 7 plane (MobileNetV3's last blocks, 576 channels) has rows shorter than a vector, and
   those kernels fell back to scalar loops: 2 G pairs/s for MaxProd, 0.3 for TopPath, against
   25 for the dense tap product. Here a vector holds 8 channels of one position, any plane size
   and any stride or dilation: each result's valid taps are worked out once per position and
   serve every channel.

   Shapes (row-major, contiguous, channels last, one output channel per input channel):
   m [B, Ho, Wo, C] log-messages of the output; ids the same shape (TopPath's successor ids) or
   NULL (MaxProd); lw [KH, KW, C] log|w|; lx [B, Hp, Wp, C] log|x| of the zero-padded input
   (-inf on the padding). Output position (oh, ow) of tap (kh, kw) reads padded input
   (oh*SH + kh*DH, ow*SW + kw*DW). C is a multiple of 8.

     input message   dx[b, i, j, c] = max over taps and the outputs reading padded input
                                      (i + PH, j + PW) of m[b, oh, ow, c] + lw[kh, kw, c]
     weight message  dw[kh, kw, c]  = max over b, oh, ow of
                                      m[b, oh, ow, c] + lx[b, oh*SH + kh*DH, ow*SW + kw*DW, c]

   dx covers the unpadded input [B, H, W, C]. TopPath's ids are the per-tap path's: the input
   message's candidates come in the order of the taps (kh, kw), the weight message's in the
   order of (b, oh, ow), and a later candidate replaces only when strictly larger; an input
   entry without a path gets no_successor, a weight entry without one the id at position 0.
   The caller guarantees no NaN and no +inf among the operands (a max does not propagate NaN),
   at most 64 taps, and B * Ho * Wo < 2^24 (positions kept as floats). */

#include <stdint.h>

#include "vector_math.h"

enum { MAX_TAPS = 64 };

/* Input message of one position: the n valid taps' message offsets `from` and weight offsets
   `tap` (in tap order), 8 * V channels from channel c. */
static inline __attribute__((always_inline)) void input_channels(
    const float *m, const int64_t *ids, const float *lw, float *dx, int64_t *dx_ids,
    int64_t no_successor, const int64_t *from, const int64_t *tap, int n, int64_t c,
    const int V) {
    __m256 best[2], which[2];
    for (int v = 0; v < V; v++) {
        best[v] = _mm256_set1_ps(-__builtin_inff());
        which[v] = _mm256_set1_ps(-1.0f);
    }
    for (int k = 0; k < n; k++) {
        const __m256 at = _mm256_set1_ps((float)k);
        for (int v = 0; v < V; v++) {
            const __m256 cand = _mm256_add_ps(_mm256_loadu_ps(m + from[k] + c + 8 * v),
                                              _mm256_loadu_ps(lw + tap[k] + c + 8 * v));
            if (ids) { /* strictly larger replaces: the first candidate keeps a tie */
                const __m256 larger = _mm256_cmp_ps(cand, best[v], _CMP_GT_OQ);
                which[v] = _mm256_blendv_ps(which[v], at, larger);
            }
            best[v] = _mm256_max_ps(best[v], cand);
        }
    }
    for (int v = 0; v < V; v++) {
        _mm256_storeu_ps(dx + c + 8 * v, best[v]);
        if (!ids) continue;
        float k[8];
        _mm256_storeu_ps(k, which[v]);
        for (int l = 0; l < 8; l++)
            dx_ids[c + 8 * v + l] = k[l] < 0 ? no_successor : ids[from[(int)k[l]] + c + 8 * v + l];
    }
}

void semipack_depthwise_channels_input_f32(
    const float *m, const int64_t *ids, const float *lw, float *dx, int64_t *dx_ids,
    int64_t no_successor, int64_t batch, int64_t channels, int64_t ho, int64_t wo, int64_t h,
    int64_t w, int64_t kh_n, int64_t kw_n, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
    int64_t ph, int64_t pw, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bij = 0; bij < batch * h * w; bij++) {
        const int64_t b = bij / (h * w), i = bij / w % h, j = bij % w;
        int64_t from[MAX_TAPS], tap[MAX_TAPS];
        int n = 0;
        for (int64_t kh = 0; kh < kh_n; kh++) {
            const int64_t rows = i + ph - kh * dh; /* oh * sh */
            if (rows < 0 || rows % sh || rows / sh >= ho) continue;
            for (int64_t kw = 0; kw < kw_n; kw++) {
                const int64_t cols = j + pw - kw * dw;
                if (cols < 0 || cols % sw || cols / sw >= wo) continue;
                from[n] = ((b * ho + rows / sh) * wo + cols / sw) * channels;
                tap[n++] = (kh * kw_n + kw) * channels;
            }
        }
        float *out = dx + bij * channels;
        int64_t *out_ids = ids ? dx_ids + bij * channels : 0;
        int64_t c = 0;
        for (; c + 16 <= channels; c += 16)
            input_channels(m, ids, lw, out, out_ids, no_successor, from, tap, n, c, 2);
        for (; c < channels; c += 8)
            input_channels(m, ids, lw, out, out_ids, no_successor, from, tap, n, c, 1);
    }
}

/* Weight message of kernel row kh, 8 * V channels from channel c: KW accumulators per vector
   (KW a constant where inlined, at most 8). */
static inline __attribute__((always_inline)) void weight_channels(
    const float *m, const int64_t *ids, const float *lx, float *out, int64_t *out_ids,
    int64_t batch, int64_t channels, int64_t ho, int64_t wo, int64_t hp, int64_t wp, int64_t kh,
    const int KW, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t c, const int V) {
    __m256 best[2][8], where[2][8];
    for (int v = 0; v < V; v++)
        for (int kw = 0; kw < KW; kw++) {
            best[v][kw] = _mm256_set1_ps(-__builtin_inff());
            where[v][kw] = _mm256_setzero_ps(); /* position 0 when no pair has a path */
        }
    for (int64_t b = 0; b < batch; b++)
        for (int64_t oh = 0; oh < ho; oh++) {
            const float *row = lx + ((b * hp + oh * sh + kh * dh) * wp) * channels + c;
            for (int64_t ow = 0; ow < wo; ow++) {
                const int64_t p = (b * ho + oh) * wo + ow;
                const __m256 at = _mm256_set1_ps((float)p);
                for (int v = 0; v < V; v++) {
                    const __m256 mv = _mm256_loadu_ps(m + p * channels + c + 8 * v);
                    for (int kw = 0; kw < KW; kw++) {
                        const __m256 cand = _mm256_add_ps(
                            mv, _mm256_loadu_ps(row + (ow * sw + kw * dw) * channels + 8 * v));
                        if (ids) {
                            const __m256 larger = _mm256_cmp_ps(cand, best[v][kw], _CMP_GT_OQ);
                            where[v][kw] = _mm256_blendv_ps(where[v][kw], at, larger);
                        }
                        best[v][kw] = _mm256_max_ps(best[v][kw], cand);
                    }
                }
            }
        }
    for (int v = 0; v < V; v++)
        for (int kw = 0; kw < KW; kw++) {
            const int64_t to = (kh * KW + kw) * channels + c + 8 * v;
            _mm256_storeu_ps(out + to, best[v][kw]);
            if (!ids) continue;
            float p[8];
            _mm256_storeu_ps(p, where[v][kw]);
            for (int l = 0; l < 8; l++) out_ids[to + l] = ids[(int64_t)p[l] * channels + c + 8 * v + l];
        }
}

static void weight_row_channels(const float *m, const int64_t *ids, const float *lx, float *out,
                                int64_t *out_ids, int64_t batch, int64_t channels, int64_t ho,
                                int64_t wo, int64_t hp, int64_t wp, int64_t kh, int64_t kw_n,
                                int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t c, int V) {
#define SEMIPACK_CHANNELS(n)                                                                   \
    case n:                                                                                    \
        if (V == 2)                                                                            \
            weight_channels(m, ids, lx, out, out_ids, batch, channels, ho, wo, hp, wp, kh, n,  \
                            sh, sw, dh, dw, c, 2);                                             \
        else                                                                                   \
            weight_channels(m, ids, lx, out, out_ids, batch, channels, ho, wo, hp, wp, kh, n,  \
                            sh, sw, dh, dw, c, 1);                                             \
        return;
    switch (kw_n) {
        SEMIPACK_CHANNELS(1)
        SEMIPACK_CHANNELS(2)
        SEMIPACK_CHANNELS(3)
        SEMIPACK_CHANNELS(4)
        SEMIPACK_CHANNELS(5)
        SEMIPACK_CHANNELS(6)
        SEMIPACK_CHANNELS(7)
        SEMIPACK_CHANNELS(8)
    }
#undef SEMIPACK_CHANNELS
}

/* out [KH, KW, C]; kw_n at most 8 (the caller checks). Two vectors of channels at a time
   where their accumulators fit the 16 registers (MaxProd, up to 6 taps per kernel row). */
void semipack_depthwise_channels_weight_f32(const float *m, const int64_t *ids, const float *lx,
                                            float *out, int64_t *out_ids, int64_t batch,
                                            int64_t channels, int64_t ho, int64_t wo, int64_t hp,
                                            int64_t wp, int64_t kh_n, int64_t kw_n, int64_t sh,
                                            int64_t sw, int64_t dh, int64_t dw, int threads) {
    const int64_t width = !ids && kw_n <= 6 ? 16 : 8;
    const int64_t blocks = (channels + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < kh_n * blocks; t++) {
        const int64_t kh = t / blocks, c = t % blocks * width;
        weight_row_channels(m, ids, lx, out, out_ids, batch, channels, ho, wo, hp, wp, kh, kw_n,
                            sh, sw, dh, dw, c, c + 16 <= channels && width == 16 ? 2 : 1);
    }
}
