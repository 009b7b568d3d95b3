/* AVX-512 VNNI kernels for several activation rows against one Q4_0 or Q8_0 weight row (prefill, a
 * batched step), on CPUs that have it (g_avx512; KILN_SIMD=avx2 turns it off).
 *
 * They compute the AVX2 kernels' bits (dot_avx2.c dot_q8_rows, ggml's vec_dot order): a block's
 * eight int32 lanes — each the sum of four consecutive products, exact — come from one vpdpbusd
 * over two rows at once (the weight block in both halves of a register, |w| against y with w's
 * sign), where AVX2 takes a sign, a maddubs and a madd per row; everything after the integers —
 * d_w × d_x, the FMA per block into eight float lanes, the lanes' sum — is the AVX2 kernel's,
 * operation for operation, two rows a register. */
#include "kiln.h"

#ifdef KILN_X86
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

AVX512 static inline __m512i pair512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

AVX512 static inline __attribute__((always_inline)) void dotR_q8_512(int q8, const uint8_t *w, const Act *a, int t,
                                                                     int nb, int R, float *res) {
    const int bytes = q8 ? 34 : 18;
    const float *dT = a->dT + t;
    const size_t ts = (size_t)a->ts, row = (size_t)nb * 32;
    __m512 acc[4];
    __m512i pick[4];
    for (int p = 0; p < R / 2; p++) {         /* row 2p's scale into lanes 0-7, row 2p+1's into 8-15 */
        int idx[16];
        for (int i = 0; i < 16; i++) idx[i] = 2 * p + i / 8;
        pick[p] = _mm512_loadu_si512((const void *)idx);
        acc[p] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++, w += bytes) {
        if (R == 4) prefetch_stream(w, bytes);   /* a few sequences' decode step */
        const __m256i x = q8 ? _mm256_loadu_si256((const __m256i *)(w + 2))
                             : _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8));
        const __m512i xw = pair512(x, x), ax = _mm512_abs_epi8(xw);
        const __mmask64 neg = _mm512_movepi8_mask(xw);
        const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(H2F(w)), _mm256_loadu_ps(dT + b * ts)));
        const int8_t *y = a->q + ((size_t)t * nb + b) * 32;
        for (int p = 0; p < R / 2; p++, y += 2 * row) {
            const __m512i yy = pair512(_mm256_loadu_si256((const __m256i *)y), _mm256_loadu_si256((const __m256i *)(y + row)));
            const __m512i sy = _mm512_mask_sub_epi8(yy, neg, _mm512_setzero_si512(), yy);     /* y with w's sign */
            const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sy);
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick[p], d), _mm512_cvtepi32_ps(s), acc[p]);
        }
    }
    float lanes[8 * 8];
    for (int p = 0; p < R / 2; p++) _mm512_storeu_ps(lanes + 16 * p, acc[p]);
    for (int r = 0; r < R; r++) res[r] = hsum_avx(_mm256_loadu_ps(lanes + 8 * r));
}

/* R activation rows from t against one Q4_0/Q8_0 weight row: 0 when the type has none. R is 8 or
 * 4 (constants: the row loops unroll, the sums stay in registers). */
AVX512 int dotR_q8_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res) {
    switch (type) {                           /* each a copy with its type and R constant */
    case T_Q4_0: if (R == 8) dotR_q8_512(0, w, a, t, nb, 8, res); else dotR_q8_512(0, w, a, t, nb, 4, res); return 1;
    case T_Q8_0: if (R == 8) dotR_q8_512(1, w, a, t, nb, 8, res); else dotR_q8_512(1, w, a, t, nb, 4, res); return 1;
    }
    return 0;
}
#endif
