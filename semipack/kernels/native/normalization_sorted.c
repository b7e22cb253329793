/* The pair reductions of normalisation rows in O(n log n) instead of O(n^2) (see
   ../normalization.py for the algebra and normalization.c for the all-pairs kernels whose values
   these reproduce). Per row and output j, over every input i, with c_ij = |1 + x_i x_j|:

       max:      P_j = max_i a_i c_ij
       sums:     S_j = sum_i a_i c_ij,   T_j = sum_i a_i r_i c_ij
       entropy:  S_j, T_j and U_j = sum_i a_i c_ij log c_ij

   Why this is possible: seen from output j, with t = x_j, every term is a function of one
   affine form 1 + x_i t. So

   - the max is the larger of two upper envelopes of lines, a_i + (a_i x_i) t and its negation.
     Real rows' envelopes hold a few lines, found without sorting (row_max_candidates, below);
     otherwise: sort the lines by slope once, keep the envelope (a stack), walk it with the
     sorted t (row_max);
   - a sum of a_i |1 + x_i t| is linear in t between the points t = -1/x_i: with x sorted and
     prefix sums of a and a x, the terms with 1 + x_i t >= 0 are a prefix or a suffix found by
     binary search, and the sum is 2 (positive part) - (all);
   - U is not piecewise linear, so it is evaluated with a tree over the sorted x (a 1-D
     multipole method): a node whose spread of 1 + x_i t is small against its centre value u0
     contributes through the Taylor series of (u0 + d) log(u0 + d) in d (coefficients from the
     node's moments of x about its centre, kept from the build); the others are opened, down to
     leaves summed directly.

   Exactness. Everything is double precision; each result is compared with an a-priori bound of
   its own error, and a column whose bound exceeds 2^-26 of the value's scale (a cancellation in
   the prefix sums) is recomputed with the direct O(n) sum. The series is truncated after
   SERIES_TERMS terms at ratio |d / u0| <= FAR_RATIO: the remainder is below
   FAR_RATIO^(K+1) / (K (K+1) (1 - FAR_RATIO)) sum a_i |u0| < 1.1e-9 S_j (0.4 and 16 terms:
   a tighter bound than 0.5 and 20 terms, 2.3e-9, and 17% less time on a ResNet's train-mode
   batch norms: nearer nodes are opened, each far one sums fewer terms). Results are within
   float32 rounding of the all-pairs kernels'. Each row is sorted here (a radix sort of the
   float32 keys: torch's argsort costs ten times more). */

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SERIES_TERMS 16
#define FAR_RATIO 0.4
#define LEAF_SIZE 8
#define MAX_DEPTH 64
/* Relative error allowed for a prefix-sum result before the column is recomputed directly. */
#define CERTIFY 1.4901161193847656e-08 /* 2^-26 */

/* ---- sorting: an LSD radix sort of float32 keys ---------------------------------------------- */

/* The float's bits mapped so that unsigned order is numeric order (negatives reversed). */
static inline uint32_t ordered_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* order[k]: the index of the k-th smallest key (stable). ``scratch``: 3 n uint32 words.
   Short rows take four passes of 8 bits, long ones three of 11 (fewer passes, larger counts). */
static void sort_order(const float *key, int64_t n, uint32_t *order, uint32_t *scratch) {
    uint32_t *bits = scratch, *bits_alt = bits + n, *order_alt = bits_alt + n;
    const int digit = n < 2048 ? 8 : 11;
    const uint32_t buckets = 1u << digit;
    uint32_t count[(1 << 11) + 1];
    for (int64_t k = 0; k < n; k++) {
        bits[k] = ordered_bits(key[k]);
        order[k] = (uint32_t)k;
    }
    for (int shift = 0; shift < 32; shift += digit) {
        memset(count, 0, (buckets + 1) * sizeof(uint32_t));
        for (int64_t k = 0; k < n; k++) count[((bits[k] >> shift) & (buckets - 1)) + 1]++;
        for (uint32_t b = 0; b < buckets; b++) count[b + 1] += count[b];
        for (int64_t k = 0; k < n; k++) {
            const uint32_t dest = count[(bits[k] >> shift) & (buckets - 1)]++;
            bits_alt[dest] = bits[k];
            order_alt[dest] = order[k];
        }
        uint32_t *swap = bits;
        bits = bits_alt;
        bits_alt = swap;
        memcpy(order, order_alt, (size_t)n * sizeof(uint32_t));
    }
}

/* ---- max: two upper envelopes of lines ------------------------------------------------------ */

/* Indices (into slope/icpt, sorted by slope ascending) of the lines on the upper envelope. */
static int64_t upper_envelope(const double *slope, const double *icpt, int64_t n, int64_t *hull) {
    int64_t h = 0;
    for (int64_t k = 0; k < n; k++) {
        if (h > 0 && slope[hull[h - 1]] == slope[k]) {
            if (icpt[k] <= icpt[hull[h - 1]]) continue;
            h--;
        }
        while (h >= 2) {
            const int64_t l1 = hull[h - 2], l2 = hull[h - 1];
            /* l2 is never on top when l3 = k overtakes l1 no later than l2 does */
            const double lhs = (icpt[l1] - icpt[k]) * (slope[l2] - slope[l1]);
            const double rhs = (icpt[l1] - icpt[l2]) * (slope[k] - slope[l1]);
            if (lhs <= rhs) h--;
            else break;
        }
        hull[h++] = k;
    }
    return h;
}

/* out[q] = max(out[q], envelope at t[q]) for t ascending; where the envelope is larger,
   line[q] takes the position (in slope order) of its line. */
static void envelope_max(const double *slope, const double *icpt, const int64_t *hull, int64_t h,
                         const double *t, int64_t n, double *out, int64_t *line) {
    int64_t p = 0;
    for (int64_t q = 0; q < n; q++) {
        double best = icpt[hull[p]] + slope[hull[p]] * t[q];
        while (p + 1 < h) {
            const double next = icpt[hull[p + 1]] + slope[hull[p + 1]] * t[q];
            if (next < best) break;
            best = next;
            p++;
        }
        if (best > out[q]) {
            out[q] = best;
            line[q] = hull[p];
        }
    }
}

/* One row of max_i a_i |1 + x_i x_j|, and in ``arg`` (unless NULL) an i attaining it (-1 where
   every term is 0). ``work``: 4 n doubles; ``hull``, ``line``: n; ``ranks``: 5 n words. */
static void row_max(const float *a, const float *x, int64_t n, double *work, int64_t *hull,
                    int64_t *line, uint32_t *ranks, float *out, int64_t *arg) {
    double *slope = work, *icpt = slope + n, *t = icpt + n, *best = t + n;
    float *slope_f = (float *)best; /* the float32 slopes, only until best is written */
    uint32_t *order_x = ranks, *order_b = ranks + n, *scratch = ranks + 2 * n;
    for (int64_t k = 0; k < n; k++) slope_f[k] = a[k] * x[k];
    /* lines sorted by their (float32) slope a_i x_i: the line uses that same slope */
    sort_order(slope_f, n, order_b, scratch);
    sort_order(x, n, order_x, scratch);
    for (int64_t k = 0; k < n; k++) {
        const uint32_t i = order_b[k];
        slope[k] = (double)slope_f[i];
        icpt[k] = (double)a[i];
        t[k] = (double)x[order_x[k]];
    }
    for (int64_t k = 0; k < n; k++) {
        best[k] = 0.0;
        line[k] = -1;
    }
    int64_t h = upper_envelope(slope, icpt, n, hull);
    envelope_max(slope, icpt, hull, h, t, n, best, line);
    /* the negated lines, -a_i - (a_i x_i) t, sorted by slope: the same order reversed, so the
       line at position k there is the one at n - 1 - k here */
    for (int64_t k = 0; k < n / 2; k++) {
        const double s = slope[k], c = icpt[k];
        slope[k] = -slope[n - 1 - k];
        icpt[k] = -icpt[n - 1 - k];
        slope[n - 1 - k] = -s;
        icpt[n - 1 - k] = -c;
    }
    if (n % 2) {
        slope[n / 2] = -slope[n / 2];
        icpt[n / 2] = -icpt[n / 2];
    }
    for (int64_t k = 0; k < n; k++) /* mark the first envelope's winners as positions >= n */
        if (line[k] >= 0) line[k] += n;
    h = upper_envelope(slope, icpt, n, hull);
    envelope_max(slope, icpt, hull, h, t, n, best, line);
    for (int64_t k = 0; k < n; k++) {
        const uint32_t j = order_x[k];
        out[j] = (float)best[k];
        if (arg == NULL) continue;
        const int64_t at = line[k];
        arg[j] = at < 0 ? -1 : at >= n ? (int64_t)order_b[at - n] : (int64_t)order_b[n - 1 - at];
    }
}

/* ---- max with few envelope lines: candidates found by evaluation, no sort -------------------- */

/* The envelopes of real rows are short (a BERT layer norm's: 4 to 5 lines of 768 on average),
   and row_max spends most of its time sorting and pushing lines that never stay on them.
   Seen on the queries' range [lo, hi] = [min x, max x], a line rises above the envelope of a
   set S of lines somewhere only if it does at one of that envelope's vertices (its breakpoints
   inside the range, lo and hi): the envelope is convex and piecewise linear, so the envelope
   minus a line is smallest at a vertex. Hence, per sign:
   - S starts with the lines best at SEED_POINTS points of the range (one pass);
   - one pass keeps the lines rising above S's envelope at a vertex. Every other line stays
     below it everywhere on the range, and below every envelope of a larger S;
   - S takes the risers (few, on real rows) and then holds every line that can attain a maximum.
     If they are too many, S takes the one rising most at each vertex and the risers are
     filtered again, for at most MAX_ROUNDS rounds.
   The maxima are then taken over S's lines at the queries, formed as row_max forms them
   (double products and sums); between rows the two ways differ only in which line of an exact
   tie is named. Rows whose S would outgrow MAX_CANDIDATES lines go to row_max. */

#define SEED_POINTS 8 /* two vectors of four doubles */
#define MAX_CANDIDATES 48
#define MAX_ROUNDS 8

/* Candidate lines sign * (c_i + s_i t): their ids, intercepts and slopes (sign included). */
struct lines {
    int64_t count;
    int64_t id[MAX_CANDIDATES];
    double icpt[MAX_CANDIDATES], slope[MAX_CANDIDATES];
};

/* Adds line i unless S holds it already; 0 when S is full. */
static int add_line(struct lines *S, int64_t i, double sign, const double *c, const double *s) {
    for (int64_t k = 0; k < S->count; k++)
        if (S->id[k] == i) return 1;
    if (S->count == MAX_CANDIDATES) return 0;
    S->id[S->count] = i;
    S->icpt[S->count] = sign * c[i];
    S->slope[S->count] = sign * s[i];
    S->count++;
    return 1;
}

/* S reduced to its envelope lines in slope order (insertion sort: S is small), and the vertices
   of that envelope on [lo, hi] in ``v`` with its values there in ``env``; returns their count,
   padded with copies of hi to whole vectors of four. */
static int64_t envelope_vertices(struct lines *S, double lo, double hi, double *v, double *env) {
    for (int64_t k = 1; k < S->count; k++) {
        const int64_t id = S->id[k];
        const double c = S->icpt[k], s = S->slope[k];
        int64_t p = k;
        while (p > 0 && (S->slope[p - 1] > s || (S->slope[p - 1] == s && S->icpt[p - 1] > c))) {
            S->id[p] = S->id[p - 1];
            S->icpt[p] = S->icpt[p - 1];
            S->slope[p] = S->slope[p - 1];
            p--;
        }
        S->id[p] = id;
        S->icpt[p] = c;
        S->slope[p] = s;
    }
    int64_t hull[MAX_CANDIDATES];
    const int64_t h = upper_envelope(S->slope, S->icpt, S->count, hull);
    for (int64_t k = 0; k < h; k++) { /* hull is increasing: compaction in place is safe */
        S->id[k] = S->id[hull[k]];
        S->icpt[k] = S->icpt[hull[k]];
        S->slope[k] = S->slope[hull[k]];
    }
    S->count = h;
    int64_t nv = 0;
    v[nv++] = lo;
    for (int64_t k = 0; k + 1 < h; k++) {
        const double at = (S->icpt[k] - S->icpt[k + 1]) / (S->slope[k + 1] - S->slope[k]);
        if (at > lo && at < hi) v[nv++] = at;
    }
    v[nv++] = hi;
    while (nv % 4) v[nv++] = hi;
    for (int64_t q = 0; q < nv; q++) {
        double top = -INFINITY;
        for (int64_t k = 0; k < h; k++) top = fmax(top, S->icpt[k] + S->slope[k] * v[q]);
        env[q] = top;
    }
    return nv;
}

/* The lines (of ``list``, or all n where it is NULL) rising above ``env`` at one of the nv
   vertices ``v``, written to ``found`` (which may be ``list``); returns how many. */
static int64_t rising_lines(const double *c, const double *s, const int64_t *list, int64_t n,
                            double sign, const double *v, const double *env, int64_t nv,
                            int64_t *found) {
    const __m256d sg = _mm256_set1_pd(sign);
    int64_t count = 0;
    if (list == NULL && nv <= 8) { /* the common case, unrolled: every line, two vectors */
        const __m256d v0 = _mm256_mul_pd(sg, _mm256_loadu_pd(v));
        const __m256d v1 = _mm256_mul_pd(sg, _mm256_loadu_pd(v + 4 * (nv > 4)));
        const __m256d e0 = _mm256_loadu_pd(env), e1 = _mm256_loadu_pd(env + 4 * (nv > 4));
        const __m256d sc = _mm256_mul_pd(sg, _mm256_set1_pd(1.0));
        for (int64_t i = 0; i < n; i++) {
            const __m256d ci = _mm256_mul_pd(sc, _mm256_set1_pd(c[i]));
            const __m256d si = _mm256_set1_pd(s[i]);
            const __m256d r0 = _mm256_cmp_pd(_mm256_add_pd(_mm256_mul_pd(si, v0), ci), e0,
                                             _CMP_GT_OQ);
            const __m256d r1 = _mm256_cmp_pd(_mm256_add_pd(_mm256_mul_pd(si, v1), ci), e1,
                                             _CMP_GT_OQ);
            if (_mm256_movemask_pd(_mm256_or_pd(r0, r1))) found[count++] = i;
        }
        return count;
    }
    for (int64_t k = 0; k < n; k++) {
        const int64_t i = list != NULL ? list[k] : k;
        const __m256d ci = _mm256_mul_pd(sg, _mm256_set1_pd(c[i]));
        const __m256d si = _mm256_mul_pd(sg, _mm256_set1_pd(s[i]));
        __m256d rises = _mm256_setzero_pd();
        for (int64_t q = 0; q < nv; q += 4) {
            const __m256d val = _mm256_add_pd(_mm256_mul_pd(si, _mm256_loadu_pd(v + q)), ci);
            rises = _mm256_or_pd(rises, _mm256_cmp_pd(val, _mm256_loadu_pd(env + q), _CMP_GT_OQ));
        }
        if (_mm256_movemask_pd(rises)) found[count++] = i;
    }
    return count;
}

/* Completes S (seeded) to hold every line that attains the envelope on [lo, hi]; 0 where it
   would outgrow MAX_CANDIDATES lines or MAX_ROUNDS rounds. ``list``: n words of scratch. */
static int complete_lines(const double *c, const double *s, int64_t n, double lo, double hi,
                          double sign, struct lines *S, int64_t *list) {
    double v[MAX_CANDIDATES + 4], env[MAX_CANDIDATES + 4];
    int64_t nv = envelope_vertices(S, lo, hi, v, env);
    int64_t count = rising_lines(c, s, NULL, n, sign, v, env, nv, list);
    for (int round = 0; count > 0; round++) {
        if (S->count + count <= MAX_CANDIDATES) {
            for (int64_t k = 0; k < count; k++) add_line(S, list[k], sign, c, s);
            return 1;
        }
        if (round == MAX_ROUNDS) return 0;
        for (int64_t q = 0; q < nv; q++) { /* the riser rising most at each vertex */
            double most = 0.0;
            int64_t at = -1;
            for (int64_t k = 0; k < count; k++) {
                const int64_t i = list[k];
                const double rise = sign * (c[i] + s[i] * v[q]) - env[q];
                if (rise > most) {
                    most = rise;
                    at = i;
                }
            }
            if (at >= 0 && !add_line(S, at, sign, c, s)) return 0;
        }
        nv = envelope_vertices(S, lo, hi, v, env);
        count = rising_lines(c, s, list, count, sign, v, env, nv, list);
    }
    return 1;
}

/* The lines best (largest: ``up``, smallest: ``down``) at SEED_POINTS points of [lo, hi]. */
static void seed_lines(const double *c, const double *s, int64_t n, double lo, double hi,
                       struct lines *up, struct lines *down) {
    double t[SEED_POINTS];
    for (int p = 0; p < SEED_POINTS; p++) t[p] = lo + (hi - lo) * p / (SEED_POINTS - 1);
    const __m256d t0 = _mm256_loadu_pd(t), t1 = _mm256_loadu_pd(t + 4);
    __m256d top0 = _mm256_set1_pd(-INFINITY), top1 = top0;
    __m256d low0 = _mm256_set1_pd(INFINITY), low1 = low0;
    __m256d at_top0 = _mm256_setzero_pd(), at_top1 = at_top0, at_low0 = at_top0, at_low1 = at_top0;
    for (int64_t i = 0; i < n; i++) {
        const __m256d ci = _mm256_set1_pd(c[i]), si = _mm256_set1_pd(s[i]);
        const __m256d id = _mm256_set1_pd((double)i);
        const __m256d v0 = _mm256_add_pd(_mm256_mul_pd(si, t0), ci);
        const __m256d v1 = _mm256_add_pd(_mm256_mul_pd(si, t1), ci);
        __m256d m = _mm256_cmp_pd(v0, top0, _CMP_GT_OQ);
        top0 = _mm256_blendv_pd(top0, v0, m);
        at_top0 = _mm256_blendv_pd(at_top0, id, m);
        m = _mm256_cmp_pd(v1, top1, _CMP_GT_OQ);
        top1 = _mm256_blendv_pd(top1, v1, m);
        at_top1 = _mm256_blendv_pd(at_top1, id, m);
        m = _mm256_cmp_pd(v0, low0, _CMP_LT_OQ);
        low0 = _mm256_blendv_pd(low0, v0, m);
        at_low0 = _mm256_blendv_pd(at_low0, id, m);
        m = _mm256_cmp_pd(v1, low1, _CMP_LT_OQ);
        low1 = _mm256_blendv_pd(low1, v1, m);
        at_low1 = _mm256_blendv_pd(at_low1, id, m);
    }
    double ids[4 * 4];
    _mm256_storeu_pd(ids, at_top0);
    _mm256_storeu_pd(ids + 4, at_top1);
    _mm256_storeu_pd(ids + 8, at_low0);
    _mm256_storeu_pd(ids + 12, at_low1);
    for (int p = 0; p < SEED_POINTS; p++) { /* at most SEED_POINTS < MAX_CANDIDATES each */
        add_line(up, (int64_t)ids[p], 1.0, c, s);
        add_line(down, (int64_t)ids[SEED_POINTS + p], -1.0, c, s);
    }
}

/* row_max through candidate lines; 0 (with nothing written) where the row needs row_max.
   ``work``: 3 n doubles. */
static int row_max_candidates(const float *a, const float *x, int64_t n, double *work, float *out,
                              int64_t *arg) {
    double *c = work, *s = work + n;
    int64_t *list = (int64_t *)(work + 2 * n);
    double lo = INFINITY, hi = -INFINITY;
    for (int64_t k = 0; k < n; k++) {
        c[k] = (double)a[k];
        s[k] = (double)(a[k] * x[k]); /* the float32 slope, as row_max uses it */
        const double t = (double)x[k];
        lo = t < lo ? t : lo;
        hi = t > hi ? t : hi;
    }
    struct lines up = {0}, down = {0};
    seed_lines(c, s, n, lo, hi, &up, &down);
    if (!complete_lines(c, s, n, lo, hi, 1.0, &up, list) ||
        !complete_lines(c, s, n, lo, hi, -1.0, &down, list))
        return 0;
    double v[MAX_CANDIDATES + 4], env[MAX_CANDIDATES + 4];
    envelope_vertices(&up, lo, hi, v, env); /* keeps only envelope lines: fewer to evaluate */
    envelope_vertices(&down, lo, hi, v, env);
    const struct lines *sets[2] = {&up, &down};
    int64_t j = 0;
    if (arg == NULL) { /* values only: one max per line and query vector */
        for (; j + 8 <= n; j += 8) {
            const __m256d t0 = _mm256_cvtps_pd(_mm_loadu_ps(x + j));
            const __m256d t1 = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4));
            __m256d best0 = _mm256_setzero_pd(), best1 = best0;
            for (int side = 0; side < 2; side++) {
                const struct lines *S = sets[side];
                for (int64_t k = 0; k < S->count; k++) {
                    const __m256d ck = _mm256_set1_pd(S->icpt[k]);
                    const __m256d sk = _mm256_set1_pd(S->slope[k]);
                    /* on ties max_pd returns its second operand: best stays +0.0 */
                    best0 = _mm256_max_pd(_mm256_add_pd(_mm256_mul_pd(sk, t0), ck), best0);
                    best1 = _mm256_max_pd(_mm256_add_pd(_mm256_mul_pd(sk, t1), ck), best1);
                }
            }
            _mm_storeu_ps(out + j, _mm256_cvtpd_ps(best0));
            _mm_storeu_ps(out + j + 4, _mm256_cvtpd_ps(best1));
        }
    }
    for (; j + 8 <= n; j += 8) { /* two vectors of queries: two independent chains */
        const __m256d t0 = _mm256_cvtps_pd(_mm_loadu_ps(x + j));
        const __m256d t1 = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4));
        __m256d best0 = _mm256_setzero_pd(), best1 = best0;
        __m256d at0 = _mm256_set1_pd(-1.0), at1 = at0;
        for (int side = 0; side < 2; side++) {
            const struct lines *S = sets[side];
            for (int64_t k = 0; k < S->count; k++) {
                const __m256d ck = _mm256_set1_pd(S->icpt[k]), sk = _mm256_set1_pd(S->slope[k]);
                const __m256d id = _mm256_set1_pd((double)S->id[k]);
                const __m256d v0 = _mm256_add_pd(_mm256_mul_pd(sk, t0), ck);
                const __m256d v1 = _mm256_add_pd(_mm256_mul_pd(sk, t1), ck);
                const __m256d m0 = _mm256_cmp_pd(v0, best0, _CMP_GT_OQ);
                const __m256d m1 = _mm256_cmp_pd(v1, best1, _CMP_GT_OQ);
                best0 = _mm256_blendv_pd(best0, v0, m0);
                best1 = _mm256_blendv_pd(best1, v1, m1);
                at0 = _mm256_blendv_pd(at0, id, m0);
                at1 = _mm256_blendv_pd(at1, id, m1);
            }
        }
        _mm_storeu_ps(out + j, _mm256_cvtpd_ps(best0));
        _mm_storeu_ps(out + j + 4, _mm256_cvtpd_ps(best1));
        if (arg != NULL) {
            double ids[8];
            _mm256_storeu_pd(ids, at0);
            _mm256_storeu_pd(ids + 4, at1);
            for (int q = 0; q < 8; q++) arg[j + q] = (int64_t)ids[q];
        }
    }
    for (; j < n; j++) {
        const double t = (double)x[j];
        double best = 0.0;
        int64_t where = -1;
        for (int side = 0; side < 2; side++) {
            const struct lines *S = sets[side];
            for (int64_t k = 0; k < S->count; k++) {
                const double val = S->icpt[k] + S->slope[k] * t;
                if (val > best) {
                    best = val;
                    where = S->id[k];
                }
            }
        }
        out[j] = (float)best;
        if (arg != NULL) arg[j] = where;
    }
    return 1;
}

/* ---- sums of |affine| terms: prefix sums over sorted x ---------------------------------------- */

struct prefix {
    const double *x;   /* sorted ascending, [n] */
    double *w0, *w1;   /* prefix sums of w and w x, [n + 1] */
    double abs0, abs1; /* sum |w| and sum |w x|: the scale of the rounding error */
};

static void prefix_build(struct prefix *p, const double *xs, const double *w, int64_t n) {
    p->x = xs;
    p->w0[0] = p->w1[0] = 0.0;
    p->abs0 = p->abs1 = 0.0;
    for (int64_t k = 0; k < n; k++) {
        p->w0[k + 1] = p->w0[k] + w[k];
        p->w1[k + 1] = p->w1[k] + w[k] * xs[k];
        p->abs0 += fabs(w[k]);
        p->abs1 += fabs(w[k] * xs[k]);
    }
}

/* Walks over sorted queries t: for each, the entries with 1 + x t >= 0 are a suffix (t > 0,
   x >= -1/t) or a prefix (t < 0, x <= -1/t), and -1/t increases with t on either side of 0, so
   one forward-moving boundary per side serves every query. */
struct walk {
    int64_t neg; /* for t < 0: the count of entries with x <= -1/t so far */
    int64_t pos; /* for t > 0: the first entry with x >= -1/t so far */
};

/* sum_k w_k |1 + x_k t| for the next query t (ascending), and in *err a bound of its rounding. */
static double prefix_abs_sum(const struct prefix *p, int64_t n, double t, struct walk *walk,
                             double *err) {
    const double all0 = p->w0[n], all1 = p->w1[n];
    *err = 3.0 * (double)(n + 8) * DBL_EPSILON * (p->abs0 + fabs(t) * p->abs1);
    if (t == 0.0) return all0;
    const double edge = -1.0 / t;
    double pos0, pos1;
    if (t > 0.0) {
        while (walk->pos < n && p->x[walk->pos] < edge) walk->pos++;
        pos0 = all0 - p->w0[walk->pos];
        pos1 = all1 - p->w1[walk->pos];
    } else {
        while (walk->neg < n && p->x[walk->neg] <= edge) walk->neg++;
        pos0 = p->w0[walk->neg];
        pos1 = p->w1[walk->neg];
    }
    return 2.0 * (pos0 + t * pos1) - (all0 + t * all1);
}

/* ---- U: a tree over sorted x with far-field series ------------------------------------------- */

struct node {
    int64_t lo, hi;      /* sorted entries [lo, hi) */
    int64_t left, right; /* children (-1: a leaf) */
    double centre, half; /* x range as centre +- half */
    double coef[SERIES_TERMS + 1]; /* M_0, M_1, M_k / (k (k - 1)) for k >= 2; M_k = sum a (x - c)^k */
};

/* Nodes of at most this many entries sum their moments directly; larger ones move their
   children's moments to their own centre (binomial expansion, SERIES_TERMS^2 / 2 operations per
   child instead of one power series per entry and level: the direct build was a quarter of a
   ResNet-18 batch norm's Entropy sums). */
#define DIRECT_MOMENTS 32

/* Builds the node for sorted entries [lo, hi) and its subtree; ``raw``: its moments
   sum a (x - centre)^k, k = 0..SERIES_TERMS, for the parent. */
static int64_t tree_build(struct node *nodes, int64_t *count, const double *xs, const double *as,
                          int64_t lo, int64_t hi, double raw[SERIES_TERMS + 1]) {
    const int64_t id = (*count)++;
    struct node *nd = &nodes[id];
    nd->lo = lo;
    nd->hi = hi;
    const double centre = 0.5 * (xs[lo] + xs[hi - 1]);
    nd->centre = centre;
    nd->half = 0.5 * (xs[hi - 1] - xs[lo]);
    double m[SERIES_TERMS + 1] = {0};
    int64_t left = -1, right = -1;
    if (hi - lo > LEAF_SIZE) {
        const int64_t mid = lo + (hi - lo) / 2;
        double ml[SERIES_TERMS + 1], mr[SERIES_TERMS + 1];
        left = tree_build(nodes, count, xs, as, lo, mid, ml);
        right = tree_build(nodes, count, xs, as, mid, hi, mr);
        if (hi - lo > DIRECT_MOMENTS) {
            /* M_k = sum_j C(k, j) d^(k - j) m_j, d = child centre - centre */
            const double *child[2] = {ml, mr};
            const double shift[2] = {nodes[left].centre - centre, nodes[right].centre - centre};
            for (int c = 0; c < 2; c++) {
                double power[SERIES_TERMS + 1];
                power[0] = 1.0;
                for (int e = 1; e <= SERIES_TERMS; e++) power[e] = power[e - 1] * shift[c];
                for (int k = 0; k <= SERIES_TERMS; k++) {
                    double binom = 1.0, sum = 0.0; /* C(k, j) for j = k, k-1, ... */
                    for (int j = k; j >= 0; j--) {
                        sum += binom * power[k - j] * child[c][j];
                        binom = binom * (double)j / (double)(k - j + 1);
                    }
                    m[k] += sum;
                }
            }
        }
    }
    if (hi - lo <= DIRECT_MOMENTS) {
        for (int64_t k = lo; k < hi; k++) {
            const double d = xs[k] - centre;
            double power = as[k];
            for (int e = 0; e <= SERIES_TERMS; e++) {
                m[e] += power;
                power *= d;
            }
        }
    }
    nd = &nodes[id];
    nd->left = left;
    nd->right = right;
    nd->coef[0] = m[0];
    nd->coef[1] = m[1];
    for (int e = 2; e <= SERIES_TERMS; e++) nd->coef[e] = m[e] / (double)(e * (e - 1));
    for (int e = 0; e <= SERIES_TERMS; e++) raw[e] = m[e];
    return id;
}

/* U's tree walk takes U_LANES queries at once: 4 doubles (AVX2) or 8 (AVX-512) per vector,
   through the few operations below, written once. A lane's sum does not depend on the lanes
   beside it: it visits the nodes whose ancestors were all near for it, far ones through their
   series and leaves directly, in the same depth-first order, with the same operations. So each
   query's U has the same bits in both builds, in half the walks with 8 lanes. Masks are vectors
   in AVX2 and mask registers in AVX-512; the walk's stack keeps them as lane bits. */
#if defined(__AVX512F__)
#define U_LANES 8
typedef __m512d vd;
typedef __mmask8 vmask;
static inline vd vd_set1(double x) { return _mm512_set1_pd(x); }
static inline vd vd_load(const double *p) { return _mm512_loadu_pd(p); }
static inline void vd_store(double *p, vd v) { _mm512_storeu_pd(p, v); }
static inline vd vd_add(vd a, vd b) { return _mm512_add_pd(a, b); }
static inline vd vd_sub(vd a, vd b) { return _mm512_sub_pd(a, b); }
static inline vd vd_mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
static inline vd vd_div(vd a, vd b) { return _mm512_div_pd(a, b); }
static inline vd vd_fmadd(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
static inline vd vd_max(vd a, vd b) { return _mm512_max_pd(a, b); }
static inline vd vd_xor(vd a, vd b) { return _mm512_xor_pd(a, b); }
static inline vd vd_andnot(vd a, vd b) { return _mm512_andnot_pd(a, b); }
static inline vd vd_or_bits(vd a, long long bits) {
    return _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(a), _mm512_set1_epi64(bits)));
}
static inline vd vd_and_bits(vd a, long long bits) {
    return _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(a), _mm512_set1_epi64(bits)));
}
/* the biased exponent field (bits 52..62) of each lane, kept as an integer in the lane */
static inline vd vd_exponent_bits(vd a) {
    return _mm512_castsi512_pd(_mm512_srli_epi64(_mm512_castpd_si512(a), 52));
}
static inline vmask vd_cmp_gt(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ); }
static inline vmask vd_cmp_le(vd a, vd b) { return _mm512_cmp_pd_mask(a, b, _CMP_LE_OQ); }
static inline vd vd_select(vmask m, vd if_set, vd if_clear) {
    return _mm512_mask_blend_pd(m, if_clear, if_set);
}
static inline vd vd_keep(vmask m, vd a) { return _mm512_maskz_mov_pd(m, a); }
static inline vmask vm_and(vmask a, vmask b) { return a & b; }
static inline vmask vm_andnot(vmask a, vmask b) { return (vmask)(~a & b); }
static inline int vm_bits(vmask m) { return (int)m; }
static inline vmask vm_from_bits(int bits) { return (vmask)bits; }
#else
#define U_LANES 4
typedef __m256d vd;
typedef __m256d vmask;
static inline vd vd_set1(double x) { return _mm256_set1_pd(x); }
static inline vd vd_load(const double *p) { return _mm256_loadu_pd(p); }
static inline void vd_store(double *p, vd v) { _mm256_storeu_pd(p, v); }
static inline vd vd_add(vd a, vd b) { return _mm256_add_pd(a, b); }
static inline vd vd_sub(vd a, vd b) { return _mm256_sub_pd(a, b); }
static inline vd vd_mul(vd a, vd b) { return _mm256_mul_pd(a, b); }
static inline vd vd_div(vd a, vd b) { return _mm256_div_pd(a, b); }
static inline vd vd_fmadd(vd a, vd b, vd c) { return _mm256_fmadd_pd(a, b, c); }
static inline vd vd_max(vd a, vd b) { return _mm256_max_pd(a, b); }
static inline vd vd_xor(vd a, vd b) { return _mm256_xor_pd(a, b); }
static inline vd vd_andnot(vd a, vd b) { return _mm256_andnot_pd(a, b); }
static inline vd vd_or_bits(vd a, long long bits) {
    return _mm256_castsi256_pd(_mm256_or_si256(_mm256_castpd_si256(a), _mm256_set1_epi64x(bits)));
}
static inline vd vd_and_bits(vd a, long long bits) {
    return _mm256_castsi256_pd(_mm256_and_si256(_mm256_castpd_si256(a), _mm256_set1_epi64x(bits)));
}
static inline vd vd_exponent_bits(vd a) {
    return _mm256_castsi256_pd(_mm256_srli_epi64(_mm256_castpd_si256(a), 52));
}
static inline vmask vd_cmp_gt(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_GT_OQ); }
static inline vmask vd_cmp_le(vd a, vd b) { return _mm256_cmp_pd(a, b, _CMP_LE_OQ); }
static inline vd vd_select(vmask m, vd if_set, vd if_clear) {
    return _mm256_blendv_pd(if_clear, if_set, m);
}
static inline vd vd_keep(vmask m, vd a) { return _mm256_and_pd(m, a); }
static inline vmask vm_and(vmask a, vmask b) { return _mm256_and_pd(a, b); }
static inline vmask vm_andnot(vmask a, vmask b) { return _mm256_andnot_pd(a, b); }
static inline int vm_bits(vmask m) { return _mm256_movemask_pd(m); }
static inline vmask vm_from_bits(int bits) {
    const __m256i lane_bits = _mm256_setr_epi64x(1, 2, 4, 8);
    return _mm256_castsi256_pd(
        _mm256_cmpeq_epi64(_mm256_and_si256(lane_bits, _mm256_set1_epi64x(bits)), lane_bits));
}
#endif

/* log x per lane, x > 0 finite and normal: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
   log m = 2 atanh(f / (2 + f)), f = m - 1, as the odd series in s = f / (2 + f) (|s| <= 0.172,
   ten terms reach 1e-17), and e ln 2 with ln 2 split in two: within a few ulp of libm's log. */
static inline vd log_vd(vd x) {
    vd m = vd_or_bits(vd_and_bits(x, 0x000fffffffffffffLL), 0x3ff0000000000000LL);
    /* the biased exponent as a double: 2^52 + e written into the mantissa, minus 2^52 */
    vd e = vd_sub(vd_or_bits(vd_exponent_bits(x), 0x4330000000000000LL),
                  vd_set1(4503599627370496.0 + 1023.0));
    const vmask big = vd_cmp_gt(m, vd_set1(1.4142135623730951));
    m = vd_select(big, vd_mul(m, vd_set1(0.5)), m);
    e = vd_select(big, vd_add(e, vd_set1(1.0)), e);
    const vd f = vd_sub(m, vd_set1(1.0));
    const vd sv = vd_div(f, vd_add(f, vd_set1(2.0)));
    const vd z = vd_mul(sv, sv);
    vd p = vd_set1(1.0 / 21.0);
    for (int k = 9; k >= 1; k--) p = vd_fmadd(p, z, vd_set1(1.0 / (2 * k + 1)));
    /* log m = 2 s + 2 s z p */
    const vd two_s = vd_add(sv, sv);
    const vd log_m = vd_fmadd(vd_mul(two_s, z), p, two_s);
    return vd_fmadd(e, vd_set1(6.93147180369123816490e-01),
                    vd_fmadd(e, vd_set1(1.90821492927058770002e-10), log_m));
}

/* sum_i a_i |1 + x_i t| log |1 + x_i t| over the tree, for U_LANES queries at once (neighbours in
   sorted order, so their walks through the tree nearly coincide): each visited node takes the
   lanes that reach it; far lanes add the series, the others open it. */
static void tree_xlogx(const struct node *nodes, const double *xs, const double *as,
                       const double *tq, double *out) {
    int64_t stack[2 * MAX_DEPTH];
    int masks[2 * MAX_DEPTH];
    int top = 0;
    const vd sign = vd_set1(-0.0), one = vd_set1(1.0);
    const vd zero = vd_set1(0.0), rho = vd_set1(FAR_RATIO);
    const vd tiny = vd_set1(DBL_MIN);
    const vd t = vd_load(tq), at = vd_andnot(sign, t);
    vd total = zero;
    stack[top] = 0;
    masks[top++] = (1 << U_LANES) - 1;
    while (top > 0) {
        top--;
        const struct node *nd = &nodes[stack[top]];
        const vmask lanes = vm_from_bits(masks[top]);
        const vd u0 = vd_fmadd(vd_set1(nd->centre), t, one);
        const vd v = vd_andnot(sign, u0);
        const vmask far =
            vm_and(lanes, vd_cmp_le(vd_mul(vd_set1(nd->half), at), vd_mul(rho, v)));
        const int far_lanes = vm_bits(far);
        if (far_lanes) {
            const vmask live = vm_and(far, vd_cmp_gt(v, zero));
            const vd st = vd_select(vd_cmp_gt(u0, zero), t, vd_xor(t, sign));
            const vd vs = vd_max(v, tiny);
            const vd w = vd_div(vd_xor(st, sign), vs);
            const vd w2 = vd_mul(w, w);
            vd even = vd_set1(nd->coef[SERIES_TERMS]);
            vd odd = vd_set1(nd->coef[SERIES_TERMS - 1]);
            for (int e = SERIES_TERMS - 2; e >= 4; e -= 2) {
                even = vd_fmadd(even, w2, vd_set1(nd->coef[e]));
                odd = vd_fmadd(odd, w2, vd_set1(nd->coef[e - 1]));
            }
            even = vd_fmadd(even, w2, vd_set1(nd->coef[2]));
            const vd series = vd_mul(w2, vd_fmadd(w, odd, even));
            const vd m0 = vd_set1(nd->coef[0]), m1 = vd_set1(nd->coef[1]);
            const vd st_m1 = vd_mul(st, m1);
            const vd lead = vd_fmadd(vs, m0, st_m1);
            const vd term = vd_fmadd(lead, log_vd(vs), vd_fmadd(vs, series, st_m1));
            total = vd_add(total, vd_keep(live, term));
        }
        const int near_lanes = vm_bits(lanes) & ~far_lanes;
        if (!near_lanes) continue;
        if (nd->left < 0) {
            const vmask near = vm_andnot(far, lanes);
            for (int64_t k = nd->lo; k < nd->hi; k++) {
                const vd c = vd_andnot(sign, vd_fmadd(vd_set1(xs[k]), t, one));
                const vd term = vd_mul(vd_mul(vd_set1(as[k]), c), log_vd(vd_max(c, tiny)));
                total = vd_add(total, vd_keep(vm_and(near, vd_cmp_gt(c, zero)), term));
            }
        } else {
            stack[top] = nd->right;
            masks[top++] = near_lanes;
            stack[top] = nd->left;
            masks[top++] = near_lanes;
        }
    }
    vd_store(out, total);
}

/* ---- rows ----------------------------------------------------------------------------------- */

/* One row of S, T, U. Only the entries with a_i > 0 are sources (a ReLU or an unreached
   entry upstream zeroes many: 84% of the first batch norm of ResNet-18 in training); every
   entry is a query. ``work``: 8 n + 4 doubles; ``ranks``: 4 n words. */
static void row_sums(const float *a, const float *r, const float *x, int64_t n, int with_u,
                     double *work, uint32_t *ranks, struct node *nodes, float *s_out,
                     float *t_out, float *u_out) {
    double *queries = work, *xs = queries + n, *as = xs + n, *ar = as + n;
    double *p0 = ar + n, *p1 = p0 + (n + 1), *q0 = p1 + (n + 1), *q1 = q0 + (n + 1);
    uint32_t *order_x = ranks;
    sort_order(x, n, order_x, ranks + n);
    double rmax = 0.0;
    int64_t sources = 0;
    for (int64_t k = 0; k < n; k++) {
        const uint32_t i = order_x[k];
        queries[k] = (double)x[i];
        if (!(a[i] > 0.0f)) continue;
        xs[sources] = (double)x[i];
        as[sources] = (double)a[i];
        ar[sources] = r != NULL ? (double)a[i] * (double)r[i] : 0.0;
        if (r != NULL && fabs((double)r[i]) > rmax) rmax = fabs((double)r[i]);
        sources++;
    }
    if (sources == 0) {
        for (int64_t j = 0; j < n; j++) {
            s_out[j] = 0.0f;
            if (t_out != NULL) t_out[j] = 0.0f;
            if (with_u) u_out[j] = 0.0f;
        }
        return;
    }
    struct prefix ps = {.w0 = p0, .w1 = p1}, pt = {.w0 = q0, .w1 = q1};
    prefix_build(&ps, xs, as, sources);
    if (r != NULL) prefix_build(&pt, xs, ar, sources);
    int64_t count = 0;
    double root_moments[SERIES_TERMS + 1];
    if (with_u) tree_build(nodes, &count, xs, as, 0, sources, root_moments);
    struct walk ws = {0, 0}, wt = {0, 0};
    for (int64_t k = 0; k < n; k++) {
        const double t = queries[k];
        double err_s, err_t = 0.0;
        double s = prefix_abs_sum(&ps, sources, t, &ws, &err_s);
        double tt = r != NULL ? prefix_abs_sum(&pt, sources, t, &wt, &err_t) : 0.0;
        if (err_s > CERTIFY * fabs(s) || err_t > CERTIFY * fabs(s) * (rmax > 1.0 ? rmax : 1.0)) {
            s = tt = 0.0; /* cancellation: the direct sum */
            for (int64_t i = 0; i < sources; i++) {
                const double c = fabs(1.0 + xs[i] * t);
                s += as[i] * c;
                tt += ar[i] * c;
            }
        }
        const uint32_t j = order_x[k];
        s_out[j] = (float)s;
        if (t_out != NULL) t_out[j] = (float)tt;
    }
    if (!with_u) return;
    for (int64_t k = 0; k < n; k += U_LANES) {
        double tq[U_LANES], uq[U_LANES];
        for (int lane = 0; lane < U_LANES; lane++) tq[lane] = queries[k + lane < n ? k + lane : n - 1];
        tree_xlogx(nodes, xs, as, tq, uq);
        for (int lane = 0; lane < U_LANES && k + lane < n; lane++)
            u_out[order_x[k + lane]] = (float)uq[lane];
    }
}

/* Both envelope kernels compare lines in double precision, relative to the lines' own size: a
   line far below the others (a weight of 1e-30 beside weights of 1) can be dropped where the
   others cancel exactly (1 + x_i t = 0 at a query), and the maximum there would read 0, "no
   path", where the definition has one. The dropped line is below the kept ones by at most a
   few double roundings of the row's scale at t, amax + bmax |t| (amax, bmax the largest a_i and
   |a_i x_i|), so every maximum above CERTIFY_MAX of that scale is exact to far below float32
   rounding; the columns below it (exact cancellations: rare on real rows) are recomputed
   directly, over every line. */
#define CERTIFY_MAX 9.5367431640625e-07 /* 2^-20 */

static void certify_max_row(const float *a, const float *x, int64_t n, float *out,
                            int64_t *arg) {
    float amax = 0.0f, bmax = 0.0f; /* a >= 0 and finite here: plain comparisons vectorise */
    for (int64_t k = 0; k < n; k++) {
        const float b = fabsf(a[k] * x[k]);
        amax = a[k] > amax ? a[k] : amax;
        bmax = b > bmax ? b : bmax;
    }
    const double floor_a = CERTIFY_MAX * (double)amax, floor_b = CERTIFY_MAX * (double)bmax;
    for (int64_t j = 0; j < n; j++) {
        const double t = (double)x[j];
        if ((double)out[j] >= floor_a + floor_b * fabs(t)) continue;
        double best = 0.0;
        int64_t where = -1;
        for (int64_t i = 0; i < n; i++) { /* the kernels' line: a_i + (float32 a_i x_i) t */
            const double value = fabs((double)a[i] + (double)(a[i] * x[i]) * t);
            if (value > best) {
                best = value;
                where = i;
            }
        }
        out[j] = (float)best;
        if (arg != NULL) arg[j] = where;
    }
}

/* Work doubles per row for row_sums (row_max needs fewer). */
static size_t work_doubles(int64_t n) { return 8 * (size_t)n + 4; }

/* Returns 0, or -1 when a thread could not allocate its work buffers. ``arg`` may be NULL. */
int semipack_norm_sorted_max_f32(const float *a, const float *x, int64_t rows, int64_t n,
                                 float *out, int64_t *arg, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        double *work = (double *)malloc(work_doubles(n) * sizeof(double));
        int64_t *hull = (int64_t *)malloc(2 * (size_t)n * sizeof(int64_t));
        uint32_t *ranks = (uint32_t *)malloc(5 * (size_t)n * sizeof(uint32_t));
        if (work == NULL || hull == NULL || ranks == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t row = 0; row < rows; row++) {
                int64_t *row_arg = arg != NULL ? arg + row * n : NULL;
                if (!row_max_candidates(a + row * n, x + row * n, n, work, out + row * n,
                                        row_arg))
                    row_max(a + row * n, x + row * n, n, work, hull, hull + n, ranks,
                            out + row * n, row_arg);
                certify_max_row(a + row * n, x + row * n, n, out + row * n, row_arg);
            }
        }
        free(work);
        free(hull);
        free(ranks);
    }
    return failed ? -1 : 0;
}

/* S (and T when r is not NULL, U when u is not NULL) per row; see the top of the file. */
int semipack_norm_sorted_sums_f32(const float *a, const float *r, const float *x, int64_t rows,
                                  int64_t n, float *s, float *t, float *u, int threads) {
    int failed = 0;
    const size_t max_nodes = (size_t)n + 8; /* halving leaves hold >= LEAF_SIZE / 2 */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        double *work = (double *)malloc(work_doubles(n) * sizeof(double));
        uint32_t *ranks = (uint32_t *)malloc(4 * (size_t)n * sizeof(uint32_t));
        struct node *nodes =
            u != NULL ? (struct node *)malloc(max_nodes * sizeof(struct node)) : NULL;
        if (work == NULL || ranks == NULL || (u != NULL && nodes == NULL)) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t row = 0; row < rows; row++)
                row_sums(a + row * n, r != NULL ? r + row * n : NULL, x + row * n, n, u != NULL,
                         work, ranks, nodes, s + row * n, t != NULL ? t + row * n : NULL,
                         u != NULL ? u + row * n : NULL);
        }
        free(work);
        free(ranks);
        free(nodes);
    }
    return failed ? -1 : 0;
}
