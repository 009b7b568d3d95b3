/* AVX2/FMA dot products, ported from ggml's x86 vec_dot kernels (and tinyBLAS's for F16/F32):
 * the same integer block products, the same FMAs in the same lanes, the same horizontal sums —
 * so a product is the bits llama.cpp computes (see tests/data/README.md for where llama.cpp
 * itself takes other paths). Activations come quantized by quant.c (Q8_K with its 16-value sums,
 * d positive: ggml's sign convention gives the same products). Compiled with target attributes;
 * quant.c calls in only when the CPU has AVX2, FMA and F16C. Multi-row variants (2 to 8 rows)
 * share a weight block's unpacking across the activation rows and keep each row's operations in
 * order, so a row's bits do not depend on the batch it is in. The K-quants are in
 * dot_kquants_avx2.c; this file also quantizes activations to Q8 (quantize_q8_block_avx2). */
#include "kiln.h"

#ifdef KILN_X86

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
        prefetch_stream(w, bytes);
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
        if (R <= 4) prefetch_stream(w, bytes);   /* a few sequences' decode step */
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
/* One activation row against two consecutive weight rows: the two rows' chains interleaved (a
 * decode step's rows are short — K = 576 is 18 blocks — and one row's FMA chain leaves the core
 * waiting on its own latency); each row's operations are dot_q8_row's, in its order. */
AVX2 static inline __attribute__((always_inline)) void dot_q8_row2(int type, int bytes, const uint8_t *w0,
                                                                 size_t row_bytes, const Act *a, int t, int nb, float *r) {
    const uint8_t *w1 = w0 + row_bytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); float m0 = 0.f, m1 = 0.f;
    for (int b = 0; b < nb; b++, w0 += bytes, w1 += bytes) {
        if (((uintptr_t)w0 & 63) < (uintptr_t)bytes) {    /* a new cache line: ask for the rows ahead's */
            _mm_prefetch((const char *)w0 + KILN_PF_ROWS * row_bytes, _MM_HINT_T0);
            _mm_prefetch((const char *)w1 + KILN_PF_ROWS * row_bytes, _MM_HINT_T0);
        }
        const size_t blk = (size_t)t * nb + b;
        const __m256i y = _mm256_loadu_si256((const __m256i *)(a->q + blk * 32));
        const float dx = a->d[blk];
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w0) * dx), block_dot(type, block_values(type, w0), y), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w1) * dx), block_dot(type, block_values(type, w1), y), acc1);
        if (HAS_MIN(type)) { const float s = a->s[blk]; m0 += H2F(w0 + 2) * s; m1 += H2F(w1 + 2) * s; }
    }
    r[0] = HAS_MIN(type) ? hsum_avx(acc0) + m0 : hsum_avx(acc0);
    r[1] = HAS_MIN(type) ? hsum_avx(acc1) + m1 : hsum_avx(acc1);
}
/* R (2 to 4) activation rows against two consecutive weight rows: dot_q8_rows for each weight
 * row, the activation blocks loaded once for both — each (weight row, activation row) the same
 * operations in the same order, so the bits are dot_q8_rows' (and so the one-row kernel's).
 * r: the first weight row's R results, then the second's. */
AVX2 static inline __attribute__((always_inline)) void dot_q8_rows2(int type, int bytes, int R, const uint8_t *w0,
                                                                  size_t row_bytes, const Act *a, int t, int nb, float *r) {
    const uint8_t *w1 = w0 + row_bytes;
    __m256 acc0[4], acc1[4], accm0 = _mm256_setzero_ps(), accm1 = _mm256_setzero_ps();
    float d0[8] __attribute__((aligned(32))), d1[8] __attribute__((aligned(32)));
    float m0[8] __attribute__((aligned(32))), m1[8] __attribute__((aligned(32)));
    const float *dT = a->dT + t, *sT = a->sT + t;
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w0 += bytes, w1 += bytes) {
        if (((uintptr_t)w0 & 63) < (uintptr_t)bytes) {
            _mm_prefetch((const char *)w0 + KILN_PF_ROWS * row_bytes, _MM_HINT_T0);
            _mm_prefetch((const char *)w1 + KILN_PF_ROWS * row_bytes, _MM_HINT_T0);
        }
        const __m256i x0 = block_values(type, w0), x1 = block_values(type, w1);
        const size_t at = (size_t)b * a->ts;
        const __m256 dx = _mm256_loadu_ps(dT + at);
        _mm256_store_ps(d0, _mm256_mul_ps(_mm256_set1_ps(H2F(w0)), dx));
        _mm256_store_ps(d1, _mm256_mul_ps(_mm256_set1_ps(H2F(w1)), dx));
        if (HAS_MIN(type)) {
            const __m256 sx = _mm256_loadu_ps(sT + at);
            accm0 = _mm256_add_ps(accm0, _mm256_mul_ps(_mm256_set1_ps(H2F(w0 + 2)), sx));
            accm1 = _mm256_add_ps(accm1, _mm256_mul_ps(_mm256_set1_ps(H2F(w1 + 2)), sx));
        }
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(a->q + ((size_t)(t + i) * nb + b) * 32));
            acc0[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(d0 + i), block_dot(type, x0, y), acc0[i]);
            acc1[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(d1 + i), block_dot(type, x1, y), acc1[i]);
        }
    }
    _mm256_store_ps(m0, accm0); _mm256_store_ps(m1, accm1);
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        r[i] = HAS_MIN(type) ? hsum_avx(acc0[i]) + m0[i] : hsum_avx(acc0[i]);
        r[R + i] = HAS_MIN(type) ? hsum_avx(acc1[i]) + m1[i] : hsum_avx(acc1[i]);
    }
}
#define Q8_KERNELS(name, TYPE, BYTES)                                                               \
    AVX2 static float dot_##name##_avx2(const uint8_t *w, const Act *a, int t, int nb) {            \
        return dot_q8_row(TYPE, BYTES, w, a, t, nb);                                                \
    }                                                                                               \
    AVX2 static void dotW2_##name##_avx2(const uint8_t *w, size_t rb, const Act *a, int t, int nb, float *r) { \
        dot_q8_row2(TYPE, BYTES, w, rb, a, t, nb, r);                                              \
    }                                                                                               \
    AVX2 static void dotRW2_##name##_avx2(const uint8_t *w, size_t rb, const Act *a, int t, int nb, int R, float *r) { \
        switch (R) {                                                                                \
        case 2: dot_q8_rows2(TYPE, BYTES, 2, w, rb, a, t, nb, r); break;                            \
        case 3: dot_q8_rows2(TYPE, BYTES, 3, w, rb, a, t, nb, r); break;                            \
        default: dot_q8_rows2(TYPE, BYTES, 4, w, rb, a, t, nb, r);                                 \
        }                                                                                           \
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

/* F16 weights as llama.cpp multiplies them (tinyBLAS, for one row or many): the activations
 * rounded to fp16, 8 lanes of FMAs along the row, then the lanes' sum. */
AVX2 static float dot_f16_avx2(const uint8_t *w, const float *x, int K) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < K; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i))), _mm256_loadu_ps(x + i), acc);
    return hsum_avx(acc);
}
/* A row of K not a multiple of 8 (a 14-pixel patch: 588), which tinyBLAS declines: ggml_vec_dot_f16
 * — four 8-lane FMA accumulators over steps of 32, summed 0+2, 1+3, then 0+1, across the lanes by
 * hadds, and the products past the last step added in double. */
AVX2 static float dot_f16_vec_avx2(const uint8_t *w, const float *x, int K) {
    const int np = K & ~31;
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < np; i += 32)
        for (int j = 0; j < 4; j++)
            s[j] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * (i + 8 * j)))),
                                   _mm256_loadu_ps(x + i + 8 * j), s[j]);
    s[0] = _mm256_add_ps(s[0], s[2]);
    s[1] = _mm256_add_ps(s[1], s[3]);
    s[0] = _mm256_add_ps(s[0], s[1]);
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(s[0]), _mm256_extractf128_ps(s[0], 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    double sum = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    for (int i = np; i < K; i++)
        sum += (double)(fp16_to_fp32(rd16(w + 2 * i)) * x[i]);
    return (float)sum;
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
    case T_F16: *out = (K % 8 ? dot_f16_vec_avx2 : dot_f16_avx2)(w, a->xr + (size_t)t * K, K); return 1;
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
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || type == T_MXFP4 || (type == T_F16 && K % 8 == 0);
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
    case T_MXFP4: dotR_mxfp4_avx2(w, a, t, nb, 4, res); break;
    default: dotR_q8_0_avx2(w, a, t, nb, 4, res);
    }
}
/* One activation row against two consecutive weight rows (row_bytes apart), for the
 * Q8-activation types: 0 when the type has none. */
int dotW2_avx2(int type, const uint8_t *w, size_t row_bytes, const Act *a, int t, int nb, float *res) {
    switch (type) {
    case T_Q4_0: dotW2_q4_0_avx2(w, row_bytes, a, t, nb, res); return 1;
    case T_Q4_1: dotW2_q4_1_avx2(w, row_bytes, a, t, nb, res); return 1;
    case T_Q5_0: dotW2_q5_0_avx2(w, row_bytes, a, t, nb, res); return 1;
    case T_Q5_1: dotW2_q5_1_avx2(w, row_bytes, a, t, nb, res); return 1;
    case T_Q8_0: dotW2_q8_0_avx2(w, row_bytes, a, t, nb, res); return 1;
    }
    return 0;
}
/* R (2 to 4) activation rows from t against two consecutive weight rows (row_bytes apart), for
 * the Q8-activation types: res holds the first weight row's R results, then the second's; 0 when
 * the type has none. */
int dotRW2_avx2(int type, const uint8_t *w, size_t row_bytes, const Act *a, int t, int nb, int R, float *res) {
    switch (type) {
    case T_Q4_0: dotRW2_q4_0_avx2(w, row_bytes, a, t, nb, R, res); return 1;
    case T_Q4_1: dotRW2_q4_1_avx2(w, row_bytes, a, t, nb, R, res); return 1;
    case T_Q5_0: dotRW2_q5_0_avx2(w, row_bytes, a, t, nb, R, res); return 1;
    case T_Q5_1: dotRW2_q5_1_avx2(w, row_bytes, a, t, nb, R, res); return 1;
    case T_Q8_0: dotRW2_q8_0_avx2(w, row_bytes, a, t, nb, R, res); return 1;
    }
    return 0;
}
/* Two to eight activation rows against one weight row, for the Q8-activation types (a batched
 * decode step, a draft being checked, prefill): 0 when the type has none. */
int dotR_avx2(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res) {
    switch (type) {
    case T_Q4_0: dotR_q4_0_avx2(w, a, t, nb, R, res); return 1;
    case T_Q4_1: dotR_q4_1_avx2(w, a, t, nb, R, res); return 1;
    case T_Q5_0: dotR_q5_0_avx2(w, a, t, nb, R, res); return 1;
    case T_Q5_1: dotR_q5_1_avx2(w, a, t, nb, R, res); return 1;
    case T_Q8_0: dotR_q8_0_avx2(w, a, t, nb, R, res); return 1;
    case T_MXFP4: dotR_mxfp4_avx2(w, a, t, nb, R, res); return 1;
    }
    return 0;
}
#endif
