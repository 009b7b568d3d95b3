/* MXFP4 weights (gpt-oss's experts) against Q8_0 activations, in AVX2: one row, and 2 to 8
 * activation rows against one weight row (a prompt's rows of an expert) with the same bits. */
#include "kiln.h"

#ifdef KILN_X86
/* R activation rows against one MXFP4 weight row, each as ggml's AVX2 vec_dot_mxfp4_q8_0: the
 * 4-bit codes looked up as doubled integers, two accumulators over alternate blocks, the last odd
 * block in the scalar order. Each pair of blocks is unpacked once for all R rows; a row's
 * arithmetic does not depend on R (R = 1 is the one-row kernel). */
#define MXFP4_ROWS(R)                                                                             \
    do {                                                                                          \
        __m256 acc1[R], acc2[R];                                                                  \
        for (int r = 0; r < R; r++) acc1[r] = acc2[r] = _mm256_setzero_ps();                      \
        int b = 0;                                                                                \
        for (; b + 1 < nb; b += 2) {                                                              \
            const uint8_t *w1 = w + (size_t)b * 17, *w2 = w1 + 17;                                \
            if (R == 1) prefetch_stream(w1, 34);      /* a decode step's row */      \
            __m128i c1 = _mm_loadu_si128((const __m128i *)(w1 + 1)), c2 = _mm_loadu_si128((const __m128i *)(w2 + 1)); \
            __m256i x1 = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(c1, 4), m4)), \
                                          _mm_shuffle_epi8(values, _mm_and_si128(c1, m4)));        \
            __m256i x2 = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(c2, 4), m4)), \
                                          _mm_shuffle_epi8(values, _mm_and_si128(c2, m4)));        \
            const float e1 = e8m0_to_fp32_half(w1[0]), e2 = e8m0_to_fp32_half(w2[0]);             \
            for (int r = 0; r < R; r++) {                                                         \
                const int8_t *q = a->q + (size_t)(t + r) * nb * 32; const float *d = a->d + (size_t)(t + r) * nb; \
                __m256 p1 = sum_i8_pairs(x1, _mm256_loadu_si256((const __m256i *)(q + (size_t)b * 32)));       \
                __m256 p2 = sum_i8_pairs(x2, _mm256_loadu_si256((const __m256i *)(q + (size_t)(b + 1) * 32))); \
                acc1[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * e1), p1, acc1[r]);                \
                acc2[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b + 1] * e2), p2, acc2[r]);            \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++) {                                                             \
            const int8_t *q = a->q + (size_t)(t + r) * nb * 32; const float *d = a->d + (size_t)(t + r) * nb; \
            float sum = hsum_avx(_mm256_add_ps(acc1[r], acc2[r]));                                \
            for (int bb = b; bb < nb; bb++) {                                                     \
                const uint8_t *wb = w + (size_t)bb * 17, *qs = wb + 1; const int8_t *y = q + (size_t)bb * 32; \
                int s1 = 0, s2 = 0;                                                               \
                for (int j = 0; j < 16; j++) { s1 += y[j] * KVALUES_MXFP4[qs[j] & 0xf]; s2 += y[j + 16] * KVALUES_MXFP4[qs[j] >> 4]; } \
                sum = fmaf(d[bb] * e8m0_to_fp32_half(wb[0]), (float)(s1 + s2), sum);              \
            }                                                                                     \
            res[r] = sum;                                                                         \
        }                                                                                         \
    } while (0)
AVX2 float dot_mxfp4_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const __m128i values = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4), m4 = _mm_set1_epi8(0x0f);
    float res[1];
    MXFP4_ROWS(1);
    return res[0];
}
AVX2 void dotR_mxfp4_avx2(const uint8_t *w, const Act *a, int t, int nb, int R, float *res) {
    const __m128i values = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4), m4 = _mm_set1_epi8(0x0f);
    switch (R) {                 /* R a constant in each copy: the row loop unrolled */
    case 2: MXFP4_ROWS(2); break;
    case 3: MXFP4_ROWS(3); break;
    case 4: MXFP4_ROWS(4); break;
    case 5: MXFP4_ROWS(5); break;
    case 6: MXFP4_ROWS(6); break;
    case 7: MXFP4_ROWS(7); break;
    default: MXFP4_ROWS(8);
    }
}
#endif
