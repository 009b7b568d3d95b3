/* AVX2 dot products for the K-quants (Q2_K..Q6_K) against Q8_K activations, ported from ggml's
 * x86 vec_dot kernels: the same integer sums per 256-value block, the same FMAs in the same
 * lanes, the same horizontal sums — llama.cpp's bits. The four-row variants share a block's
 * unpacking across the rows and keep each row's operations in order. Split from dot_avx2.c
 * (the 32-value types, F16, MXFP4 and the dispatchers). */
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
AVX2 static inline __m256i scale_shuffle_k4(int i) {      /* 16-bit scale i in every lane pair */
    return _mm256_set1_epi16((short)((2 * i) | ((2 * i + 1) << 8)));
}
AVX2 static inline __m128i scale_shuffle_q6(int i) {      /* bytes 2i (x8) then 2i+1 (x8) */
    return _mm_set_epi64x(0x0101010101010101LL * (2 * i + 1), 0x0101010101010101LL * (2 * i));
}
/* One Q4_K block (w: its 144 bytes) against one Q8_K activation block, into a row's accumulators:
 * the body of ggml's loop, so a row computed through it alone or beside another has one set of
 * operations in one order. */
AVX2 static inline void q4_K_block(const uint8_t *w, const int8_t *y, const int16_t *bs, float yd,
                                   __m256 *acc, __m128 *acc_m) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const float d = yd * H2F(w), dmin = -yd * H2F(w + 2);
    uint32_t u[4]; unpack_k4_scales(w + 4, u);
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)bs);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
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
AVX2 static inline float q4_K_end(__m256 acc, __m128 acc_m) {
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    return hsum_avx(acc) + _mm_cvtss_f32(acc_m);
}
AVX2 float dot_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    __m256 acc = _mm256_setzero_ps(); __m128 acc_m = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) q4_K_block(w + 144 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc, &acc_m);
    return q4_K_end(acc, acc_m);
}
/* One activation row against two consecutive weight rows (a decode step): two chains in flight,
 * each row's arithmetic the one-row kernel's. */
AVX2 void dotW2_q4_K_avx2(const uint8_t *w, size_t row_bytes, const Act *a, int t, int nb, float *res) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    const uint8_t *w1 = w + row_bytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 am0 = _mm_setzero_ps(), am1 = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        q4_K_block(w + 144 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc0, &am0);
        q4_K_block(w1 + 144 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc1, &am1);
    }
    res[0] = q4_K_end(acc0, am0); res[1] = q4_K_end(acc1, am1);
}
AVX2 float dot_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    const __m256i m4 = _mm256_set1_epi8(0xF), mone = _mm256_set1_epi8(1);
    const __m128i mzero = _mm_setzero_si128();
    __m256 acc = _mm256_setzero_ps(); float summs = 0.f;
    for (int b = 0; b < nb; b++, w += 176, q8 += 256, bs += 16) {
        const float d = yd[b] * H2F(w), dmin = -yd[b] * H2F(w + 2);
        uint32_t u[4]; unpack_k4_scales(w + 4, u);
        const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *)bs);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
        const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
        const __m128i hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
        summs = fmaf(dmin, (float)_mm_extract_epi32(hs, 0), summs);   /* gcc fuses it in ggml */
        const __m128i sc128 = _mm256_extracti128_si256(ms, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
        __m256i hmask = mone, sumi = _mm256_setzero_si256();
        const uint8_t *q5 = w + 48; const int8_t *y = q8; int bit = 0;
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
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
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
    for (int b = 0; b < nb; b++) q6_K_block(w + 210 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc);
    return hsum_avx(acc);
}
AVX2 void dotW2_q6_K_avx2(const uint8_t *w, size_t row_bytes, const Act *a, int t, int nb, float *res) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    const uint8_t *w1 = w + row_bytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        q6_K_block(w + 210 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc0);
        q6_K_block(w1 + 210 * b, q8 + 256 * b, bs + 16 * b, yd[b], &acc1);
    }
    res[0] = hsum_avx(acc0); res[1] = hsum_avx(acc1);
}
/* Four activation rows against one K-quant weight row: the block's unpacking is shared, each
 * row's operations are the one-row kernel's, in its order — the same bits. */
AVX2 void dot4_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
    const int8_t *q8[4]; const float *yd[4]; const int16_t *bs[4];
    for (int r = 0; r < 4; r++) {
        q8[r] = a->q + (size_t)(t + r) * nb * 256; yd[r] = a->d + (size_t)(t + r) * nb;
        bs[r] = a->bs + (size_t)(t + r) * nb * 16;
    }
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[4]; __m128 acc_m[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b++, w += 144) {
        const float xd = H2F(w), xm = H2F(w + 2);
        uint32_t u[4]; unpack_k4_scales(w + 4, u);
        const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(ms, 1), sc128 = _mm256_extracti128_si256(ms, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        __m256i lo[4], hi[4], sl[4], sh[4];
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            lo[j] = _mm256_and_si256(bits, m4); hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            sl[j] = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
            sh[j] = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
        }
        for (int r = 0; r < 4; r++) {
            const float d = yd[r][b] * xd, dmin = -yd[r][b] * xm;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(bs[r] + b * 16));
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, q8s)), acc_m[r]);
            const int8_t *y = q8[r] + b * 256;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i pl = _mm256_madd_epi16(sl[j], _mm256_maddubs_epi16(lo[j], _mm256_loadu_si256((const __m256i *)(y + 64 * j))));
                __m256i ph = _mm256_madd_epi16(sh[j], _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256((const __m256i *)(y + 64 * j + 32))));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        __m128 m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        res[r] = hsum_avx(acc[r]) + _mm_cvtss_f32(m);
    }
}
/* Eight activation rows against one Q4_K weight row (prefill): each 64-value piece of a block is
 * unpacked once and multiplied into the eight rows' integer sums (exact, so their order is free),
 * then each row's float steps are the one-row kernel's, in its order — the same bits. Few
 * registers live at once (eight sums, one piece), where holding a whole block's pieces spilled. */
AVX2 void dot8_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
    const int8_t *q8[8]; const float *yd[8]; const int16_t *bs[8];
    for (int r = 0; r < 8; r++) {
        q8[r] = a->q + (size_t)(t + r) * nb * 256; yd[r] = a->d + (size_t)(t + r) * nb;
        bs[r] = a->bs + (size_t)(t + r) * nb * 16;
    }
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[8]; __m128 acc_m[8];
    for (int r = 0; r < 8; r++) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b++, w += 144) {
        const float xd = H2F(w), xm = H2F(w + 2);
        uint32_t u[4]; unpack_k4_scales(w + 4, u);
        const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(ms, 1), sc128 = _mm256_extracti128_si256(ms, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        __m256i sumi[8];
        for (int r = 0; r < 8; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i sl = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
            const __m256i sh = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
            for (int r = 0; r < 8; r++) {
                const int8_t *y = q8[r] + b * 256 + 64 * j;
                const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y)));
                const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 32))));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for (int r = 0; r < 8; r++) {
            const float d = yd[r][b] * xd, dmin = -yd[r][b] * xm;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(bs[r] + b * 16));
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, q8s)), acc_m[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < 8; r++) res[r] = q4_K_end(acc[r], acc_m[r]);
}
AVX2 void dot4_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
    const int8_t *q8[4]; const float *yd[4]; const int16_t *bs[4];
    for (int r = 0; r < 4; r++) {
        q8[r] = a->q + (size_t)(t + r) * nb * 256; yd[r] = a->d + (size_t)(t + r) * nb;
        bs[r] = a->bs + (size_t)(t + r) * nb * 16;
    }
    const __m256i m4 = _mm256_set1_epi8(0xF), mone = _mm256_set1_epi8(1);
    const __m128i mzero = _mm_setzero_si128();
    __m256 acc[4]; float summs[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm256_setzero_ps(); summs[r] = 0.f; }
    for (int b = 0; b < nb; b++, w += 176) {
        const float xd = H2F(w), xm = H2F(w + 2);
        uint32_t u[4]; unpack_k4_scales(w + 4, u);
        const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(ms, 1), sc128 = _mm256_extracti128_si256(ms, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
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
    for (int r = 0; r < 4; r++) {
        q8[r] = a->q + (size_t)(t + r) * nb * 256; yd[r] = a->d + (size_t)(t + r) * nb;
        bs[r] = a->bs + (size_t)(t + r) * nb * 16;
    }
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 210) {
        const float xd = H2F(w + 208);
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i v[8], sc[8];
        for (int j = 0; j < 2; j++) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(w + 64 * j));
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32));
            const __m256i bH = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * j));
            v[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(b1, m15), _mm256_slli_epi16(_mm256_and_si256(bH, m3), 4));
            v[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15), _mm256_slli_epi16(_mm256_and_si256(bH, _mm256_set1_epi8(12)), 2));
            v[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), _mm256_and_si256(bH, _mm256_set1_epi8(48)));
            v[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15),
                                           _mm256_srli_epi16(_mm256_and_si256(bH, _mm256_set1_epi8(-64)), 2));
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
