/* AVX2 dot products for the K-quants (Q2_K..Q6_K) against Q8_K activations, ported from ggml's
 * x86 vec_dot kernels: the same integer sums per 256-value block, the same FMAs in the same
 * lanes, the same horizontal sums — llama.cpp's bits. One activation row here (and a decode
 * step's weight rows in pairs); several rows per weight row: dot_kquants_rows_avx2.c. */
#include "kiln.h"
#include "kquants_avx2.h"

#ifdef KILN_X86
/* One Q4_K block (w: its 144 bytes) against one Q8_K activation block, into a row's accumulators:
 * the body of ggml's loop, so a row computed through it alone or beside another has one set of
 * operations in one order. */
AVX2 static inline void q4_K_block(const uint8_t *w, const int8_t *y, const int16_t *bs, float yd,
                                   __m256 *acc, __m128 *acc_m) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const float d = yd * H2F(w), dmin = -yd * H2F(w + 2);
    __m128i prod;
    const __m256i ms = k4_scales_mins(w, bs, &prod);
    *acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), *acc_m);
    const __m128i sc128 = _mm256_extracti128_si256(ms, 0);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    const uint8_t *q4 = w + 16;
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i sl = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
        const __m256i sh = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
        const __m256i bits = _mm256_loadu_si256((const __m256i *)q4); q4 += 32;
        const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y))); y += 32;
        __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)y))); y += 32;
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
}
AVX2 float dot_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    __m256 acc = _mm256_setzero_ps(); __m128 acc_m = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        prefetch_stream(w + 144 * b, 144);
        q4_K_block(w + 144 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc, &acc_m);
    }
    return q4_K_end(acc, acc_m);
}
/* One activation row against two consecutive weight rows (a decode step): two chains in flight,
 * each row's arithmetic the one-row kernel's. */
/* One Q5_K block (w: its 176 bytes) against one Q8_K activation block, into a row's accumulators. */
AVX2 static inline void q5_K_block(const uint8_t *w, const int8_t *y, const int16_t *bs, float yd,
                                   __m256 *acc, float *summs) {
    const __m256i m4 = _mm256_set1_epi8(0xF), mone = _mm256_set1_epi8(1);
    const __m128i mzero = _mm_setzero_si128();
    const float d = yd * H2F(w), dmin = -yd * H2F(w + 2);
    __m128i prod;
    const __m256i ms = k4_scales_mins(w, bs, &prod);
    const __m128i hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
    *summs = fmaf(dmin, (float)_mm_extract_epi32(hs, 0), *summs);   /* gcc fuses it in ggml */
    const __m128i sc128 = _mm256_extracti128_si256(ms, 0);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    const __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
    __m256i hmask = mone, sumi = _mm256_setzero_si256();
    const uint8_t *q5 = w + 48; int bit = 0;
    for (int j = 0; j < 4; j++) {
        const __m256i s0 = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
        const __m256i s1 = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
        const __m256i bits = _mm256_loadu_si256((const __m256i *)q5); q5 += 32;
        const __m256i l0 = _mm256_and_si256(bits, m4);
        const __m256i h0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
        hmask = _mm256_slli_epi16(hmask, 1);
        const __m256i l1 = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
        hmask = _mm256_slli_epi16(hmask, 1);
        __m256i p0 = _mm256_maddubs_epi16(_mm256_add_epi8(l0, h0), _mm256_loadu_si256((const __m256i *)y)); y += 32;
        __m256i p1 = _mm256_maddubs_epi16(_mm256_add_epi8(l1, h1), _mm256_loadu_si256((const __m256i *)y)); y += 32;
        p0 = _mm256_madd_epi16(s0, p0); p1 = _mm256_madd_epi16(s1, p1);
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
}
AVX2 float dot_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    __m256 acc = _mm256_setzero_ps(); float summs = 0.f;
    for (int b = 0; b < nb; b++) {
        prefetch_stream(w + 176 * b, 176);
        q5_K_block(w + 176 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc, &summs);
    }
    return hsum_avx(acc) + summs;
}
/* One Q6_K block (w: its 210 bytes) against one Q8_K activation block, into a row's accumulator. */
AVX2 static inline void q6_K_block(const uint8_t *w, const int8_t *y, const int16_t *bs, float yd, __m256 *acc) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    const float d = yd * H2F(w + 208);
    const uint8_t *q4 = w, *qh = w + 128;
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)bs);
    const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
    const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, _mm256_cvtepi8_epi16(scales)), 5);
    __m256i sumi = _mm256_setzero_si256();
    int is = 0;
    for (int j = 0; j < 2; j++) {
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)q4); q4 += 32;
        const __m256i b2 = _mm256_loadu_si256((const __m256i *)q4); q4 += 32;
        const __m256i bH = _mm256_loadu_si256((const __m256i *)qh); qh += 32;
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(bH, m3), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(bH, _mm256_set1_epi8(12)), 2);
        const __m256i h2 = _mm256_and_si256(bH, _mm256_set1_epi8(48));
        const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(bH, _mm256_set1_epi8(-64)), 2);
        const __m256i v0 = _mm256_or_si256(_mm256_and_si256(b1, m15), h0);
        const __m256i v1 = _mm256_or_si256(_mm256_and_si256(b2, m15), h1);
        const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), h2);
        const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), h3);
        __m256i p0 = _mm256_maddubs_epi16(v0, _mm256_loadu_si256((const __m256i *)y)); y += 32;
        __m256i p1 = _mm256_maddubs_epi16(v1, _mm256_loadu_si256((const __m256i *)y)); y += 32;
        __m256i p2 = _mm256_maddubs_epi16(v2, _mm256_loadu_si256((const __m256i *)y)); y += 32;
        __m256i p3 = _mm256_maddubs_epi16(v3, _mm256_loadu_si256((const __m256i *)y)); y += 32;
        p0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(is + 0))), p0);
        p1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(is + 1))), p1);
        p2 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(is + 2))), p2);
        p3 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(is + 3))), p3);
        is += 4;
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p2, p3));
    }
    sumi = _mm256_sub_epi32(sumi, q8sclsub);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), *acc);
}
AVX2 float dot_q6_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        prefetch_stream(w + 210 * b, 210);
        q6_K_block(w + 210 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc);
    }
    return hsum_avx(acc);
}
AVX2 static inline __m256i scale_shuffle_q3k(int i) { /* int16 scale 2i in lane 0, 2i+1 in lane 1 */
    return _mm256_set_m128i(_mm_set1_epi16((short)((4 * i + 2) | ((4 * i + 3) << 8))),
                            _mm_set1_epi16((short)((4 * i) | ((4 * i + 1) << 8))));
}
AVX2 float dot_q2_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 84, q8 += 256, bs += 16) {
        const float d = yd[b] * H2F(w + 80), dmin = -yd[b] * H2F(w + 82);
        const __m128i ms = _mm_loadu_si128((const __m128i *)w);
        const __m128i scales8 = _mm_and_si128(ms, m4), mins8 = _mm_and_si128(_mm_srli_epi16(ms, 4), m4);
        const __m256i prod = _mm256_madd_epi16(_mm256_cvtepi8_epi16(mins8), _mm256_loadu_si256((const __m256i *)bs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc);
        const __m256i all = _mm256_cvtepi8_epi16(scales8);
        const __m128i ls = _mm256_extracti128_si256(all, 0), hs = _mm256_extracti128_si256(all, 1);
        const __m256i scales[2] = {_mm256_set_m128i(ls, ls), _mm256_set_m128i(hs, hs)};
        const uint8_t *q2 = w + 16; const int8_t *y = q8;
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 2; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q2); q2 += 32;
            __m256i p[4];
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
                p[k] = _mm256_madd_epi16(_mm256_shuffle_epi8(scales[j], scale_shuffle_q3k(k)),
                                         _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(y + 32 * k))));
            }
            y += 128;
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_avx(acc);
}
AVX2 float dot_q3_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    const __m256i m3 = _mm256_set1_epi8(3), mone = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 110, q8 += 256) {
        const float d = yd[b] * H2F(w + 108);
        uint32_t aux[3]; memcpy(aux, w + 96, 12);
        __m128i s128 = _mm_set_epi32(((aux[1] >> 4) & kmask2) | (((aux[2] >> 6) & kmask1) << 4),
                                     ((aux[0] >> 4) & kmask2) | (((aux[2] >> 4) & kmask1) << 4),
                                     (aux[1] & kmask2) | (((aux[2] >> 2) & kmask1) << 4),
                                     (aux[0] & kmask2) | (((aux[2] >> 0) & kmask1) << 4));
        s128 = _mm_sub_epi8(s128, _mm_set1_epi8(32));
        const __m256i all = _mm256_cvtepi8_epi16(s128);
        const __m128i ls = _mm256_extracti128_si256(all, 0), hs = _mm256_extracti128_si256(all, 1);
        const __m256i scales[2] = {_mm256_set_m128i(ls, ls), _mm256_set_m128i(hs, hs)};
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)w);
        const uint8_t *q3 = w + 32; const int8_t *y = q8;
        __m256i sumi = _mm256_setzero_si256();
        int bit = 0;
        for (int j = 0; j < 2; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q3); q3 += 32;
            __m256i p[4];
            for (int k = 0; k < 4; k++, bit++) {
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
                const __m256i hi = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_andnot_si256(hbits, _mm256_slli_epi16(mone, bit)), bit), 2);
                const __m256i yk = _mm256_loadu_si256((const __m256i *)(y + 32 * k));
                __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(lo, yk), _mm256_maddubs_epi16(hi, yk));
                p[k] = _mm256_madd_epi16(_mm256_shuffle_epi8(scales[j], scale_shuffle_q3k(k)), p16);
            }
            y += 128;
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_avx(acc);
}
#endif
