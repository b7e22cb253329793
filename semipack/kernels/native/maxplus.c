/* Max-plus matrix products for x86-64 with AVX2 or AVX-512, called through ctypes (see
   __init__.py); the vector width comes from vec16.h.

   out[s, i, j] = max_k a[s, i, k] + b[s, k, j]

   Why hand-written: the product is an add and a max per pair, so it is bound by the two
   vector ports that run them. A register tile of ROWS x 16 outputs reuses each loaded 16-wide
   row of b for ROWS rows of a and each broadcast a[i, k] for 16 columns, which keeps the loop
   on those ports (AVX2: about 7.5 of the 8 pairs per cycle per core the ports allow, vs about
   4.5 for the inductor-generated loop; AVX-512 doubles the lanes per operation).

   Layout: b comes packed as panels of 16 columns, [s][panel][k][16], padded with -inf, so the
   inner loop reads 64 contiguous bytes per k. a is read through strides, so a transposed
   operand needs no copy. One panel (16 columns x k) stays in L2 while the row tiles stream past it.

   Semantics: every pair sum is one float addition and the max is exact, so the result is the
   same bit pattern as any other order of evaluation. The caller guarantees that no input is NaN
   or +inf (vmaxps does not propagate NaN the way torch.amax does); -inf means "no edge". The
   argmax variant keeps the first k attaining the max (strictly greater replaces) and 0 where
   every pair sum is -inf, as torch.max does. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define ROWS V16_ROWS
#define ARGMAX_ROWS V16_ARGMAX_ROWS

typedef struct {
    const float *a;
    int64_t a_s, a_i, a_k; /* strides of a, in elements */
    const float *panels;   /* [s][panel][k][16] */
    float *out;
    int64_t *index;        /* NULL, or like out */
    int64_t o_s, o_i;      /* strides of out and index; unit stride along j */
    int64_t n, k, m;
} problem;

/* Copies the first `rows` rows x `cols` columns of a register tile spilled to `tile`. The
   accumulators are written to `tile` with constant indices only, so that the compiler keeps them
   in registers inside the k loop. */
static inline void copy_out(float *dst, int64_t ld, const float *tile, int rows, int cols) {
    for (int r = 0; r < rows; r++) memcpy(dst + r * ld, tile + r * 16, sizeof(float) * (size_t)cols);
}

/* One tile: rows [i, i + rows) x the 16 columns of one panel, over all of k. Row k of the
   panel is row k, or row rows_of_b[k] when a table is given (see semipack_maxplus_gather_f32);
   inlined into both callers, so the plain one has no table test in its loop. */
static inline __attribute__((always_inline)) void tile_loop(const problem *p, const float *a,
                                                            const float *panel,
                                                            const int64_t *rows_of_b, float *out,
                                                            int rows, int cols) {
    const float *ar[ROWS];
    v16 acc[ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; r++) {
        ar[r] = a + (r < rows ? r : 0) * p->a_i;
        acc[r] = v16_set1(-INFINITY);
    }
    const int64_t step = p->a_k;
    int64_t at = 0;
    for (int64_t k = 0; k < p->k; k++, at += step) {
        const v16 b = v16_load(panel + (rows_of_b ? rows_of_b[k] : k) * 16);
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) acc[r] = v16_max(acc[r], v16_add(v16_bcast(ar[r] + at), b));
    }
    float tile[ROWS * 16];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; r++) v16_store(tile + r * 16, acc[r]);
    copy_out(out, p->o_i, tile, rows, cols);
}

static void tile_values(const problem *p, const float *a, const float *panel, float *out,
                        int rows, int cols) {
    tile_loop(p, a, panel, NULL, out, rows, cols);
}

/* Values and first argmax over ARGMAX_ROWS rows (four accumulators per row fill the registers);
   k is carried as a float, exact below 2^24 (checked by the caller). Row k of the panel as in
   tile_loop (optionally through a row table); index gets k, with out's row stride. */
static inline __attribute__((always_inline)) void tile_argmax_loop(
    const problem *p, const float *a, const float *panel, const int64_t *rows_of_b, float *out,
    int64_t *index, int rows, int cols) {
    const float *ar[ARGMAX_ROWS];
    v16 acc[ARGMAX_ROWS], arg[ARGMAX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < ARGMAX_ROWS; r++) {
        ar[r] = a + (r < rows ? r : 0) * p->a_i;
        acc[r] = v16_set1(-INFINITY);
        arg[r] = v16_set1(0.0f);
    }
    const int64_t step = p->a_k;
    int64_t at = 0;
    v16 kk = v16_set1(0.0f);
    const v16 one = v16_set1(1.0f);
    for (int64_t k = 0; k < p->k; k++, at += step, kk = v16_add(kk, one)) {
        const v16 b = v16_load(panel + (rows_of_b ? rows_of_b[k] : k) * 16);
#pragma GCC unroll 16
        for (int r = 0; r < ARGMAX_ROWS; r++) {
            const v16 s = v16_add(v16_bcast(ar[r] + at), b);
            arg[r] = v16_take_greater(arg[r], kk, s, acc[r]);
            acc[r] = v16_max(acc[r], s);
        }
    }
    float tile[ARGMAX_ROWS * 16], where[ARGMAX_ROWS * 16];
#pragma GCC unroll 16
    for (int r = 0; r < ARGMAX_ROWS; r++) {
        v16_store(tile + r * 16, acc[r]);
        v16_store(where + r * 16, arg[r]);
    }
    copy_out(out, p->o_i, tile, rows, cols);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) index[r * p->o_i + c] = (int64_t)where[r * 16 + c];
}

static void tile_argmax(const problem *p, const float *a, const float *panel, float *out,
                        int64_t *index, int rows, int cols) {
    tile_argmax_loop(p, a, panel, NULL, out, index, rows, cols);
}

/* Rows of a are split into blocks of at most BLOCK_ROWS (a multiple of both tile heights) so
   that products with few panels still give every thread work. The blocks are as equal as that
   multiple allows: under the static schedule a last block of a few rows (98 rows as 96 + 2, a
   ResNet layer4 tap) left one of two threads almost idle. */
#define BLOCK_ROWS 96

static int64_t block_rows(int64_t n) {
    const int64_t blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t even = blocks > 0 ? (n + blocks - 1) / blocks : BLOCK_ROWS;
    return (even + ROWS - 1) / ROWS * ROWS;
}

void semipack_maxplus_f32(const float *a, int64_t a_s, int64_t a_i, int64_t a_k,
                          const float *panels, float *out, int64_t *index, int64_t o_s,
                          int64_t o_i, int64_t batch, int64_t n, int64_t k, int64_t m,
                          int threads) {
    const problem p = {a, a_s, a_i, a_k, panels, out, index, o_s, o_i, n, k, m};
    const int64_t panels_n = (m + 15) / 16, height = block_rows(n);
    const int64_t blocks = (n + height - 1) / height;
    const int tile_rows = index ? ARGMAX_ROWS : ROWS;
    /* Task t = (matrix s, row block, panel), panels innermost: a thread's consecutive tasks
       share the row block of a. */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < batch * blocks * panels_n; t++) {
        const int64_t q = t % panels_n, block = t / panels_n % blocks, s = t / panels_n / blocks;
        const int64_t j = q * 16, i1 = (block + 1) * height < n ? (block + 1) * height : n;
        const int cols = m - j < 16 ? (int)(m - j) : 16;
        const float *panel = panels + (s * panels_n + q) * k * 16;
        for (int64_t i = block * height; i < i1; i += tile_rows) {
            const int rows = i1 - i < tile_rows ? (int)(i1 - i) : tile_rows;
            const float *arow = a + s * a_s + i * a_i;
            float *dst = out + s * o_s + i * o_i + j;
            if (index) {
                tile_argmax(&p, arow, panel, dst, index + s * o_s + i * o_i + j, rows, cols);
            } else {
                tile_values(&p, arow, panel, dst, rows, cols);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
   Pruned max-plus: the same values, computed from the pairs that can still be the max.

   For row i, ub[k] = a[i, k] + max_j b[k, j] bounds every pair a[i, k] + b[k, j] of that k from
   above (float addition is monotonic, so the bound holds after rounding too). Phase 1 takes about
   TOP ks with the largest bounds and computes, over them, lower bounds L[i, j] <= out[i, j];
   theta[i] = min_j L[i, j]. Phase 2 keeps the ks with ub[k] >= theta[i]: any other k has every
   pair < theta[i] <= out[i, j], so it can be neither the max nor tie with it. The kept ks, in
   increasing order, give the exact max and its first argmax. Without the argmax, phase 1 writes
   its maxima into out and phase 2 sweeps only the kept ks phase 1 did not, onto them: a max
   over any set of ks that holds the kept ones is the max (on a BERT-base layer's pruned
   products, one Zen 3 core, four interleaved runs, the fastest of 11 calls summed 111-128 ms
   against 113-144 ms when phase 2 swept every kept k).

   Max-product messages are heavy-tailed: in a BERT layer the kept fraction was 2-20% of k in the
   better of the two orientations, which the caller picks (see ../tropical.py). Where nothing
   can be pruned (theta = -inf, or flat data) phase 2 degenerates to the dense product. */

#define GROUP 2  /* panels per sweep: 32 columns, four accumulators */
/* Rows whose candidate lists are built at once, at most. Each chunk sweeps every panel of b
   twice (phases 1 and 2) and reads each candidate's entry of a from a packed list: a BERT-base
   feed-forward product (b 768 x 3072, 9.4 MB) ran 88-114 ms pruned with 64-row chunks and
   a's rows read in place, 39-51 ms with 256-row chunks and packed entries (one Zen 3 core). */
#define CHUNK 256

/* Max over candidate ks (cand, with their entries of a in val) against panels p and p+1 (p+1
   may equal p). */
static void sweep_values(const float *val, const int32_t *cand, int64_t count, const float *pa,
                         const float *pb, v16 acc[2]) {
    v16 v0 = v16_set1(-INFINITY), v1 = v0, w0 = v0, w1 = v0;
    int64_t t = 0;
    for (; t + 1 < count; t += 2) {
        const int64_t k0 = cand[t] * 16, k1 = cand[t + 1] * 16;
        const v16 x0 = v16_bcast(val + t), x1 = v16_bcast(val + t + 1);
        v0 = v16_max(v0, v16_add(x0, v16_load(pa + k0)));
        v1 = v16_max(v1, v16_add(x0, v16_load(pb + k0)));
        w0 = v16_max(w0, v16_add(x1, v16_load(pa + k1)));
        w1 = v16_max(w1, v16_add(x1, v16_load(pb + k1)));
    }
    if (t < count) {
        const int64_t k0 = cand[t] * 16;
        const v16 x0 = v16_bcast(val + t);
        v0 = v16_max(v0, v16_add(x0, v16_load(pa + k0)));
        v1 = v16_max(v1, v16_add(x0, v16_load(pb + k0)));
    }
    acc[0] = v16_max(v0, w0);
    acc[1] = v16_max(v1, w1);
}

/* As sweep_values, with the first k attaining each max (candidates are in increasing order). */
static void sweep_argmax(const float *val, const int32_t *cand, int64_t count, const float *pa,
                         const float *pb, v16 acc[2], v16 idx[2]) {
    v16 v[2], at[2];
    for (int c = 0; c < 2; c++) {
        v[c] = v16_set1(-INFINITY);
        at[c] = v16_set1(0.0f);
    }
    for (int64_t t = 0; t < count; t++) {
        const int64_t k0 = cand[t] * 16;
        const v16 x = v16_bcast(val + t);
        const v16 kk = v16_set1((float)cand[t]);
        const v16 s[2] = {v16_add(x, v16_load(pa + k0)), v16_add(x, v16_load(pb + k0))};
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) {
            at[c] = v16_take_greater(at[c], kk, s[c], v[c]);
            v[c] = v16_max(v[c], s[c]);
        }
    }
#pragma GCC unroll 2
    for (int c = 0; c < 2; c++) {
        acc[c] = v[c];
        idx[c] = at[c];
    }
}

/* ub = arow + bmax; returns max(ub). */
static float upper_bounds(const float *arow, const float *bmax, float *ub, int64_t k) {
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        const __m256 u = _mm256_add_ps(_mm256_loadu_ps(arow + kk), _mm256_loadu_ps(bmax + kk));
        _mm256_storeu_ps(ub + kk, u);
        best8 = _mm256_max_ps(best8, u);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, best8);
    for (int c = 0; c < 8; c++) best = lanes[c] > best ? lanes[c] : best;
    for (; kk < k; kk++) {
        ub[kk] = arow[kk] + bmax[kk];
        best = ub[kk] > best ? ub[kk] : best;
    }
    return best;
}

/* The smallest of the first `valid` (<= 32) lanes of two accumulators. */
static float min_lanes(const v16 acc[2], int64_t valid) {
    if (valid == 32) return v16_min_lanes(v16_min(acc[0], acc[1]));
    float tmp[32], low = INFINITY;
    v16_store(tmp, acc[0]);
    v16_store(tmp + 16, acc[1]);
    for (int64_t c = 0; c < valid; c++) low = tmp[c] < low ? tmp[c] : low;
    return low;
}

/* Appends to dst, in increasing order, every k with ub[k] >= bound; returns how many. Eight
   bounds are compared at once and groups with no hit cost one test (most, once pruned). */
static int64_t compact_at_least(const float *ub, int64_t k, float bound, int32_t *dst) {
    const __m256 limit = _mm256_set1_ps(bound);
    int64_t count = 0, kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        unsigned hits = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(ub + kk), limit, _CMP_GE_OQ));
        while (hits) {
            dst[count++] = (int32_t)(kk + __builtin_ctz(hits));
            hits &= hits - 1;
        }
    }
    for (; kk < k; kk++)
        if (ub[kk] >= bound) dst[count++] = (int32_t)kk;
    return count;
}

/* Bucket width (nats) and count of the histogram that picks phase-1 candidates. */
#define BUCKETS 256
#define BUCKET_SCALE 16.0f

/* Appends to dst the ks whose bound lies within the fewest top buckets holding >= want ks
   (at least the best k; all ks within BUCKETS / BUCKET_SCALE nats of it at most). Branch-free
   loops: a quickselect's mispredicted branches cost more than the pairs it saved. */
static int64_t top_candidates(const float *ub, float best, int64_t k, int64_t want,
                              int32_t *dst, float *bound) {
    *bound = INFINITY;
    if (best == -INFINITY) return 0; /* no finite pair in this row: nothing to bound */
    int32_t hist[BUCKETS] = {0};
    for (int64_t kk = 0; kk < k; kk++) {
        const float gap = (best - ub[kk]) * BUCKET_SCALE; /* >= 0, +inf for -inf bounds */
        hist[gap < (float)(BUCKETS - 1) ? (int)gap : BUCKETS - 1]++;
    }
    int64_t seen = 0;
    int last = 0;
    while (last < BUCKETS - 2 && seen + hist[last] < want) seen += hist[last++];
    const float cut = best - (float)(last + 1) / BUCKET_SCALE;
    /* ub > cut, or ub == best where cut rounds to best (a huge best): ub >= min(best, next) */
    *bound = fminf(best, nextafterf(cut, INFINITY));
    return compact_at_least(ub, k, *bound, dst);
}

/* Prefetches into L2 the share of row r (of rows) of the lines of the panels from `next` on
   (lines of them in all, 0 past the last group): the next group's panels arrive while this
   one's rows are swept, rather than one demand miss at a time at its first candidates. On a
   BERT-base layer's five pruned products (one Zen 3 core, three interleaved runs) the medians
   summed 177-216 ms without it and 164-170 ms with it. */
static inline void prefetch_share(const float *next, int64_t lines, int r, int rows) {
    const int64_t from = lines * r / rows, to = lines * (r + 1) / rows;
    for (int64_t l = from; l < to; l++) _mm_prefetch((const char *)(next + l * 16), _MM_HINT_T1);
}

/* Lines (one per k per panel) of the group of panels after the one starting at panel p. */
static inline int64_t next_group_lines(int64_t panels_n, int64_t p, int64_t k) {
    const int64_t after = panels_n - p - GROUP;
    return after <= 0 ? 0 : (after < GROUP ? after : GROUP) * k;
}

/* The first `valid` (<= 32) lanes of two accumulators into dst. */
static inline void store_lanes(float *dst, const v16 acc[2], int64_t valid) {
    float tmp[32];
    for (int c = 0; c < 2; c++) v16_store(tmp + 16 * c, acc[c]);
    memcpy(dst, tmp, sizeof(float) * (size_t)valid);
}

/* dst[c] = max(dst[c], lane c) for the first `valid` (<= 32) lanes of two accumulators. */
static inline void max_into_lanes(float *dst, const v16 acc[2], int64_t valid) {
    float tmp[32];
    for (int c = 0; c < 2; c++) v16_store(tmp + 16 * c, acc[c]);
    for (int64_t c = 0; c < valid; c++) dst[c] = tmp[c] > dst[c] ? tmp[c] : dst[c];
}

/* Keeps, in order, the candidates of cand[0, count) whose bound is below `bound` (those phase
   1 did not sweep); returns how many. */
static inline int64_t below(const float *ub, int32_t *cand, int64_t count, float bound) {
    int64_t kept = 0;
    for (int64_t t = 0; t < count; t++) {
        cand[kept] = cand[t];
        kept += ub[cand[t]] < bound;
    }
    return kept;
}

/* val[t] = arow[cand[t]] for t in [from, to): the sweeps read each candidate's entry of a from
   one contiguous list rather than from its row (a chunk's rows of a outgrow L2). */
static void gather_values(const float *arow, const int32_t *cand, int64_t from, int64_t to,
                          float *val) {
    for (int64_t t = from; t < to; t++) val[t] = arow[cand[t]];
}

/* The pruned product of one matrix; a is [n, k] with unit stride along k. Returns the number
   of (row, k) candidates of phase 2 (for the caller's statistics), or -1 if out of memory. */
int64_t semipack_maxplus_pruned_f32(const float *a, int64_t a_i, const float *bmax,
                                    const float *panels, float *out, int64_t *index, int64_t o_i,
                                    int64_t n, int64_t k, int64_t m, int64_t top, int threads) {
    const int64_t panels_n = (m + 15) / 16;
    const int64_t t_top = top < k ? top : k;
    /* a chunk per thread where the rows are few, so that every thread has work */
    const int64_t workers = threads > 1 ? threads : 1;
    const int64_t per_thread = (n + workers - 1) / workers;
    const int64_t chunk = per_thread < 1 ? 1 : per_thread < CHUNK ? per_thread : CHUNK;
    int64_t kept = 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : kept) reduction(| : failed)
    {
        float *ub = malloc(sizeof(float) * (size_t)(k + 1)); /* + 1: never malloc(0) */
        int32_t *cand = malloc(sizeof(int32_t) * (size_t)(chunk * k + 1));
        float *val = malloc(sizeof(float) * (size_t)(chunk * k + 1));
        int64_t start[CHUNK + 1];
        float theta[CHUNK], first_bound[CHUNK];
        int empty[CHUNK];
        failed = !ub || !cand || !val;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c0 = 0; c0 < n; c0 += chunk) {
            if (failed) continue;
            const int rows = n - c0 < chunk ? (int)(n - c0) : (int)chunk;
            /* Phase 1: about t_top ks of largest bound. */
            start[0] = 0;
            for (int r = 0; r < rows; r++) {
                const float best = upper_bounds(a + (c0 + r) * a_i, bmax, ub, k);
                start[r + 1] = start[r] + top_candidates(ub, best, k, t_top, cand + start[r],
                                                         first_bound + r);
                gather_values(a + (c0 + r) * a_i, cand, start[r], start[r + 1], val);
                theta[r] = INFINITY;
                empty[r] = start[r + 1] == start[r];
            }
            for (int64_t p = 0; p < panels_n; p += GROUP) {
                const float *pa = panels + p * k * 16;
                const float *pb = p + 1 < panels_n ? pa + k * 16 : pa;
                const int64_t valid = m - p * 16 < 32 ? m - p * 16 : 32;
                const int64_t ahead = next_group_lines(panels_n, p, k);
                for (int r = 0; r < rows; r++) {
                    prefetch_share(pa + GROUP * k * 16, ahead, r, rows);
                    v16 acc[2];
                    sweep_values(val + start[r], cand + start[r], start[r + 1] - start[r], pa, pb,
                                 acc);
                    const float low = min_lanes(acc, valid);
                    theta[r] = low < theta[r] ? low : theta[r];
                    if (!index) store_lanes(out + (c0 + r) * o_i + p * 16, acc, valid);
                }
            }
            /* Phase 2: every k whose bound reaches theta, in increasing order. */
            for (int r = 0; r < rows; r++) {
                upper_bounds(a + (c0 + r) * a_i, bmax, ub, k);
                const int64_t count = empty[r] ? 0 : compact_at_least(ub, k, theta[r], cand + start[r]);
                kept += count;
                /* without the index, out holds the phase-1 maxima: only kept ks below the
                   phase-1 bound are still to be swept */
                const int64_t sweep =
                    index ? count : below(ub, cand + start[r], count, first_bound[r]);
                start[r + 1] = start[r] + sweep;
                gather_values(a + (c0 + r) * a_i, cand, start[r], start[r + 1], val);
            }
            for (int64_t p = 0; p < panels_n; p += GROUP) {
                const float *pa = panels + p * k * 16;
                const float *pb = p + 1 < panels_n ? pa + k * 16 : pa;
                const int64_t valid = m - p * 16 < 32 ? m - p * 16 : 32;
                const int64_t ahead = next_group_lines(panels_n, p, k);
                for (int r = 0; r < rows; r++) {
                    prefetch_share(pa + GROUP * k * 16, ahead, r, rows);
                    v16 acc[2], at[2];
                    const float *vrow = val + start[r];
                    const int64_t count = start[r + 1] - start[r];
                    float *dst = out + (c0 + r) * o_i + p * 16;
                    if (!index) { /* onto the phase-1 maxima, which are the maxima if none */
                        if (count == 0) continue;
                        sweep_values(vrow, cand + start[r], count, pa, pb, acc);
                        max_into_lanes(dst, acc, valid);
                        continue;
                    }
                    float where[32];
                    sweep_argmax(vrow, cand + start[r], count, pa, pb, acc, at);
                    for (int c = 0; c < 2; c++) v16_store(where + 16 * c, at[c]);
                    int64_t *dst_index = index + (c0 + r) * o_i + p * 16;
                    for (int64_t c = 0; c < valid; c++) dst_index[c] = (int64_t)where[c];
                    store_lanes(dst, acc, valid);
                }
            }
        }
        free(ub);
        free(cand);
        free(val);
    }
    return failed ? -1 : kept;
}

/* What semipack_maxplus_pruned_f32 would keep for rows a[0, n) (unit stride along k), without
   the products: counts[0] = phase-2 candidates, counts[1] = phase-1 candidates, summed over the
   rows, from the same bounds, the same phase-1 candidates and the same pair sums (so the same
   theta and the same counts). b is read in place as b[kk * b_k + j * b_j], so the caller
   samples a few rows of either orientation without packing or copying b. Returns -1 if out of
   memory, else 0.

   Why: choosing between the pruned and the dense kernel needs the share a product keeps; taken
   with eager tensor ops on 8 sampled rows (a top-k and a [8, 32, m] gather) it cost 1-5 ms per
   orientation on a BERT layer's products, up to a tenth of the product. */
int semipack_maxplus_pruned_count_f32(const float *a, int64_t a_i, const float *b, int64_t b_k,
                                      int64_t b_j, const float *bmax, int64_t n, int64_t k,
                                      int64_t m, int64_t top, int64_t *counts) {
    const int64_t t_top = top < k ? top : k;
    float *ub = malloc(sizeof(float) * (size_t)(n * k + 1)); /* + 1: never malloc(0) */
    int32_t *cand = malloc(sizeof(int32_t) * (size_t)(n * k + 1));
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(n + 1));
    float *low = malloc(sizeof(float) * (size_t)(n * m + 1));
    int64_t kept = 0;
    if (!ub || !cand || !start || !low) {
        free(ub);
        free(cand);
        free(start);
        free(low);
        return -1;
    }
    /* each row's bounds and phase-1 candidates, as the kernel takes them */
    start[0] = 0;
    for (int64_t r = 0; r < n; r++) {
        const float best = upper_bounds(a + r * a_i, bmax, ub + r * k, k);
        float bound; /* unused: the count needs only the candidates */
        start[r + 1] =
            start[r] + top_candidates(ub + r * k, best, k, t_top, cand + start[r], &bound);
    }
    /* low[r, j] = max over row r's candidates of a[r, kk] + b[kk, j]: along rows of b where
       they are contiguous; else memory row by memory row (b = a.T of the other orientation),
       so that each is read once for all the rows' candidates rather than once per candidate */
    for (int64_t i = 0; i < n * m; i++) low[i] = -INFINITY;
    if (b_j == 1) {
        for (int64_t r = 0; r < n; r++) {
            float *lrow = low + r * m;
            for (int64_t t = start[r]; t < start[r + 1]; t++) {
                const float x = a[r * a_i + cand[t]];
                const float *brow = b + cand[t] * b_k;
                const __m256 xv = _mm256_set1_ps(x);
                int64_t j = 0;
                for (; j + 8 <= m; j += 8)
                    _mm256_storeu_ps(lrow + j,
                                     _mm256_max_ps(_mm256_loadu_ps(lrow + j),
                                                   _mm256_add_ps(xv, _mm256_loadu_ps(brow + j))));
                for (; j < m; j++) lrow[j] = fmaxf(lrow[j], x + brow[j]);
            }
        }
    } else {
        for (int64_t j = 0; j < m; j++) {
            const float *bcol = b + j * b_j;
            for (int64_t r = 0; r < n; r++) {
                float best = -INFINITY;
                for (int64_t t = start[r]; t < start[r + 1]; t++)
                    best = fmaxf(best, a[r * a_i + cand[t]] + bcol[cand[t] * b_k]);
                low[r * m + j] = best;
            }
        }
    }
    /* theta = the smallest lower bound of the row; phase 2 keeps every k whose bound reaches it
       (a row without phase-1 candidates has no finite pair: the kernel keeps none of it) */
    for (int64_t r = 0; r < n; r++) {
        if (start[r + 1] == start[r]) continue;
        float theta = INFINITY;
        for (int64_t j = 0; j < m; j++) theta = low[r * m + j] < theta ? low[r * m + j] : theta;
        const float *urow = ub + r * k;
        for (int64_t kk = 0; kk < k; kk++) kept += urow[kk] >= theta;
    }
    counts[0] = kept;
    counts[1] = start[n];
    free(ub);
    free(cand);
    free(start);
    free(low);
    return 0;
}

/* The two products of a convolution tap with one row-offset table (see
   rules/convolution.py, _MaxPlusTaps). A tap reads, and its input message lands on, a strided
   window of the padded input; its rows are one table (the same for every tap, shifted by the
   tap's start), so nothing is copied or packed per tap:

   gather:       out[i, j] = max_k a[i, k] + b[rows_of_b[k], j], b packed once as [panel][K][16]
                 (panel_stride = K * 16 elements between panels); with index, also the first k
                 attaining it (TopPath);
   scatter-max:  out[rows_of_out[i] * o_row + j] = max(that, max_k a[i, k] + b[k, j]), b packed
                 as [panel][k][16]; the rows must be distinct (a tap's outputs are). With ids
                 (int64 [n, k], one per entry of a) and out_ids (beside out), a strictly larger
                 candidate also takes ids[i, its first argmax k] (ties keep what was there, as
                 TopPath's plus does).

   One task per (block of rows, panel), as in semipack_maxplus_f32. */
static void maxplus_tiles(const problem *p, int64_t panel_stride, const int64_t *rows_of_b,
                          const int64_t *rows_of_out, int64_t o_row, const int64_t *ids,
                          int64_t *out_ids, int threads) {
    const int64_t n = p->n, m = p->m;
    const int tile_rows = (p->index || ids) ? ARGMAX_ROWS : ROWS;
    const int64_t panels_n = (m + 15) / 16, height = block_rows(n);
    const int64_t blocks = (n + height - 1) / height;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < blocks * panels_n; t++) {
        const int64_t q = t % panels_n, block = t / panels_n;
        const int64_t j = q * 16, i1 = (block + 1) * height < n ? (block + 1) * height : n;
        const int cols = m - j < 16 ? (int)(m - j) : 16;
        const float *panel = p->panels + q * panel_stride;
        for (int64_t i = block * height; i < i1; i += tile_rows) {
            const int rows = i1 - i < tile_rows ? (int)(i1 - i) : tile_rows;
            const float *arow = p->a + i * p->a_i;
            if (!rows_of_out) {
                float *dst = p->out + i * p->o_i + j;
                if (p->index) {
                    tile_argmax_loop(p, arow, panel, rows_of_b, dst, p->index + i * p->o_i + j,
                                     rows, cols);
                } else {
                    tile_loop(p, arow, panel, rows_of_b, dst, rows, cols);
                }
                continue;
            }
            float tile[ROWS * 16];
            int64_t where[ROWS * 16];
            const problem local = {arow, 0, p->a_i, p->a_k, NULL, NULL, NULL, 0, 16,
                                   p->n, p->k, p->m};
            if (ids) {
                tile_argmax_loop(&local, arow, panel, rows_of_b, tile, where, rows, 16);
            } else {
                tile_loop(&local, arow, panel, rows_of_b, tile, rows, 16);
            }
            for (int r = 0; r < rows; r++) {
                const int64_t at = rows_of_out[i + r] * o_row + j;
                for (int c = 0; c < cols; c++) {
                    const float v = tile[r * 16 + c];
                    if (v > p->out[at + c]) {
                        p->out[at + c] = v;
                        if (ids) out_ids[at + c] = ids[(i + r) * p->k + where[r * 16 + c]];
                    }
                }
            }
        }
    }
}

void semipack_maxplus_gather_f32(const float *a, int64_t a_i, int64_t a_k, const float *panels,
                                 int64_t panel_stride, const int64_t *rows_of_b, float *out,
                                 int64_t *index, int64_t o_i, int64_t n, int64_t k, int64_t m,
                                 int threads) {
    const problem p = {a, 0, a_i, a_k, panels, out, index, 0, o_i, n, k, m};
    maxplus_tiles(&p, panel_stride, rows_of_b, NULL, 0, NULL, NULL, threads);
}

void semipack_maxplus_scatter_max_f32(const float *a, int64_t a_i, int64_t a_k,
                                      const float *panels, float *out, const int64_t *rows_of_out,
                                      int64_t o_row, const int64_t *ids, int64_t *out_ids,
                                      int64_t n, int64_t k, int64_t m, int threads) {
    const problem p = {a, 0, a_i, a_k, panels, out, NULL, 0, 0, n, k, m};
    maxplus_tiles(&p, k * 16, NULL, rows_of_out, o_row, ids, out_ids, threads);
}

/* Packs b[s, k, j] (any strides, in elements) into [s][panel][k][16] panels, -inf padded. */
void semipack_pack_panels_f32(const float *b, int64_t b_s, int64_t b_k, int64_t b_j,
                              float *panels, int64_t batch, int64_t k, int64_t m, int threads) {
    const int64_t panels_n = (m + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < batch * panels_n; t++) {
        const int64_t s = t / panels_n, j0 = (t % panels_n) * 16;
        const int cols = m - j0 < 16 ? (int)(m - j0) : 16;
        float *dst = panels + t * k * 16;
        const float *src = b + s * b_s + j0 * b_j;
        for (int64_t kk = 0; kk < k; kk++) {
            int c = 0;
            if (b_j == 1) {
                for (; c < cols; c++) dst[kk * 16 + c] = src[kk * b_k + c];
            } else {
                for (; c < cols; c++) dst[kk * 16 + c] = src[kk * b_k + c * b_j];
            }
            for (; c < 16; c++) dst[kk * 16 + c] = -INFINITY;
        }
    }
}
