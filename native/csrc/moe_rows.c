/* The routed FFN of a prompt's rows in one call: for each expert in ascending order, the rows
 * that chose it gathered, their SwiGLU FFN through its stacked weights, and each row's weighted
 * output added to it — the operations, and the order of the adds, of blocks.py moe_ffn with
 * swiglu_ffn, so every row is bit-identical to it. One parallel region for all the experts,
 * where the step-by-step path made three Python calls and two parallel regions per expert (with
 * 256 experts and 8 rows each, that was half the time of a Qwen3.5-35B-A3B prompt). */
#include "kiln.h"

/* x (T, n) float32; experts/weights (T, k): each row's chosen experts and weights; wg/wu (E, n_ff,
 * n) and wd (E, n, n_ff) stored as gu_t/wd_t; out (T, n) gets each row's sum added (the caller's
 * zeros). The caller has checked every size and that experts are in 0..E-1. */
void moe_ffn_rows(const float *x, int T, int n, const int32_t *experts, const float *weights, int k,
                  const uint8_t *wg, const uint8_t *wu, int gu_t, const uint8_t *wd, int wd_t, int n_ff, int E,
                  float *out, int nt) {
    TypeInfo tg, td;
    type_info(gu_t, &tg); type_info(wd_t, &td);
    const size_t gu_row = (size_t)(n / tg.block) * tg.bytes, d_row = (size_t)(n_ff / td.block) * td.bytes;
    /* each expert's (row, slot) pairs, experts ascending, rows ascending within one (a counting sort) */
    int *start = calloc((size_t)E + 1, sizeof(int)), *pos = malloc((size_t)E * sizeof(int));
    int *row_of = malloc((size_t)T * k * sizeof(int)), *slot_of = malloc((size_t)T * k * sizeof(int));
    for (int i = 0; i < T * k; i++) start[experts[i] + 1]++;
    int most = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1] > most) most = start[e + 1];
        start[e + 1] += start[e];
    }
    memcpy(pos, start, (size_t)E * sizeof(int));
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e = experts[(size_t)t * k + j], p = pos[e]++;
            row_of[p] = t; slot_of[p] = j;
        }
    /* a row chooses an expert once (top-k of distinct experts): an expert has at most T rows */
    float *xs = malloc((size_t)most * n * sizeof(float)), *g = malloc((size_t)most * n_ff * sizeof(float)),
          *u = malloc((size_t)most * n_ff * sizeof(float)), *y = malloc((size_t)most * n * sizeof(float));
    Act ax, ah;
    act_alloc(&ax, &tg, xs, most, n);
    act_alloc(&ah, &td, g, most, n_ff);
    #pragma omp parallel num_threads(nt)
    for (int e = 0; e < E; e++) {            /* every thread walks the same experts */
        const int R = start[e + 1] - start[e], *rows = row_of + start[e], *slots = slot_of + start[e];
        if (!R) continue;
        const uint8_t *Wgu[2] = {wg + (size_t)e * n_ff * gu_row, wu + (size_t)e * n_ff * gu_row},
                      *Wd[1] = {wd + (size_t)e * n * d_row};
        int Ngu[2] = {n_ff, n_ff}, Nd[1] = {n};
        float *Ogu[2] = {g, u}, *Od[1] = {y};
        #pragma omp for schedule(static)
        for (int r = 0; r < R; r++) {         /* a row's quantization is its own: gathered, the same bytes */
            memcpy(xs + (size_t)r * n, x + (size_t)rows[r] * n, (size_t)n * sizeof(float));
            act_row(&ax, r, n);
        }
        rows_dot(&ax, R, n, gu_t, &tg, 2, Wgu, Ngu, Ogu);
        #pragma omp for schedule(static)
        for (int r = 0; r < R; r++) {
            swiglu_row(g + (size_t)r * n_ff, u + (size_t)r * n_ff, (size_t)n_ff);
            act_row(&ah, r, n_ff);
        }
        rows_dot(&ah, R, n_ff, wd_t, &td, 1, Wd, Nd, Od);
        /* numpy's weights * y, then out += it; dealt by columns, the rows in order within each,
           so that no two threads ever add to one value */
        #pragma omp for schedule(static)
        for (int c = 0; c < (n + 63) / 64; c++)
            for (int r = 0; r < R; r++) {
                const float w = weights[(size_t)rows[r] * k + slots[r]];
                float *o = out + (size_t)rows[r] * n;
                const float *yr = y + (size_t)r * n;
                for (int i = 64 * c; i < n && i < 64 * (c + 1); i++) { float p = w * yr[i]; o[i] = o[i] + p; }
            }
    }
    act_free(&ax); act_free(&ah);
    free(start); free(pos); free(row_of); free(slot_of); free(xs); free(g); free(u); free(y);
}

/* numpy's float64 sum of n values (pairwise_sum below its block size): in order under 8, else
 * eight running sums combined pairwise, then the rest in order */
static double np_sum(const double *a, int n) {
    if (n < 8) {
        double s = 0.;
        for (int i = 0; i < n; i++) s += a[i];
        return s;
    }
    double r[8];
    for (int j = 0; j < 8; j++) r[j] = a[j];
    int i = 8;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) r[j] += a[i + j];
    double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) s += a[i];
    return s;
}

/* gpt-oss's routed FFN of one decode row (arch/gpt_oss.py BiasedMoE, the same operations): the
 * router's logits + bias, the k largest (a tie to the lower index) in that order, softmaxed as
 * ggml's scalar softmax (expf, the sum in double); each chosen expert's gate and up + biases
 * through swiglu-oai, its down + bias, times its weight; summed slot by slot into x. Every thread
 * calls it (orphaned loops), as moe_row. */
void moe_oai_row(const LayerSpec *L, float *x, const Act *ar, const Act *ag, Act *ad, float *logits, float *g,
                 float *u, float *dn, const TypeInfo *tg, const TypeInfo *td) {
    static const TypeInfo tr = {1, 4, A_F32};
    const int n = L->n, n_ff = L->n_ff, k = L->k, E = L->E;
    const size_t gu_row = (size_t)(n / tg->block) * tg->bytes, d_row = (size_t)(n_ff / td->block) * td->bytes;
    const uint8_t *Wr[1] = {(const uint8_t *)L->router}, *Wgu[2 * MAX_K];
    int Nr[1] = {E}, Ngu[2 * MAX_K], sel[MAX_K];
    float *Or[1] = {logits}, *Ogu[2 * MAX_K], w[MAX_K];
    rows_dot(ar, 1, n, T_F32, &tr, 1, Wr, Nr, Or);
    /* every thread chooses alike from the same logits (no single: the lists below are each thread's) */
    float lg[MAX_EXPERTS];
    for (int e = 0; e < E; e++) lg[e] = logits[e] + L->router_b[e];
    for (int j = 0; j < k; j++) {             /* a stable descending sort's first k */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= sel[i] == e;
            if (!taken && (best < 0 || lg[e] > lg[best])) best = e;
        }
        sel[j] = best;
    }
    float mx = lg[sel[0]];
    for (int j = 1; j < k; j++) if (lg[sel[j]] > mx) mx = lg[sel[j]];   /* NaN logits: as numpy's max would not; corrupt weights only */
    double ex[MAX_K];
    for (int j = 0; j < k; j++) { w[j] = expf(lg[sel[j]] - mx); ex[j] = (double)w[j]; }
    const float inv = (float)(1.0 / np_sum(ex, k));
    for (int j = 0; j < k; j++) w[j] = w[j] * inv;
    for (int j = 0; j < k; j++) {
        Wgu[2 * j] = L->wg + (size_t)sel[j] * n_ff * gu_row;
        Wgu[2 * j + 1] = L->wu + (size_t)sel[j] * n_ff * gu_row;
        Ngu[2 * j] = Ngu[2 * j + 1] = n_ff;
        Ogu[2 * j] = g + (size_t)j * n_ff; Ogu[2 * j + 1] = u + (size_t)j * n_ff;
    }
    rows_dot(ag, 1, n, L->gu_t, tg, 2 * k, Wgu, Ngu, Ogu);
    #pragma omp for schedule(static)
    for (int j = 0; j < k; j++) {
        float *gj = g + (size_t)j * n_ff;
        const float *uj = u + (size_t)j * n_ff, *gb = L->gate_b + (size_t)sel[j] * n_ff, *ub = L->up_b + (size_t)sel[j] * n_ff;
        for (int i = 0; i < n_ff; i++) {      /* x = min(gate, 7), y = clip(up, -7, 7): NaN stays NaN, as numpy's */
            float a = gj[i] + gb[i], b = uj[i] + ub[i];
            a = a > 7.0f ? 7.0f : a;
            b = b < -7.0f ? -7.0f : (b > 7.0f ? 7.0f : b);
            float e = expf(1.702f * -a);
            gj[i] = (a / (1.0f + e)) * (b + 1.0f);
        }
        act_row(ad, j, n_ff);
    }
    #pragma omp for schedule(static)          /* every chosen expert's down rows, one task each */
    for (int r = 0; r < k * n; r++) {
        int j = r / n, i = r % n;
        dn[r] = dot_row(L->wd_t, td, L->wd + ((size_t)sel[j] * n + i) * d_row, ad, j, n_ff);
    }
    #pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {             /* per slot w * (down + bias), summed in the chosen order */
        float acc = w[0] * (dn[i] + L->down_b[(size_t)sel[0] * n + i]);
        for (int j = 1; j < k; j++) { float p = w[j] * (dn[(size_t)j * n + i] + L->down_b[(size_t)sel[j] * n + i]); acc = acc + p; }
        x[i] = x[i] + acc;
    }
}
