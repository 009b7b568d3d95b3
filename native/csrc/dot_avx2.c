/* AVX2/FMA dot products, ported from ggml's x86 vec_dot kernels (and tinyBLAS's for F16/F32):
 * the same integer block products, the same FMAs in the same lanes, the same horizontal sums —
 * so a product is the bits llama.cpp computes (see tests/data/README.md for where llama.cpp
 * itself takes other paths). Activations come quantized by quant.c (Q8_K with its 16-value sums,
 * d positive: ggml's sign convention gives the same products). Compiled with target attributes;
 * quant.c calls in only when the CPU has AVX2, FMA and F16C. Multi-row variants (8, 4, 3, 2 rows)
 * share a weight block's unpacking across the activation rows and keep each row's operations in
 * order, so a row's bits do not depend on the batch it is in. */
#include "kiln.h"

#ifdef KILN_X86
#define H2F(p) _cvtsh_ss(rd16(p))

AVX2 static inline __m256i nibbles32(const uint8_t *qs) {   /* 16 bytes -> 32 values 0..15 */
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}
AVX2 static inline __m256 sum_i8_pairs(__m256i x, __m256i y) {  /* signed x · signed y -> 8 floats */
    __m256i ax = _mm256_sign_epi8(x, x), sy = _mm256_sign_epi8(y, x);
    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(dot);
}
AVX2 static inline __m256 sum_u8_i8(__m256i u, __m256i y) {     /* unsigned u · signed y */
    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(dot);
}
AVX2 static inline __m256i bits32(const uint8_t *x) {    /* 32 bits -> 32 bytes, 0xFF where set */
    uint32_t x32; memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0x0000000000000000LL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}
/* The 32 values of one block of a type multiplied against Q8_0/Q8_1 activations: signed for
 * Q4_0/Q5_0/Q8_0, unsigned (their minimum m applied apart) for Q4_1/Q5_1 — as ggml unpacks them. */
#define HAS_MIN(type) ((type) == T_Q4_1 || (type) == T_Q5_1)
AVX2 static inline __attribute__((always_inline)) __m256i block_values(int type, const uint8_t *w) {
    switch (type) {
    case T_Q4_0: return _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8));
    case T_Q5_0: return _mm256_or_si256(nibbles32(w + 6), _mm256_andnot_si256(bits32(w + 2), _mm256_set1_epi8((char)0xF0)));
    case T_Q8_0: return _mm256_loadu_si256((const __m256i *)(w + 2));
    case T_Q4_1: return nibbles32(w + 4);
    default:     return _mm256_or_si256(nibbles32(w + 8), _mm256_and_si256(bits32(w + 4), _mm256_set1_epi8(0x10)));
    }
}
AVX2 static inline __attribute__((always_inline)) __m256 block_dot(int type, __m256i x, __m256i y) {
    return HAS_MIN(type) ? sum_u8_i8(x, y) : sum_i8_pairs(x, y);
}
/* One activation row against one weight row of 32-value blocks: per block, one FMA of d_w * d_x
 * into 8 lanes, the minimum's m * s summed apart (ggml's order). */
AVX2 static inline __attribute__((always_inline)) float dot_q8_row(int type, int bytes, const uint8_t *w,
                                                                 const Act *a, int t, int nb) {
    __m256 acc = _mm256_setzero_ps(); float accm = 0.f;
    for (int b = 0; b < nb; b++, w += bytes) {
        const size_t blk = (size_t)t * nb + b;
        const __m256i y = _mm256_loadu_si256((const __m256i *)(a->q + blk * 32));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w) * a->d[blk]), block_dot(type, block_values(type, w), y), acc);
        if (HAS_MIN(type)) accm += H2F(w + 2) * a->s[blk];
    }
    return HAS_MIN(type) ? hsum_avx(acc) + accm : hsum_avx(acc);
}
/* R (2 to 8) rows from t: each weight block unpacked once; the R products d_w * d_x, and the R
 * minimum terms m * s, as one vector multiply each (the rows' scales sit side by side in the
 * block-major copy) — every lane the same IEEE operation on the same operands as the one-row
 * kernel's scalar, so each row's bits are its one-row bits. */
AVX2 static inline __attribute__((always_inline)) void dot_q8_rows(int type, int bytes, int R, const uint8_t *w,
                                                                 const Act *a, int t, int nb, float *r) {
    __m256 acc[8], accm = _mm256_setzero_ps();
    float dd[8] __attribute__((aligned(32))), mm[8] __attribute__((aligned(32)));
    const float *dT = a->dT + t, *sT = a->sT + t;
    #pragma GCC unroll 8
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += bytes) {
        const __m256i x = block_values(type, w);
        const size_t at = (size_t)b * a->ts;
        _mm256_store_ps(dd, _mm256_mul_ps(_mm256_set1_ps(H2F(w)), _mm256_loadu_ps(dT + at)));
        if (HAS_MIN(type))
            accm = _mm256_add_ps(accm, _mm256_mul_ps(_mm256_set1_ps(H2F(w + 2)), _mm256_loadu_ps(sT + at)));
        #pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(a->q + ((size_t)(t + i) * nb + b) * 32));
            acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd + i), block_dot(type, x, y), acc[i]);
        }
    }
    _mm256_store_ps(mm, accm);
    #pragma GCC unroll 8
    for (int i = 0; i < R; i++) r[i] = HAS_MIN(type) ? hsum_avx(acc[i]) + mm[i] : hsum_avx(acc[i]);
}
#define Q8_KERNELS(name, TYPE, BYTES)                                                               \
    AVX2 static float dot_##name##_avx2(const uint8_t *w, const Act *a, int t, int nb) {            \
        return dot_q8_row(TYPE, BYTES, w, a, t, nb);                                                \
    }                                                                                               \
    AVX2 static void dotR_##name##_avx2(const uint8_t *w, const Act *a, int t, int nb, int R, float *r) { \
        switch (R) {                 /* R a constant in each copy: the row loop unrolled */          \
        case 2: dot_q8_rows(TYPE, BYTES, 2, w, a, t, nb, r); break;                                 \
        case 3: dot_q8_rows(TYPE, BYTES, 3, w, a, t, nb, r); break;                                 \
        case 4: dot_q8_rows(TYPE, BYTES, 4, w, a, t, nb, r); break;                                 \
        case 5: dot_q8_rows(TYPE, BYTES, 5, w, a, t, nb, r); break;                                 \
        case 6: dot_q8_rows(TYPE, BYTES, 6, w, a, t, nb, r); break;                                 \
        case 7: dot_q8_rows(TYPE, BYTES, 7, w, a, t, nb, r); break;                                 \
        default: dot_q8_rows(TYPE, BYTES, 8, w, a, t, nb, r);                                       \
        }                                                                                           \
    }
Q8_KERNELS(q4_0, T_Q4_0, 18)
Q8_KERNELS(q4_1, T_Q4_1, 20)
Q8_KERNELS(q5_0, T_Q5_0, 22)
Q8_KERNELS(q5_1, T_Q5_1, 24)
Q8_KERNELS(q8_0, T_Q8_0, 34)

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
AVX2 static float dot_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps(); __m128 acc_m = _mm_setzero_ps();
    for (int b = 0; b < nb; b++, w += 144, q8 += 256, bs += 16) {
        const float d = yd[b] * H2F(w), dmin = -yd[b] * H2F(w + 2);
        uint32_t u[4]; unpack_k4_scales(w + 4, u);
        const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *)bs);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
        const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        const __m128i sc128 = _mm256_extracti128_si256(ms, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        const uint8_t *q4 = w + 16; const int8_t *y = q8;
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
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    return hsum_avx(acc) + _mm_cvtss_f32(acc_m);
}
AVX2 static float dot_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
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
AVX2 static float dot_q6_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q8 = a->q + (size_t)t * nb * 256; const float *yd = a->d + (size_t)t * nb;
    const int16_t *bs = a->bs + (size_t)t * nb * 16;
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 210, q8 += 256, bs += 16) {
        const float d = yd[b] * H2F(w + 208);
        const uint8_t *q4 = w, *qh = w + 128; const int8_t *y = q8;
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
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_avx(acc);
}
/* Four activation rows against one K-quant weight row: the block's unpacking is shared, each
 * row's operations are the one-row kernel's, in its order — the same bits. */
AVX2 static void dot4_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
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
AVX2 static void dot4_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
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
AVX2 static void dot4_q6_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res) {
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
/* F16 weights as llama.cpp multiplies them (tinyBLAS, for one row or many): the activations
 * rounded to fp16, 8 lanes of FMAs along the row, then the lanes' sum. */
AVX2 static float dot_f16_avx2(const uint8_t *w, const float *x, int K) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < K; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i))), _mm256_loadu_ps(x + i), acc);
    return hsum_avx(acc);
}
AVX2 static void dot4_f16_avx2(const uint8_t *w, const Act *a, int t, int K, float *r) {
    const float *x0 = a->xr + (size_t)t * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int i = 0; i < K; i += 8) {
        __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
        c0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + i), c0);
        c1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1 + i), c1);
        c2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x2 + i), c2);
        c3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x3 + i), c3);
    }
    r[0] = hsum_avx(c0); r[1] = hsum_avx(c1); r[2] = hsum_avx(c2); r[3] = hsum_avx(c3);
}
AVX2 static inline __m256i scale_shuffle_q3k(int i) { /* int16 scale 2i in lane 0, 2i+1 in lane 1 */
    return _mm256_set_m128i(_mm_set1_epi16((short)((4 * i + 2) | ((4 * i + 3) << 8))),
                            _mm_set1_epi16((short)((4 * i) | ((4 * i + 1) << 8))));
}
AVX2 static float dot_q2_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
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
AVX2 static float dot_q3_K_avx2(const uint8_t *w, const Act *a, int t, int nb) {
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

/* One row's dot product if this type has an AVX2 kernel (1), else 0: the caller runs the
 * portable one. */
/* MXFP4 as ggml's AVX2 vec_dot_mxfp4_q8_0: the 4-bit codes looked up as doubled integers, two
 * accumulators over alternate blocks, the last odd block in the scalar order. */
AVX2 static float dot_mxfp4_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    const __m128i values = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4), m4 = _mm_set1_epi8(0x0f);
    __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *w1 = w + (size_t)b * 17, *w2 = w1 + 17;
        __m128i c1 = _mm_loadu_si128((const __m128i *)(w1 + 1)), c2 = _mm_loadu_si128((const __m128i *)(w2 + 1));
        __m256i x1 = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(c1, 4), m4)),
                                      _mm_shuffle_epi8(values, _mm_and_si128(c1, m4)));
        __m256i x2 = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(c2, 4), m4)),
                                      _mm_shuffle_epi8(values, _mm_and_si128(c2, m4)));
        __m256 p1 = sum_i8_pairs(x1, _mm256_loadu_si256((const __m256i *)(q + (size_t)b * 32)));
        __m256 p2 = sum_i8_pairs(x2, _mm256_loadu_si256((const __m256i *)(q + (size_t)(b + 1) * 32)));
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * e8m0_to_fp32_half(w1[0])), p1, acc1);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(d[b + 1] * e8m0_to_fp32_half(w2[0])), p2, acc2);
    }
    float sum = hsum_avx(_mm256_add_ps(acc1, acc2));
    for (; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 17, *qs = wb + 1; const int8_t *y = q + (size_t)b * 32; int s1 = 0, s2 = 0;
        for (int j = 0; j < 16; j++) { s1 += y[j] * KVALUES_MXFP4[qs[j] & 0xf]; s2 += y[j + 16] * KVALUES_MXFP4[qs[j] >> 4]; }
        sum = fmaf(d[b] * e8m0_to_fp32_half(wb[0]), (float)(s1 + s2), sum);
    }
    return sum;
}

int dot_row_avx2(int type, const uint8_t *w, const Act *a, int t, int K, int nb, float *out) {
    switch (type) {
    case T_Q4_0: *out = dot_q4_0_avx2(w, a, t, nb); return 1;
    case T_Q4_1: *out = dot_q4_1_avx2(w, a, t, nb); return 1;
    case T_Q8_0: *out = dot_q8_0_avx2(w, a, t, nb); return 1;
    case T_MXFP4: *out = dot_mxfp4_avx2(w, a, t, nb); return 1;
    case T_Q5_0: *out = dot_q5_0_avx2(w, a, t, nb); return 1;
    case T_Q5_1: *out = dot_q5_1_avx2(w, a, t, nb); return 1;
    case T_Q2_K: *out = dot_q2_K_avx2(w, a, t, nb); return 1;
    case T_Q3_K: *out = dot_q3_K_avx2(w, a, t, nb); return 1;
    case T_Q4_K: *out = dot_q4_K_avx2(w, a, t, nb); return 1;
    case T_Q5_K: *out = dot_q5_K_avx2(w, a, t, nb); return 1;
    case T_Q6_K: *out = dot_q6_K_avx2(w, a, t, nb); return 1;
    case T_F32: *out = dot_f32_avx2((const float *)w, a->xf + (size_t)t * K, K); return 1;
    case T_F16: if (K % 8) return 0; *out = dot_f16_avx2(w, a->xr + (size_t)t * K, K); return 1;
    }
    return 0;
}

/* One 32-value block quantized to Q8 as quantize_row's scalar loop does it (the same amax, the
 * same x * (127 / amax) products rounded half to even, the same clamp): returns the sum of the
 * quantized values and the absolute maximum. */
AVX2 int quantize_q8_block_avx2(const float *x, int8_t *q, float *amax_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m);     /* a NaN is skipped, as the scalar ">" does */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256i i32[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i32[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
        total = _mm256_add_epi32(total, i32[j]);
    }
    /* pack 4 x 8 int32 to 32 int8 in order (packs work per 128-bit lane: undo with a permute) */
    __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p8);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *amax_out = amax;
    return _mm_cvtsi128_si32(t);
}

/* Does this type have a four-row kernel (same bits as four one-row calls)? */
int has_dot4_avx2(int type, int K) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 ||
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || (type == T_F16 && K % 8 == 0);
}

void dot4_avx2(int type, const uint8_t *w, const Act *a, int t, int K, int nb, float *res) {
    switch (type) {
    case T_F16: dot4_f16_avx2(w, a, t, K, res); break;
    case T_Q4_0: dotR_q4_0_avx2(w, a, t, nb, 4, res); break;
    case T_Q4_1: dotR_q4_1_avx2(w, a, t, nb, 4, res); break;
    case T_Q5_0: dotR_q5_0_avx2(w, a, t, nb, 4, res); break;
    case T_Q5_1: dotR_q5_1_avx2(w, a, t, nb, 4, res); break;
    case T_Q4_K: dot4_q4_K_avx2(w, a, t, nb, res); break;
    case T_Q5_K: dot4_q5_K_avx2(w, a, t, nb, res); break;
    case T_Q6_K: dot4_q6_K_avx2(w, a, t, nb, res); break;
    default: dotR_q8_0_avx2(w, a, t, nb, 4, res);
    }
}
/* Eight activation rows against one weight row (a batch of 8+ decode rows: one unpacking of each
 * weight block for all eight), for the Q8-activation types: 0 when the type has none. */
/* Two to eight activation rows against one weight row, for the Q8-activation types (a batched
 * decode step, a draft being checked, prefill): 0 when the type has none. */
int dotR_avx2(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res) {
    switch (type) {
    case T_Q4_0: dotR_q4_0_avx2(w, a, t, nb, R, res); return 1;
    case T_Q4_1: dotR_q4_1_avx2(w, a, t, nb, R, res); return 1;
    case T_Q5_0: dotR_q5_0_avx2(w, a, t, nb, R, res); return 1;
    case T_Q5_1: dotR_q5_1_avx2(w, a, t, nb, R, res); return 1;
    case T_Q8_0: dotR_q8_0_avx2(w, a, t, nb, R, res); return 1;
    }
    return 0;
}
#endif
