/* AVX2 K-quant kernels for several activation rows against one weight row (prefill, a batched
 * decode step): each weight block is unpacked once for all the rows, each row's float steps are
 * the one-row kernel's (dot_kquants_avx2.c), in its order — the same bits. */
#include "kiln.h"
#include "kquants_avx2.h"

#ifdef KILN_X86
/* R (4 or 8) activation rows against one Q4_K weight row (prefill): each 64-value piece of a block
 * is unpacked once and multiplied into the rows' integer sums (exact, so their order is free), then
 * each row's float steps are the one-row kernel's, in its order — the same bits. Few registers
 * live at once (R sums, one piece), where holding a whole block's pieces spilled. R is a constant
 * in each caller below, so the rows' loops unroll and the sums stay in registers. */
AVX2 static inline __attribute__((always_inline)) void dotR_q4_K(const uint8_t *w, const Act *a, int t, int nb,
                                                                 int R, float *res) {
    const int8_t *q8[8]; const float *yd[8]; const int16_t *bs[8];
    q8_K_rows(a, t, nb, R, q8, yd, bs);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[8]; __m128 acc_m[8];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b++, w += 144) {
        if (R <= 4) prefetch_stream(w, 144);     /* a few sequences' decode step */
        const float xd = H2F(w), xm = H2F(w + 2);
        __m128i mins; __m256i scales;
        k4_block_scales(w, &mins, &scales);
        __m256i sumi[8];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i sl = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
            const __m256i sh = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
            for (int r = 0; r < R; r++) {
                const int8_t *y = q8[r] + b * 256 + 64 * j;
                const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y)));
                const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 32))));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for (int r = 0; r < R; r++) {
            const float d = yd[r][b] * xd, dmin = -yd[r][b] * xm;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(bs[r] + b * 16));
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, q8s)), acc_m[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) res[r] = q4_K_end(acc[r], acc_m[r]);
}
AVX2 void dot4_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) { dotR_q4_K(w, a, t, nb, 4, res); }
AVX2 void dot8_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) { dotR_q4_K(w, a, t, nb, 8, res); }
/* Four activation rows against one K-quant weight row: the block's unpacking is shared, each
 * row's operations are the one-row kernel's, in its order — the same bits. */
AVX2 void dot4_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
    const int8_t *q8[4]; const float *yd[4]; const int16_t *bs[4];
    q8_K_rows(a, t, nb, 4, q8, yd, bs);
    const __m256i m4 = _mm256_set1_epi8(0xF), mone = _mm256_set1_epi8(1);
    const __m128i mzero = _mm_setzero_si128();
    __m256 acc[4]; float summs[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm256_setzero_ps(); summs[r] = 0.f; }
    for (int b = 0; b < nb; b++, w += 176) {
        prefetch_stream(w, 176);
        const float xd = H2F(w), xm = H2F(w + 2);
        __m128i mins; __m256i scales;
        k4_block_scales(w, &mins, &scales);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
        __m256i v[8], sc[8], hmask = mone;
        int bit = 0;
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * j));
            const __m256i h0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
            hmask = _mm256_slli_epi16(hmask, 1);
            const __m256i h1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
            hmask = _mm256_slli_epi16(hmask, 1);
            v[2 * j] = _mm256_add_epi8(_mm256_and_si256(bits, m4), h0);
            v[2 * j + 1] = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h1);
            sc[2 * j] = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
            sc[2 * j + 1] = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
        }
        for (int r = 0; r < 4; r++) {
            const float d = yd[r][b] * xd, dmin = -yd[r][b] * xm;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(bs[r] + b * 16));
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            const __m128i hs = _mm_hadd_epi32(_mm_hadd_epi32(_mm_madd_epi16(mins, q8s), mzero), mzero);
            summs[r] = fmaf(dmin, (float)_mm_extract_epi32(hs, 0), summs[r]);
            const int8_t *y = q8[r] + b * 256;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i p0 = _mm256_madd_epi16(sc[2 * j], _mm256_maddubs_epi16(v[2 * j], _mm256_loadu_si256((const __m256i *)(y + 64 * j))));
                __m256i p1 = _mm256_madd_epi16(sc[2 * j + 1], _mm256_maddubs_epi16(v[2 * j + 1], _mm256_loadu_si256((const __m256i *)(y + 64 * j + 32))));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) res[r] = hsum_avx(acc[r]) + summs[r];
}
AVX2 void dot4_q6_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
    const int8_t *q8[4]; const float *yd[4]; const int16_t *bs[4];
    q8_K_rows(a, t, nb, 4, q8, yd, bs);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 210) {
        prefetch_stream(w, 210);
        const float xd = H2F(w + 208);
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i v[8], sc[8];
        for (int j = 0; j < 2; j++) {
            q6_K_half(w, j, v + 4 * j);
            for (int k = 0; k < 4; k++)
                sc[4 * j + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(4 * j + k)));
        }
        for (int r = 0; r < 4; r++) {
            const float d = yd[r][b] * xd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(bs[r] + b * 16));
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const int8_t *y = q8[r] + b * 256;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 2; j++) {
                __m256i p[4];
                for (int k = 0; k < 4; k++)
                    p[k] = _mm256_madd_epi16(sc[4 * j + k], _mm256_maddubs_epi16(v[4 * j + k], _mm256_loadu_si256((const __m256i *)(y + 128 * j + 32 * k))));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) res[r] = hsum_avx(acc[r]);
}
#endif
