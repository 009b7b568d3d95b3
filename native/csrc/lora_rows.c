/* Adapters in the one-call decode (layer.c, ffn_rows.c, delta_net.c): each row's LoRA on one
 * projection, as the block path's two F32 products, its scale and its add compute it. */
#include "kiln.h"

#ifdef KILN_X86
/* n dot products of rows w (n x K, rows K apart) with x, each dot_f32_avx2's arithmetic (its own
 * chain of FMAs over the row, its lanes summed alike, the tail in order), four chains at a time:
 * one chain waits on each FMA's latency, four keep the unit busy. */
AVX2 static void dots_f32(const float *w, const float *x, int K, int n, float *out) {
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *w0 = w + (size_t)j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int i = 0;
        for (; i + 8 <= K; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
        }
        float r0 = hsum_avx(a0), r1 = hsum_avx(a1), r2 = hsum_avx(a2), r3 = hsum_avx(a3);
        for (; i < K; i++) { r0 += w0[i] * x[i]; r1 += w1[i] * x[i]; r2 += w2[i] * x[i]; r3 += w3[i] * x[i]; }
        out[j] = r0; out[j + 1] = r1; out[j + 2] = r2; out[j + 3] = r3;
    }
    for (; j < n; j++) out[j] = dot_f32_avx2(w + (size_t)j * K, x, K);
}

/* Each row's adapter on projection t: out[b] (N) += scale * B (A in[b]) — A x and B (A x) as the
 * block path's F32 matmul computes each value (dot_f32_avx2's arithmetic: a row's bits do not
 * depend on the batch), then the scale, then the add. Every thread calls it (orphaned loops):
 * the rows' A x dealt between the threads four ranks at a time into `tmp` (B x rmax, shared),
 * then their B (A x) in blocks of 64 outputs. */
AVX2 void lora_rows(const LayerSpec *L, int t, const float *in, int K, float *out, int N, int B,
                           float *tmp, int rmax) {
    const int per = (rmax + 3) / 4, blocks = (N + 63) / 64;
    #pragma omp for schedule(static)
    for (int c = 0; c < B * per; c++) {
        const LoraPair *p = &L->lora[(size_t)(c / per) * LORA_TARGETS + t];
        int j = 4 * (c % per);
        if (p->a && j < p->r)
            dots_f32(p->a + (size_t)j * K, in + (size_t)(c / per) * K, K, p->r - j < 4 ? p->r - j : 4,
                     tmp + (size_t)(c / per) * rmax + j);
    }
    #pragma omp for schedule(static)
    for (int c = 0; c < B * blocks; c++) {
        const int b = c / blocks, i0 = 64 * (c % blocks), m = N - i0 < 64 ? N - i0 : 64;
        const LoraPair *p = &L->lora[(size_t)b * LORA_TARGETS + t];
        if (!p->a) continue;
        float dl[64], *o = out + (size_t)b * N + i0;
        dots_f32(p->b + (size_t)i0 * p->r, tmp + (size_t)b * rmax, p->r, m, dl);
        for (int i = 0; i < m; i++) { float d = dl[i] * p->scale; o[i] = o[i] + d; }
    }
}

#endif
