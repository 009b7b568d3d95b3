/* Adapters in the one-call decode (layer.c, ffn_rows.c, delta_net.c): each row's LoRA on one
 * projection, as the block path's two F32 products, its scale and its add compute it. */
#include "kiln.h"

#ifdef KILN_X86
/* 8 weights from w + i, as floats: a float32 row's, or an fp16 row's widened (exact) */
#define LD8W(w, i, f16) ((f16) ? LD8_F16((const uint16_t *)(w) + (i)) : _mm256_loadu_ps((const float *)(w) + (i)))
#define LDW(w, i, f16) ((f16) ? H2F((const uint8_t *)(w) + 2 * (size_t)(i)) : ((const float *)(w))[i])

/* n dot products of rows w (n x K, rows K apart) with x, each dot_f32_avx2's arithmetic (its own
 * chain of FMAs over the row, its lanes summed alike, the tail in order), four chains at a time:
 * one chain waits on each FMA's latency, four keep the unit busy. */
AVX2 static inline __attribute__((always_inline)) void dots(const void *w, int f16, const float *x, int K,
                                                            int n, float *out) {
    const size_t es = f16 ? 2 : 4;
    int j = 0;
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
 * not depend on the batch), then the scale, then the add. Every thread calls both (orphaned
 * loops). tmp: B x LORA_TARGETS x rmax, row b's A x for target t at (b * LORA_TARGETS + t) * rmax.
 *
 * lora_a: each row's A in[b] for each target, four ranks a task. `nowait`: the caller runs the
 * base projections next, whose loop ends in a barrier — so the adapters cost one barrier per
 * group (lora_b's), where a pass per projection cost two. */
AVX2 void lora_a(const LayerSpec *L, const int *ts, int nts, const float *in, int K, int B, float *tmp, int rmax) {
    const int per = (rmax + 3) / 4;
    #pragma omp for schedule(static) nowait
    for (int c = 0; c < B * nts * per; c++) {
        const int b = c / (nts * per), t = ts[(c / per) % nts], j = 4 * (c % per);
        const LoraPair *p = &L->lora[(size_t)b * LORA_TARGETS + t];
        if (p->a && j < p->r)
            DOTS(p)((const char *)p->a + (size_t)j * K * (p->f16 ? 2 : 4), in + (size_t)b * K, K,
                    p->r - j < 4 ? p->r - j : 4, tmp + ((size_t)b * LORA_TARGETS + t) * rmax + j);
    }
}

/* lora_b: out[i][b] (Ns[i]) += scale * B (A in[b]) for each target ts[i], in blocks of 64
 * outputs; after the base projections wrote out (and their barrier ended lora_a). */
AVX2 void lora_b(const LayerSpec *L, const int *ts, int nts, float *const *out, const int *Ns, int B,
                 const float *tmp, int rmax) {
    int blocks = 0;
    for (int i = 0; i < nts; i++) blocks += (Ns[i] + 63) / 64;
    #pragma omp for schedule(static)
    for (int c = 0; c < B * blocks; c++) {
        const int b = c / blocks;
        int k = c % blocks, i = 0;
        while (k >= (Ns[i] + 63) / 64) k -= (Ns[i++] + 63) / 64;
        const int t = ts[i], N = Ns[i], i0 = 64 * k, m = N - i0 < 64 ? N - i0 : 64;
        const LoraPair *p = &L->lora[(size_t)b * LORA_TARGETS + t];
        if (!p->a) continue;
        float dl[64], *o = out[i] + (size_t)b * N + i0;
        DOTS(p)((const char *)p->b + (size_t)i0 * p->r * (p->f16 ? 2 : 4), tmp + ((size_t)b * LORA_TARGETS + t) * rmax,
                p->r, m, dl);
        for (int j = 0; j < m; j++) { float d = dl[j] * p->scale; o[j] = o[j] + d; }
    }
}

#endif
