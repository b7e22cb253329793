/* The pair reductions of normalisation rows in O(n log n) instead of O(n^2) (see
   ../normalization.py for the algebra and normalization.c for the all-pairs kernels whose values
   these reproduce). Per row and output j, over every input i, with c_ij = |1 + x_i x_j|:

       max:      P_j = max_i a_i c_ij
       sums:     S_j = sum_i a_i c_ij,   T_j = sum_i a_i r_i c_ij
       entropy:  S_j, T_j and U_j = sum_i a_i c_ij log c_ij

   Why this is possible: seen from output j, with t = x_j, every term is a function of one
   affine form 1 + x_i t. So

   - the max is the larger of two upper envelopes of lines, a_i + (a_i x_i) t and its negation:
     sort the lines by slope once, keep the envelope (a stack), walk it with the sorted t;
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
   FAR_RATIO^(K+1) / (K (K+1) (1 - FAR_RATIO)) sum a_i |u0| < 3e-9 S_j. Results are within
   float32 rounding of the all-pairs kernels'. Each row is sorted here (a radix sort of the
   float32 keys, about 3 n passes: torch's argsort costs ten times more). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SERIES_TERMS 20 /* even: see the Horner chains in tree_xlogx */
#define FAR_RATIO 0.5
#define LEAF_SIZE 8
#define MAX_DEPTH 64
/* Relative error allowed for a prefix-sum result before the column is recomputed directly. */
#define CERTIFY 1.4901161193847656e-08 /* 2^-26 */

/* ---- sorting: an LSD radix sort of float32 keys, three passes of 11 bits ------------------- */

#define RADIX_BITS 11
#define RADIX_SIZE (1 << RADIX_BITS)

/* The float's bits mapped so that unsigned order is numeric order (negatives reversed). */
static inline uint32_t ordered_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* order[k]: the index of the k-th smallest key (stable). ``scratch``: 3 n uint32 words. */
static void sort_order(const float *key, int64_t n, uint32_t *order, uint32_t *scratch) {
    uint32_t *bits = scratch, *bits_alt = bits + n, *order_alt = bits_alt + n;
    for (int64_t k = 0; k < n; k++) {
        bits[k] = ordered_bits(key[k]);
        order[k] = (uint32_t)k;
    }
    for (int shift = 0; shift < 32; shift += RADIX_BITS) {
        uint32_t count[RADIX_SIZE + 1] = {0};
        for (int64_t k = 0; k < n; k++) count[((bits[k] >> shift) & (RADIX_SIZE - 1)) + 1]++;
        for (int b = 0; b < RADIX_SIZE; b++) count[b + 1] += count[b];
        for (int64_t k = 0; k < n; k++) {
            const uint32_t dest = count[(bits[k] >> shift) & (RADIX_SIZE - 1)]++;
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

/* out[q] = max(out[q], envelope at t[q]) for t ascending. */
static void envelope_max(const double *slope, const double *icpt, const int64_t *hull, int64_t h,
                         const double *t, int64_t n, double *out) {
    int64_t p = 0;
    for (int64_t q = 0; q < n; q++) {
        double best = icpt[hull[p]] + slope[hull[p]] * t[q];
        while (p + 1 < h) {
            const double next = icpt[hull[p + 1]] + slope[hull[p + 1]] * t[q];
            if (next < best) break;
            best = next;
            p++;
        }
        if (best > out[q]) out[q] = best;
    }
}

/* One row of max_i a_i |1 + x_i x_j|. ``work``: 4 n doubles; ``hull``: n; ``ranks``: 5 n words. */
static void row_max(const float *a, const float *x, int64_t n, double *work, int64_t *hull,
                    uint32_t *ranks, float *out) {
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
    for (int64_t k = 0; k < n; k++) best[k] = 0.0;
    int64_t h = upper_envelope(slope, icpt, n, hull);
    envelope_max(slope, icpt, hull, h, t, n, best);
    /* the negated lines, -a_i - (a_i x_i) t, sorted by slope: the same order reversed */
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
    h = upper_envelope(slope, icpt, n, hull);
    envelope_max(slope, icpt, hull, h, t, n, best);
    for (int64_t k = 0; k < n; k++) out[order_x[k]] = (float)best[k];
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

static int64_t tree_build(struct node *nodes, int64_t *count, const double *xs, const double *as,
                          int64_t lo, int64_t hi) {
    const int64_t id = (*count)++;
    struct node *nd = &nodes[id];
    nd->lo = lo;
    nd->hi = hi;
    nd->centre = 0.5 * (xs[lo] + xs[hi - 1]);
    nd->half = 0.5 * (xs[hi - 1] - xs[lo]);
    double m[SERIES_TERMS + 1] = {0};
    for (int64_t k = lo; k < hi; k++) {
        const double d = xs[k] - nd->centre;
        double power = as[k];
        for (int e = 0; e <= SERIES_TERMS; e++) {
            m[e] += power;
            power *= d;
        }
    }
    nd->coef[0] = m[0];
    nd->coef[1] = m[1];
    for (int e = 2; e <= SERIES_TERMS; e++) nd->coef[e] = m[e] / (double)(e * (e - 1));
    if (hi - lo <= LEAF_SIZE) {
        nd->left = nd->right = -1;
    } else {
        const int64_t mid = lo + (hi - lo) / 2;
        const int64_t left = tree_build(nodes, count, xs, as, lo, mid);
        const int64_t right = tree_build(nodes, count, xs, as, mid, hi);
        nodes[id].left = left;
        nodes[id].right = right;
    }
    return id;
}

static inline double xlogx_abs(double u) {
    const double v = fabs(u);
    return v > 0.0 ? v * log(v) : 0.0;
}

/* sum_i a_i |1 + x_i t| log |1 + x_i t| over the tree. */
static double tree_xlogx(const struct node *nodes, const double *xs, const double *as, double t) {
    int64_t stack[2 * MAX_DEPTH];
    int64_t top = 0;
    double total = 0.0;
    stack[top++] = 0;
    const double at = fabs(t);
    while (top > 0) {
        const struct node *nd = &nodes[stack[--top]];
        const double u0 = 1.0 + nd->centre * t;
        const double v = fabs(u0);
        if (nd->half * at <= FAR_RATIO * v) {
            if (v == 0.0) continue; /* half * t == 0 and u0 == 0: every term is 0 log 0 = 0 */
            /* (v + e) log (v + e) summed, e = sign(u0) t (x - c), z = e / v, |z| <= FAR_RATIO:
               = (v M0 + s t M1) log v + s t M1 + v sum_{k>=2} w^k M_k / (k (k-1)), w = -s t / v */
            const double st = u0 > 0.0 ? t : -t;
            const double w = -st / v;
            /* Horner in w^2 on the even and the odd coefficients: two independent chains */
            const double w2 = w * w;
            double even = nd->coef[SERIES_TERMS], odd = nd->coef[SERIES_TERMS - 1];
            for (int e = SERIES_TERMS - 2; e >= 4; e -= 2) {
                even = even * w2 + nd->coef[e];
                odd = odd * w2 + nd->coef[e - 1];
            }
            even = even * w2 + nd->coef[2];
            const double series = w2 * (even + w * odd);
            total += (v * nd->coef[0] + st * nd->coef[1]) * log(v) + st * nd->coef[1] + v * series;
        } else if (nd->left < 0) {
            for (int64_t k = nd->lo; k < nd->hi; k++) total += as[k] * xlogx_abs(1.0 + xs[k] * t);
        } else {
            stack[top++] = nd->right;
            stack[top++] = nd->left;
        }
    }
    return total;
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
    if (with_u) tree_build(nodes, &count, xs, as, 0, sources);
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
        if (with_u) u_out[j] = (float)tree_xlogx(nodes, xs, as, t);
    }
}

/* Work doubles per row for row_sums (row_max needs fewer). */
static size_t work_doubles(int64_t n) { return 8 * (size_t)n + 4; }

/* Returns 0, or -1 when a thread could not allocate its work buffers. */
int semipack_norm_sorted_max_f32(const float *a, const float *x, int64_t rows, int64_t n,
                                 float *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        double *work = (double *)malloc(work_doubles(n) * sizeof(double));
        int64_t *hull = (int64_t *)malloc((size_t)n * sizeof(int64_t));
        uint32_t *ranks = (uint32_t *)malloc(5 * (size_t)n * sizeof(uint32_t));
        if (work == NULL || hull == NULL || ranks == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t row = 0; row < rows; row++)
                row_max(a + row * n, x + row * n, n, work, hull, ranks, out + row * n);
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
