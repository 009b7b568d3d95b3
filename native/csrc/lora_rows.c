/* Adapters in the one-call decode (layer.c, ffn_rows.c, delta_net.c): each row's LoRA on one
 * projection, as the block path's two F32 products, its scale and its add compute it. */
#include "kiln.h"

#ifdef KILN_X86
/* 8 weights from w + i, as floats: a float32 row's, or an fp16 row's widened (exact) */
#define LD8W(w, i, f16) ((f16) ? LD8_F16((const uint16_t *)(w) + (i)) : _mm256_loadu_ps((const float *)(w) + (i)))
#define LDW(w, i, f16) ((f16) ? H2F((const uint8_t *)(w) + 2 * (size_t)(i)) : ((const float *)(w))[i])

/* hsum_avx of eight vectors at once, the same additions of the same pairs (lanes i and i + 4,
 * then 0 + 2 and 1 + 3, then those two), the sums in order */
AVX2 static inline __attribute__((always_inline)) __m256 hsum8_avx(const __m256 *a) {
    __m256 p[4];
    for (int k = 0; k < 4; k++)                 /* [a lo | b lo] + [a hi | b hi]: 4 sums of each */
        p[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x31));
    __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(p[2], p[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* q0: [0: 0+2, 1+3; 2: 0+2, 1+3 | 1: …; 3: …], q1 the same of 4..7 */
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));   /* [0 2 4 6 | 1 3 5 7] */
}

/* n dot products of rows w (n x K, rows K apart) with x, each dot_f32_avx2's arithmetic (its own
 * chain of FMAs over the row, its lanes summed alike, the tail in order), eight chains at a time
 * (then four): one chain waits on each FMA's latency, eight keep both units busy. */
AVX2 static inline __attribute__((always_inline)) void dots(const void *w, int f16, const float *x, int K,
                                                            int n, float *out) {
    const size_t es = f16 ? 2 : 4;
    int j = 0;
    for (; j + 8 <= n; j += 8) {               /* eight chains in flight */
        const char *w0 = (const char *)w + (size_t)j * K * es;
        __m256 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= K; i += 8) {
            if (K > 64 && !((size_t)i * es & 63))   /* A's long rows: each a little ahead, once a line */
                for (int k = 0; k < 8; k++) _mm_prefetch(w0 + (size_t)k * K * es + (size_t)i * es + KILN_PF_DIST, _MM_HINT_T0);
            __m256 xv = _mm256_loadu_ps(x + i);
            for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(LD8W(w0 + (size_t)k * K * es, i, f16), xv, a[k]);
        }
        if (i == K) { _mm256_storeu_ps(out + j, hsum8_avx(a)); continue; }
        for (int k = 0; k < 8; k++) {
            const char *wk = w0 + (size_t)k * K * es;
            float r = hsum_avx(a[k]);
            for (int t = i; t < K; t++) r += LDW(wk, t, f16) * x[t];
            out[j + k] = r;
        }
    }
    for (; j + 4 <= n; j += 4) {
        const char *w0 = (const char *)w + (size_t)j * K * es, *w1 = w0 + K * es, *w2 = w1 + K * es, *w3 = w2 + K * es;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int i = 0;
        for (; i + 8 <= K; i += 8) {
            if (!((size_t)i * es & 63)) {       /* each row's bytes a little ahead, once a line */
                const size_t at = (size_t)i * es + KILN_PF_DIST;
                _mm_prefetch(w0 + at, _MM_HINT_T0); _mm_prefetch(w1 + at, _MM_HINT_T0);
                _mm_prefetch(w2 + at, _MM_HINT_T0); _mm_prefetch(w3 + at, _MM_HINT_T0);
            }
            __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(LD8W(w0, i, f16), xv, a0);
            a1 = _mm256_fmadd_ps(LD8W(w1, i, f16), xv, a1);
            a2 = _mm256_fmadd_ps(LD8W(w2, i, f16), xv, a2);
            a3 = _mm256_fmadd_ps(LD8W(w3, i, f16), xv, a3);
        }
        float r0 = hsum_avx(a0), r1 = hsum_avx(a1), r2 = hsum_avx(a2), r3 = hsum_avx(a3);
        for (; i < K; i++) {
            r0 += LDW(w0, i, f16) * x[i]; r1 += LDW(w1, i, f16) * x[i];
            r2 += LDW(w2, i, f16) * x[i]; r3 += LDW(w3, i, f16) * x[i];
        }
        out[j] = r0; out[j + 1] = r1; out[j + 2] = r2; out[j + 3] = r3;
    }
    for (; j < n; j++) {                       /* dot_f32_avx2 on one row */
        const char *wj = (const char *)w + (size_t)j * K * es;
        __m256 acc = _mm256_setzero_ps(); int i = 0;
        for (; i + 8 <= K; i += 8) acc = _mm256_fmadd_ps(LD8W(wj, i, f16), _mm256_loadu_ps(x + i), acc);
        float r = hsum_avx(acc);
        for (; i < K; i++) r += LDW(wj, i, f16) * x[i];
        out[j] = r;
    }
}
AVX2 static void dots_f32(const void *w, const float *x, int K, int n, float *out) { dots(w, 0, x, K, n, out); }
AVX2 static void dots_f16(const void *w, const float *x, int K, int n, float *out) { dots(w, 1, x, K, n, out); }
#define DOTS(p) ((p)->f16 ? dots_f16 : dots_f32)

/* The adapters of projections that share their input (q, k, v; gate, up; o; down) in two
 * passes, each value the block path's F32 products' arithmetic (dot_f32_avx2's: a row's bits do
 * not depend on the batch), then the scale, then the add. Every thread calls both, and takes its
 * share of the tasks by thread_share — the rule queue_a/b use to ask for exactly the rows it
 * will read. tmp: B x LORA_TARGETS x rmax, row b's A x for target t at (b * LORA_TARGETS + t) * rmax.
 *
 * lora_a: each row's A in[b] for each target, eight ranks a task; no barrier: the caller runs the
 * base projections next, whose loop ends in one — so the adapters cost one barrier per group
 * (lora_b's), where a pass per projection cost two. */
static inline const LoraPair *pair_of(const LoraPair *tab, int b, int t) { return &tab[(size_t)b * LORA_TARGETS + t]; }
static inline size_t esize(const LoraPair *p) { return p->f16 ? 2 : 4; }

/* lora_a's task c of B x nts targets x per: row b's target t, ranks j .. j + n (n 0: nothing to do)
 * — one rule for the pass and for the queue of the rows it reads */
typedef struct { int b, t, j, n; const LoraPair *p; } ATask;
static inline ATask a_task(const LoraPair *tab, const int *ts, int nts, int per, int c) {
    ATask k = {c / (nts * per), ts[(c / per) % nts], 8 * (c % per), 0, NULL};
    k.p = pair_of(tab, k.b, k.t);
    if (k.p->a && k.j < k.p->r) k.n = k.p->r - k.j < 8 ? k.p->r - k.j : 8;
    return k;
}

AVX2 void lora_a(const LayerSpec *L, const int *ts, int nts, const float *in, int K, int B, float *tmp, int rmax) {
    const int per = (rmax + 7) / 8;
    int c0, c1;
    thread_share(B * nts * per, &c0, &c1);
    for (int c = c0; c < c1; c++) {
        const ATask k = a_task(L->lora, ts, nts, per, c);
        if (k.n)
            DOTS(k.p)((const char *)k.p->a + (size_t)k.j * K * esize(k.p), in + (size_t)k.b * K, K, k.n,
                      tmp + ((size_t)k.b * LORA_TARGETS + k.t) * rmax + k.j);
    }
}

/* the A rows this thread's share of lora_a(ts, K, B, rmax) reads, queued for the product before it */
static void queue_a(PfQueue *q, const LoraPair *tab, const int *ts, int nts, int K, int B, int rmax) {
    const int per = (rmax + 7) / 8;
    int c0, c1;
    thread_share(B * nts * per, &c0, &c1);
    for (int c = c0; c < c1; c++) {
        const ATask k = a_task(tab, ts, nts, per, c);
        if (k.n) pf_queue(q, (const char *)k.p->a + (size_t)k.j * K * esize(k.p), (size_t)k.n * K * esize(k.p));
    }
}

/* lora_b's task c of B rows x the targets' blocks of 64 outputs, in order: row b, target index i,
 * outputs i0 .. i0 + m of its N — one rule for the pass and for the queue */
typedef struct { int b, i, N, i0, m; const LoraPair *p; } BTask;
static inline int b_blocks(const int *Ns, int nts) {
    int blocks = 0;
    for (int i = 0; i < nts; i++) blocks += (Ns[i] + 63) / 64;
    return blocks;
}
static inline BTask b_task(const LoraPair *tab, const int *ts, const int *Ns, int blocks, int c) {
    BTask k = {c / blocks, 0, 0, 0, 0, NULL};
    int blk = c % blocks;
    while (blk >= (Ns[k.i] + 63) / 64) blk -= (Ns[k.i++] + 63) / 64;
    k.N = Ns[k.i]; k.i0 = 64 * blk; k.m = k.N - k.i0 < 64 ? k.N - k.i0 : 64;
    k.p = pair_of(tab, k.b, ts[k.i]);
    return k;
}

/* lora_b: out[i][b] (Ns[i]) += scale * B (A in[b]) for each target ts[i], in blocks of 64
 * outputs; after the base projections wrote out (and their barrier ended lora_a). Ends in a barrier. */
AVX2 void lora_b(const LayerSpec *L, const int *ts, int nts, float *const *out, const int *Ns, int B,
                 const float *tmp, int rmax) {
    const int blocks = b_blocks(Ns, nts);
    int c0, c1;
    thread_share(B * blocks, &c0, &c1);
    for (int c = c0; c < c1; c++) {
        const BTask k = b_task(L->lora, ts, Ns, blocks, c);
        if (!k.p->a) continue;
        float dl[64], *o = out[k.i] + (size_t)k.b * k.N + k.i0;
        DOTS(k.p)((const char *)k.p->b + (size_t)k.i0 * k.p->r * esize(k.p),
                  tmp + ((size_t)k.b * LORA_TARGETS + ts[k.i]) * rmax, k.p->r, k.m, dl);
        for (int j = 0; j < k.m; j++) { float d = dl[j] * k.p->scale; o[j] = o[j] + d; }
    }
    #pragma omp barrier
}

/* the B rows this thread's share of lora_b(ts, Ns, B) reads, queued for the product before it */
static void queue_b(PfQueue *q, const LoraPair *tab, const int *ts, int nts, const int *Ns, int B) {
    const int blocks = b_blocks(Ns, nts);
    int c0, c1;
    thread_share(B * blocks, &c0, &c1);
    for (int c = c0; c < c1; c++) {
        const BTask k = b_task(tab, ts, Ns, blocks, c);
        if (k.p->a) pf_queue(q, (const char *)k.p->b + (size_t)k.i0 * k.p->r * esize(k.p), (size_t)k.m * k.p->r * esize(k.p));
    }
}

/* A layer's adapter rows this thread reads after its A x of q, k, v, in the order it reads them:
 * B of q, k, v and A of o (due by the end of the q, k, v products), B of o and A of gate and up,
 * B of gate and up and A of down, B of down. base_bytes: the layer's base weights this thread
 * reads (the even rate). */
void lora_plan(PfQueue *q, const LayerSpec *L, int B, int rmax, int qw, int kvn, int qn, size_t base_bytes) {
    static const int QKV[3] = {LORA_Q, LORA_K, LORA_V}, O[1] = {LORA_O}, GU[2] = {LORA_GATE, LORA_UP}, D[1] = {LORA_DOWN};
    const int n = L->n, Nqkv[3] = {qw, kvn, kvn}, No[1] = {n}, Ngu[2] = {L->n_ff, L->n_ff}, Nd[1] = {n};
    const int dense = L->ffn == FFN_DENSE;
    const LoraPair *t = L->lora;
    pf_clear(q);
    queue_b(q, t, QKV, 3, Nqkv, B); queue_a(q, t, O, 1, qn, B, rmax);
    pf_mark(q, PF_QKV);
    queue_b(q, t, O, 1, No, B);
    if (dense) queue_a(q, t, GU, 2, n, B, rmax);
    pf_mark(q, PF_O);
    if (dense) { queue_b(q, t, GU, 2, Ngu, B); queue_a(q, t, D, 1, L->n_ff, B, rmax); }
    pf_mark(q, PF_GU);
    if (dense) queue_b(q, t, D, 1, Nd, B);
    pf_mark(q, PF_D);
    pf_begin(q, base_bytes);
}

#endif
