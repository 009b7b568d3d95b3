/* AVX-512 VNNI kernels for activation rows against Q4_0, Q8_0 or MXFP4 weight rows (prefill, a
 * batched step, a decode step's one row), on CPUs that have it (g_avx512; KILN_SIMD=avx2 turns it off).
 *
 * They compute the AVX2 kernels' bits (dot_avx2.c dot_q8_rows, ggml's vec_dot order): a block's
 * eight int32 lanes — each the sum of four consecutive products, exact — come from one vpdpbusd
 * over two (weight row, activation row) pairs at once, where AVX2 takes a sign, a maddubs and a
 * madd per pair; everything after the integers — d_w × d_x, the FMA per block into eight float
 * lanes, the lanes' sum — is the AVX2 kernel's, operation for operation, two pairs a register.
 * A prompt takes two or four weight rows at a time (dotRW_q8_512: each activation block loaded
 * once for all, the sign work once per weight block); one weight row against several activation
 * rows (dotR_q8_512) serves an odd last row and the types without the former. */
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

/* 2P weight rows w[0..2P-1] (P = 1 or 2) against R activation rows: the same integers and float
 * steps as dotR_q8_512 for every (weight row, activation row). A register holds two weight rows'
 * blocks side by side against one activation row's block in both halves; the activations' side
 * is unsigned (Act.qu = y + 128) and each lane starts from -128 × its weights' sum, so the sign
 * work is once per weight block for all R rows, where dotR_q8_512 signs every activation block.
 * Each activation block is loaded once for the 2P weight rows. res: w[0]'s R sums, then w[1]'s… */
AVX512 static inline __attribute__((always_inline)) void dotRW_q8_512(int q8, int P, const uint8_t *const *w,
                                                                      const Act *a, int t, int nb, int R, float *res) {
    const int bytes = q8 ? 34 : 18;
    const float *dT = a->dT + t;
    const size_t ts = (size_t)a->ts, row = (size_t)nb * 32;
    __m512 acc[2][8];
    for (int p = 0; p < P; p++) for (int r = 0; r < R; r++) acc[p][r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i xw[2], corr[2];
        __m512 dw[2];
        for (int p = 0; p < P; p++) {
            const uint8_t *wa = w[2 * p] + (size_t)b * bytes, *wb = w[2 * p + 1] + (size_t)b * bytes;
            const __m256i xa = q8 ? _mm256_loadu_si256((const __m256i *)(wa + 2))
                                  : _mm256_sub_epi8(nibbles32(wa + 2), _mm256_set1_epi8(8));
            const __m256i xb = q8 ? _mm256_loadu_si256((const __m256i *)(wb + 2))
                                  : _mm256_sub_epi8(nibbles32(wb + 2), _mm256_set1_epi8(8));
            /* (y + 128) · w - 128 Σ w: each lane's four products, exactly */
            xw[p] = pair512(xa, xb);
            corr[p] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                       _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), xw[p]));
            dw[p] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(H2F(wa)))),
                                                        _mm256_castps_pd(_mm256_set1_ps(H2F(wb))), 1));
        }
        const float *dx = dT + b * ts;       /* (wa, row r)'s scale d_w d_x into lanes 0-7, (wb, row r)'s into 8-15 */
        const uint8_t *y = a->qu + ((size_t)t * nb + b) * 32;
        for (int r = 0; r < R; r++, y += row) {
            const __m512i yu = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)y));
            const __m512 d = _mm512_set1_ps(dx[r]);
            for (int p = 0; p < P; p++)
                acc[p][r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[p], d), _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[p], yu, xw[p])),
                                            acc[p][r]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++) {
            res[2 * p * R + r] = hsum_avx(_mm512_castps512_ps256(acc[p][r]));
            res[(2 * p + 1) * R + r] = hsum_avx(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][r]), 1)));
        }
}

/* One activation row against one Q4_0/Q8_0 weight row (a decode step), two blocks a register: the
 * weights' side unsigned — Q4_0's nibbles as they are, Q8_0's values + 128 — and each lane started
 * from the activations' correction (Act.ys: -8 × its four values' sum; × 16 for Q8_0's 128), so
 * the integers are the AVX2 kernel's with no sign work; then each block's FMA into the same eight
 * lanes in block order, and their sum: the one-row AVX2 kernel's bits. (Several weight rows at
 * once, to overlap their FMA chains, streamed from memory at half the rate: measured, dropped.) */
AVX512 static inline __attribute__((always_inline)) float dot1_q8_512(int q8, const uint8_t *w, const Act *a, int t, int nb) {
    const int bytes = q8 ? 34 : 18;
    const int8_t *y = a->q + (size_t)t * nb * 32;
    const int32_t *ys = a->ys + (size_t)t * nb * 8;
    const float *dy = a->d + (size_t)t * nb;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2, w += 2 * bytes) {
        prefetch_stream(w, 2 * bytes);
        __m512i u, init = _mm512_loadu_si512((const void *)(ys + (size_t)b * 8));
        if (q8) {
            u = _mm512_xor_si512(pair512(_mm256_loadu_si256((const __m256i *)(w + 2)),
                                         _mm256_loadu_si256((const __m256i *)(w + bytes + 2))), _mm512_set1_epi8((char)0x80));
            init = _mm512_slli_epi32(init, 4);
        } else {
            const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 2))),
                                                      _mm_loadu_si128((const __m128i *)(w + bytes + 2)), 1);
            const __m512i lh = pair512(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            u = _mm512_shuffle_i64x2(lh, lh, _MM_SHUFFLE(3, 1, 2, 0));   /* block b's 32 values, then b + 1's */
        }
        const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, _mm512_loadu_si512((const void *)(y + (size_t)b * 32))));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w) * dy[b]), _mm512_castps512_ps256(f), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w + bytes) * dy[b + 1]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)), acc);
    }
    if (b < nb) {                             /* an odd last block */
        __m256i init = _mm256_loadu_si256((const __m256i *)(ys + (size_t)b * 8));
        const __m256i u = q8 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_set1_epi8((char)0x80))
                             : nibbles32(w + 2);
        if (q8) init = _mm256_slli_epi32(init, 4);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(init, u, _mm256_loadu_si256((const __m256i *)(y + (size_t)b * 32))));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w) * dy[b]), f, acc);
    }
    return hsum_avx(acc);
}

/* One activation row against one MXFP4 weight row (a decode step's expert), as dot_mxfp4_avx2.c's
 * one-row kernel computes it: two blocks a register, the codes looked up as their doubled values
 * + 12 (unsigned) with each lane started from -12 × its activations' four-value sum (Act.ys × 3/2,
 * exact), so the lanes are the AVX2 kernel's integers; even blocks' lanes in the low half, odd
 * blocks' in the high — its two accumulators as one register —, summed at the end; an odd last
 * block in the scalar order. */
AVX512 static inline __attribute__((always_inline)) float dot1_mxfp4_512(const uint8_t *w, const Act *a, int t, int nb) {
    static const int8_t plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
    const int8_t *y = a->q + (size_t)t * nb * 32;
    const int32_t *ys = a->ys + (size_t)t * nb * 8;
    const float *dy = a->d + (size_t)t * nb;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)plus12));
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2, w += 34) {
        prefetch_stream(w, 34);
        const __m512i ys8 = _mm512_loadu_si512((const void *)(ys + (size_t)b * 8));
        const __m512i init = _mm512_add_epi32(ys8, _mm512_srai_epi32(ys8, 1));          /* -8 S - 4 S */
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 1))),
                                                  _mm_loadu_si128((const __m128i *)(w + 18)), 1);
        const __m512i lh = pair512(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        const __m512i u = _mm512_shuffle_epi8(table, _mm512_shuffle_i64x2(lh, lh, _MM_SHUFFLE(3, 1, 2, 0)));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, _mm512_loadu_si512((const void *)(y + (size_t)b * 32))));
        const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(dy[b] * e8m0_to_fp32_half(w[0])))),
            _mm256_castps_pd(_mm256_set1_ps(dy[b + 1] * e8m0_to_fp32_half(w[17]))), 1));
        acc = _mm512_fmadd_ps(d, f, acc);
    }
    float sum = hsum_avx(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
    for (; b < nb; b++, w += 17) {
        const int8_t *yb = y + (size_t)b * 32;
        int s1 = 0, s2 = 0;
        for (int j = 0; j < 16; j++) { s1 += yb[j] * KVALUES_MXFP4[w[1 + j] & 0xf]; s2 += yb[j + 16] * KVALUES_MXFP4[w[1 + j] >> 4]; }
        sum = fmaf(dy[b] * e8m0_to_fp32_half(w[0]), (float)(s1 + s2), sum);
    }
    return sum;
}

/* MXFP4 (gpt-oss's experts) as dot_mxfp4_avx2.c's MXFP4_ROWS computes it, two rows a register:
 * the 4-bit codes looked up as doubled integers, a block's eight int32 lanes from one vpdpbusd
 * (|codes| <= 12: the AVX2 kernel's int16 pair sums never saturate, so the lanes are equal), even
 * blocks into one accumulator and odd ones into another, summed at the end; an odd last block in
 * the scalar order. */
AVX512 static inline __attribute__((always_inline)) void dotR_mxfp4_512(const uint8_t *w, const Act *a, int t,
                                                                        int nb, int R, float *res) {
    const __m128i values = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4), m4 = _mm_set1_epi8(0x0f);
    const float *dT = a->dT + t;
    const size_t ts = (size_t)a->ts, row = (size_t)nb * 32;
    __m512 acc[2][4];
    __m512i pick[4];
    for (int p = 0; p < R / 2; p++) {         /* row 2p's scale into lanes 0-7, row 2p+1's into 8-15 */
        int idx[16];
        for (int i = 0; i < 16; i++) idx[i] = 2 * p + i / 8;
        pick[p] = _mm512_loadu_si512((const void *)idx);
        acc[0][p] = acc[1][p] = _mm512_setzero_ps();
    }
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        if (R == 4) prefetch_stream(w + (size_t)b * 17, 34);   /* a few sequences' decode step */
        for (int h = 0; h < 2; h++) {
            const uint8_t *wb = w + (size_t)(b + h) * 17;
            const __m128i c = _mm_loadu_si128((const __m128i *)(wb + 1));
            const __m256i x = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(c, 4), m4)),
                                               _mm_shuffle_epi8(values, _mm_and_si128(c, m4)));
            const __m512i xw = pair512(x, x), ax = _mm512_abs_epi8(xw);
            const __mmask64 neg = _mm512_movepi8_mask(xw);
            const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(dT + (size_t)(b + h) * ts),
                                                                  _mm256_set1_ps(e8m0_to_fp32_half(wb[0]))));
            const int8_t *y = a->q + ((size_t)t * nb + b + h) * 32;
            for (int p = 0; p < R / 2; p++, y += 2 * row) {
                const __m512i yy = pair512(_mm256_loadu_si256((const __m256i *)y), _mm256_loadu_si256((const __m256i *)(y + row)));
                const __m512i sy = _mm512_mask_sub_epi8(yy, neg, _mm512_setzero_si512(), yy);
                const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sy);
                acc[h][p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick[p], d), _mm512_cvtepi32_ps(s), acc[h][p]);
            }
        }
    }
    float lanes[8 * 8];
    for (int p = 0; p < R / 2; p++) _mm512_storeu_ps(lanes + 16 * p, _mm512_add_ps(acc[0][p], acc[1][p]));
    for (int r = 0; r < R; r++) {
        const int8_t *q = a->q + (size_t)(t + r) * nb * 32; const float *dr = a->d + (size_t)(t + r) * nb;
        float sum = hsum_avx(_mm256_loadu_ps(lanes + 8 * r));
        for (int bb = b; bb < nb; bb++) {
            const uint8_t *wb = w + (size_t)bb * 17, *qs = wb + 1; const int8_t *yv = q + (size_t)bb * 32;
            int s1 = 0, s2 = 0;
            for (int j = 0; j < 16; j++) { s1 += yv[j] * KVALUES_MXFP4[qs[j] & 0xf]; s2 += yv[j + 16] * KVALUES_MXFP4[qs[j] >> 4]; }
            sum = fmaf(dr[bb] * e8m0_to_fp32_half(wb[0]), (float)(s1 + s2), sum);
        }
        res[r] = sum;
    }
}

/* R activation rows from t against one Q4_0/Q8_0/MXFP4 weight row: 0 when the type has none. R is 8 or
 * 4 (constants: the row loops unroll, the sums stay in registers). */
AVX512 int dotR_q8_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res) {
    switch (type) {                           /* each a copy with its type and R constant */
    case T_Q4_0: if (R == 8) dotR_q8_512(0, w, a, t, nb, 8, res); else dotR_q8_512(0, w, a, t, nb, 4, res); return 1;
    case T_Q8_0: if (R == 8) dotR_q8_512(1, w, a, t, nb, 8, res); else dotR_q8_512(1, w, a, t, nb, 4, res); return 1;
    case T_MXFP4: if (R == 8) dotR_mxfp4_512(w, a, t, nb, 8, res); else dotR_mxfp4_512(w, a, t, nb, 4, res); return 1;
    }
    return 0;
}

/* R activation rows from t (R 8 or 4) against nw weight rows w[] (2 or 4) of Q4_0/Q8_0, with
 * a->qu (res: w[0]'s R sums, then w[1]'s…): 0 when the type has none. */
AVX512 int dotRW_q8_avx512(int type, const uint8_t *const *w, int nw, const Act *a, int t, int nb, int R, float *res) {
    if ((type != T_Q4_0 && type != T_Q8_0) || !a->qu || (nw != 2 && nw != 4) || (R != 4 && R != 8)) return 0;
    const int q8 = type == T_Q8_0;
    if (q8) {                                 /* each a copy with its constants: the loops unroll */
        if (nw == 4) { if (R == 8) dotRW_q8_512(1, 2, w, a, t, nb, 8, res); else dotRW_q8_512(1, 2, w, a, t, nb, 4, res); }
        else if (R == 8) dotRW_q8_512(1, 1, w, a, t, nb, 8, res); else dotRW_q8_512(1, 1, w, a, t, nb, 4, res);
    } else {
        if (nw == 4) { if (R == 8) dotRW_q8_512(0, 2, w, a, t, nb, 8, res); else dotRW_q8_512(0, 2, w, a, t, nb, 4, res); }
        else if (R == 8) dotRW_q8_512(0, 1, w, a, t, nb, 8, res); else dotRW_q8_512(0, 1, w, a, t, nb, 4, res);
    }
    return 1;
}
/* One activation row (with a->ys) against one Q4_0/Q8_0/MXFP4 weight row: 0 when the type has none. */
AVX512 int dot_row_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, float *out) {
    if (!a->ys) return 0;
    switch (type) {
    case T_Q4_0: *out = dot1_q8_512(0, w, a, t, nb); return 1;
    case T_Q8_0: *out = dot1_q8_512(1, w, a, t, nb); return 1;
    case T_MXFP4: *out = dot1_mxfp4_512(w, a, t, nb); return 1;
    }
    return 0;
}
#endif
