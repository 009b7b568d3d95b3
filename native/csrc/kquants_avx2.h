/* What the K-quant AVX2 kernels share (dot_kquants_avx2.c: one row, and a decode step's weight
 * rows in pairs; dot_kquants_rows_avx2.c: several activation rows per weight row): the scale
 * unpacking and the end of a Q4_K row, ggml's own steps, so every file computes a row alike. */
#ifndef KILN_KQUANTS_AVX2_H
#define KILN_KQUANTS_AVX2_H
#include "kiln.h"
#ifdef KILN_X86
/* K-quants as ggml's AVX2 ggml_vec_dot_q{4,5,6}_K_q8_K compute them: integer sums per 256-value
 * block (sub-block scales applied with madd), one float FMA per block, the minimums from the
 * activations' sums of 16. */
AVX2 static inline void unpack_k4_scales(const uint8_t *scales, uint32_t u[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(u, scales, 12);
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = uaux;
    u[0] &= kmask1;
}
/* a Q4_K/Q5_K block's eight mins (16 bits each) and its eight scales in both 128-bit lanes, as
 * ggml's loops start a block */
AVX2 static inline void k4_block_scales(const uint8_t *w, __m128i *mins, __m256i *scales) {
    uint32_t u[4]; unpack_k4_scales(w + 4, u);
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
    const __m128i sc128 = _mm256_extracti128_si256(ms, 0);
    *mins = _mm256_extracti128_si256(ms, 1);
    *scales = _mm256_set_m128i(sc128, sc128);
}
/* the four 32-value pieces of a Q6_K block's half j (128 values): six-bit codes, low nibbles
 * from the first 128 bytes, high bits from the next 64 (ggml's unpacking) */
AVX2 static inline void q6_K_half(const uint8_t *w, int j, __m256i v[4]) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    const __m256i b1 = _mm256_loadu_si256((const __m256i *)(w + 64 * j));
    const __m256i b2 = _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32));
    const __m256i bH = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * j));
    v[0] = _mm256_or_si256(_mm256_and_si256(b1, m15), _mm256_slli_epi16(_mm256_and_si256(bH, m3), 4));
    v[1] = _mm256_or_si256(_mm256_and_si256(b2, m15), _mm256_slli_epi16(_mm256_and_si256(bH, _mm256_set1_epi8(12)), 2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), _mm256_and_si256(bH, _mm256_set1_epi8(48)));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15),
                           _mm256_srli_epi16(_mm256_and_si256(bH, _mm256_set1_epi8(-64)), 2));
}
AVX2 static inline __m256i scale_shuffle_k4(int i) {      /* 16-bit scale i in every lane pair */
    return _mm256_set1_epi16((short)((2 * i) | ((2 * i + 1) << 8)));
}
AVX2 static inline __m128i scale_shuffle_q6(int i) {      /* bytes 2i (x8) then 2i+1 (x8) */
    return _mm_set_epi64x(0x0101010101010101LL * (2 * i + 1), 0x0101010101010101LL * (2 * i));
}
AVX2 static inline float q4_K_end(__m256 acc, __m128 acc_m) {
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    return hsum_avx(acc) + _mm_cvtss_f32(acc_m);
}
/* Q4_K's and Q5_K's 6-bit scales and mins widened to 16 bits (scales low lane, mins high), and
 * the mins' products with the activation block's sums of 16 (ggml's first steps of a block). */
AVX2 static inline __m256i k4_scales_mins(const uint8_t *w, const int16_t *bs, __m128i *min_prod) {
    uint32_t u[4]; unpack_k4_scales(w + 4, u);
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)bs);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    *min_prod = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
    return ms;
}
/* the Q8_K activation rows t .. t + R - 1: their codes, block scales and sums of 16 */
static inline void q8_K_rows(const Act *a, int t, int nb, int R, const int8_t **q8, const float **yd,
                             const int16_t **bs) {
    for (int r = 0; r < R; r++) {
        q8[r] = a->q + (size_t)(t + r) * nb * 256; yd[r] = a->d + (size_t)(t + r) * nb;
        bs[r] = a->bs + (size_t)(t + r) * nb * 16;
    }
}
#endif
#endif
