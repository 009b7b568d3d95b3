/* The matrix product of quantized weights with a batch of activation rows (quant.c quantizes
 * the activations and holds the one-row kernels; dot_avx2.c and dot_kquants_avx2.c the AVX2
 * ones): which kernel takes which (weight row, activation rows), and how the rows are shared
 * among threads and tiled for the caches. Every (weight row, activation row) is one kernel's
 * arithmetic in its fixed order, whatever the tiling — so no choice made here changes a bit.
 */
#include "kiln.h"

/* batches up to this many activation rows take the weight rows in pairs (rows_dot); from 5 rows
 * the one-weight-row kernels of 5 to 8 rows are faster (measured: 5 rows as 3 + 2 or 4 + 1 in
 * pairs cost 4-20 % more) */
#define PAIRED_ROWS_UP_TO 4

/* an activation tile's quantized bytes (rows × K): L2-sized, so that it stays cached while a
 * thread's weight rows pass over it (measured on a 1 B Q4_K_M prefill: see docs/engine.md) */
#define ACT_TILE_BYTES (32 * 1024)
/* a block of weight rows (their bytes) that passes over every activation tile while in L2 */
#define WEIGHT_BLOCK_BYTES (512 * 1024)
/* weight rows taken at once against an activation tile (the Q4_0/Q8_0 AVX-512 kernels) */
#define WEIGHT_ROWS 4

static __thread PfQueue tl_pf;

/* not inlined: GCC would rematerialize the thread-local address (a __tls_get_addr call) in loops */
__attribute__((noinline)) PfQueue *pf_mine(void) { return &tl_pf; }

void pf_queue(PfQueue *q, const void *p, size_t bytes) {
    if (!bytes) return;
    if (q->count && q->p[q->count - 1] + q->n[q->count - 1] == (const char *)p) { q->n[q->count - 1] += bytes; return; }
    if (q->count == PF_REGIONS) return;               /* more regions: fetched when read, as before */
    q->p[q->count] = p; q->n[q->count++] = bytes;
}

static size_t lines_between(const PfQueue *q, int from, size_t off, int to) {
    size_t lines = 0;
    for (int i = from; i < to; i++) lines += (q->n[i] - (i == from ? off : 0) + 63) / 64;
    return lines;
}

void pf_begin(PfQueue *q, size_t base_bytes) {
    q->rate = base_bytes ? (double)lines_between(q, 0, 0, q->count) / (double)base_bytes : 0;
}

void pf_plan(PfQueue *q, size_t steps, size_t step_bytes) {
    const size_t due = q->due > q->at ? lines_between(q, q->at, q->off, q->due) : 0;
    const size_t even = (size_t)(q->rate * (double)step_bytes) + 1;
    q->per = steps ? (due + steps - 1) / steps : due;
    if (q->per < even) q->per = even;
}

/* Weight row n (its bytes at w; o: its weight's output, Ni columns) against activation rows
 * t … t + tn - 1: up to 8 rows at a time share each weight block's unpacking; a last single row takes the
 * one-row kernel (the same bits either way). */
static void weight_row(const Act *a, int t, int tn, int K, int type, const TypeInfo *ti, const uint8_t *w,
                       float *o, int Ni, int n) {
    const int T = t + tn;
#ifdef KILN_X86
    if (g_avx2 && has_dot4_avx2(type, K)) {
        int nb = K / ti->block; float res[8];
        const int kq = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
        if (g_avx512 && (kq || type == T_Q4_0 || type == T_Q8_0 || type == T_MXFP4))
            for (int R = 8; R >= 4; R -= 4)
                for (; t + R <= T; t += R) {
                    if (kq) dotR_kquant_avx512(type, w, a, t, nb, R, res);
                    else dotR_q8_avx512(type, w, a, t, nb, R, res);
                    for (int j = 0; j < R; j++) o[(size_t)(t + j) * Ni + n] = res[j];
                }
        for (int R; (R = T - t < 8 ? T - t : 8) >= 2 && dotR_avx2(type, w, a, t, nb, R, res); t += R)
            for (int j = 0; j < R; j++) o[(size_t)(t + j) * Ni + n] = res[j];
        if (type == T_Q4_K)
            for (; t + 8 <= T; t += 8) {
                dot8_q4_K_avx2(w, a, t, nb, res);
                for (int j = 0; j < 8; j++) o[(size_t)(t + j) * Ni + n] = res[j];
            }
        for (; t + 4 <= T; t += 4) {
            dot4_avx2(type, w, a, t, K, nb, res);
            for (int j = 0; j < 4; j++) o[(size_t)(t + j) * Ni + n] = res[j];
        }
    }
#endif
    for (; t < T; t++) o[(size_t)t * Ni + n] = dot_row(type, ti, w, a, t, K);
}

/* A weight row for weight_rows: its bytes, its weight's output (N columns) and its row there */
typedef struct { const uint8_t *w; float *o; int N, n; } WRow;

/* nr weight rows (1 to 4) against activation rows t … t + tn - 1: the several-weight-row kernels
 * where the type has them (each activation block loaded once for all), the rest one weight row at
 * a time — the same bits either way. */
static void weight_rows(const Act *a, int t, int tn, int K, int type, const TypeInfo *ti, const WRow *wr, int nr) {
    const int T = t + tn;
    int k = 0;
#ifdef KILN_X86
    if (g_avx512 && nr >= 2 && has_dot4_avx2(type, K)) {
        const int nb = K / ti->block, nw = nr & ~1, t0 = t;
        const uint8_t *w[4] = {wr[0].w, wr[1].w, nw > 2 ? wr[2].w : NULL, nw > 2 ? wr[3].w : NULL};
        float res[32];
        for (int R = 8; R >= 4; R -= 4)
            for (; t + R <= T && dotRW_q8_avx512(type, w, nw, a, t, nb, R, res); t += R)
                for (k = 0; k < nw; k++)
                    for (int j = 0; j < R; j++) wr[k].o[(size_t)(t + j) * wr[k].N + wr[k].n] = res[k * R + j];
        for (k = 0; k < nw && t < T; k++) weight_row(a, t, T - t, K, type, ti, wr[k].w, wr[k].o, wr[k].N, wr[k].n);
        k = nw; t = t0;                       /* an odd last weight row: alone */
    }
#endif
    for (; k < nr; k++) weight_row(a, t, T - t, K, type, ti, wr[k].w, wr[k].o, wr[k].N, wr[k].n);
}

/* Every output row of nw weights (one type, one Act) as one worksharing loop: call it inside a
 * parallel region (it is an orphaned `omp for`), or alone. */
void rows_dot(const Act *a, int T, int K, int type, const TypeInfo *ti, int nw,
                     const uint8_t **W, const int *N, float **out) {
    size_t row_bytes = (size_t)(K / ti->block) * ti->bytes;
    int total = 0;
    for (int i = 0; i < nw; i++) total += N[i];
#ifdef KILN_X86
    /* not the K-quants nor Q8_0: their two-row kernels lose to the one-row ones (a Q6_K head over
       152k rows: 14 ms paired, 7.2 ms alone, one thread; a Q8_0 head of 49k rows: 2.0 ms paired,
       1.1 ms alone, two) — the Q4/Q5 ones win (SmolLM2's Q4_1 decode: 200 tok/s paired, 158 not) */
    /* ...and not rows of 2,048 values and more: read from memory, two such rows' streams at once
       lost to one (Llama-3.2-1B Q4_0 decode 26.2 paired, 29.3 not; Qwen3-0.6B's 1,024 even;
       SmolLM2's 576 paired 142, not 130 tok/s — in one process, alternating) */
    if (g_avx2 && T <= PAIRED_ROWS_UP_TO && K < 2048 &&
            (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1)) {
        /* a decode step, a few sequences, a short draft: weight rows in pairs (twice the chains
           in flight, each activation block loaded once for both); a pair that would straddle two
           weights, and an odd last row, go one weight row at a time (the same bits: every
           (weight row, activation row) is the one-row kernel's arithmetic) */
        const int nb = K / ti->block, pairs = (total + 1) / 2;
        PfQueue *pf = pf_mine();
        if (pf->count) {
            int nth = 1;
#ifdef _OPENMP
            nth = omp_get_num_threads();
#endif
            pf_plan(pf, (size_t)(pairs + nth - 1) / nth, 2 * row_bytes);
        }
        #pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++) {
            if (pf->count) pf_pump(pf);
            int r = 2 * p, i = 0, n = r;
            while (n >= N[i]) n -= N[i++];
            if (n + 1 < N[i]) {
                const uint8_t *w = W[i] + (size_t)n * row_bytes;
                float res[8], *o = out[i];
                const int Ni = N[i];
                for (int t = 0, R; t < T; t += R) {
                    R = T - t < PAIRED_ROWS_UP_TO ? T - t : PAIRED_ROWS_UP_TO;
                    if (R == 1) dotW2_avx2(type, w, row_bytes, a, t, nb, res);
                    else dotRW2_avx2(type, w, row_bytes, a, t, nb, R, res);
                    for (int j = 0; j < R; j++) {
                        o[(size_t)(t + j) * Ni + n] = res[j];
                        o[(size_t)(t + j) * Ni + n + 1] = res[R + j];
                    }
                }
                continue;
            }
            weight_row(a, 0, T, K, type, ti, W[i] + (size_t)n * row_bytes, out[i], N[i], n);
            if (r + 1 < total) weight_row(a, 0, T, K, type, ti, W[i + 1], out[i + 1], N[i + 1], 0);
        }
        return;
    }
#endif
    /* A thread's weight rows (the static schedule's share) meet the activations in tiles: a block
       of weight rows small enough for L2 passes over the activations a tile of rows at a time, the
       tile small enough for L1. A weight row against all T rows at once streamed the whole
       activation matrix (4 MiB for 512 rows of an 8192-wide FFN) from memory per weight row. */
    int r0, r1;
    thread_share(total, &r0, &r1);
    PfQueue *pf = pf_mine();
    if (pf->count) pf_plan(pf, (size_t)(r1 - r0), row_bytes);
    /* float activations (F16, BF16, F32 weights) are tiled as well: 4 bytes an element, not 1
       (untiled, a 1,344-row F16 product ran 3x slower than 32 products of 42 rows) */
    int tile = (int)(ACT_TILE_BYTES / ((size_t)K * (a->q ? 1 : sizeof(float)))) & ~7;
    tile = tile < 8 ? 8 : tile > T ? T : tile;
    int block = (int)(WEIGHT_BLOCK_BYTES / row_bytes);
    if (block < 1) block = 1;
    for (int b0 = r0; b0 < r1; b0 += block) {
        const int b1 = b0 + block < r1 ? b0 + block : r1;
        int i0 = 0, n0 = b0;
        while (i0 < nw && n0 >= N[i0]) n0 -= N[i0++];
        for (int t0 = 0; t0 < T; t0 += tile) {
            const int tn = T - t0 < tile ? T - t0 : tile;
            for (int r = b0, i = i0, n = n0; r < b1; ) {
                WRow wr[WEIGHT_ROWS];         /* up to WEIGHT_ROWS at a time, perhaps of several weights */
                int nr = 0;
                for (; nr < WEIGHT_ROWS && r < b1; nr++, r++) {
                    if (pf->count && t0 == 0) pf_pump(pf);
                    wr[nr] = (WRow){W[i] + (size_t)n * row_bytes, out[i], N[i], n};
                    if (++n == N[i]) { n = 0; i++; }
                }
                weight_rows(a, t0, tn, K, type, ti, wr, nr);
            }
        }
    }
    #pragma omp barrier
}

/* y_i = x W_i^T for nw weights of one type that share the input x (T, K): the activations are
 * quantized once and every output row of every weight is one task of one parallel loop. A row's
 * arithmetic is the same whichever call computes it, so fusing changes no bit. */
void matmul_core(const float *x, int T, int K, int type, const TypeInfo *ti, int nw,
                        const uint8_t **W, const int *N, float **out, int nt) {
    Act a;
    act_alloc(&a, ti, x, T, K);
    #pragma omp parallel for num_threads(nt) schedule(static) if(T > 1)
    for (int t = 0; t < T; t++) act_row(&a, t, K);
    #pragma omp parallel num_threads(nt)
    rows_dot(&a, T, K, type, ti, nw, W, N, out);
    act_free(&a);
}
