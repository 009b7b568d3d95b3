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
