/* AVX-512 VNNI K-quant kernels for several activation rows against one weight row (prefill, a
 * batched step), on CPUs that have it (g_avx512; KILN_SIMD=avx2 turns it off).
 *
 * They compute the AVX2 kernels' bits (dot_kquants_rows_avx2.c, ggml's vec_dot order): ggml's
 * eight int32 lanes of a block's sum hold exact integers, so they may be summed in any order —
 * here two 32-value pieces side by side in one 512-bit register, the sub-block scale applied and
 * added in one vpdpwssd, the two halves folded at the block's end — and everything after the
 * integers (the FMA per block into eight float lanes, the minimums, the horizontal sums) is the
 * AVX2 kernel's, operation for operation. Half the instructions per product: the AVX2 kernel's
 * maddubs + madd + add per 32 values become one maddubs and one vpdpwssd per 64. */
#include "kiln.h"
#include "kquants_avx2.h"

#ifdef KILN_X86
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

AVX512 static inline __m512i pair512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
/* the eight lanes of ggml's block sum: the two halves' exact integers added */
AVX512 static inline __m256i fold512(__m512i s) {
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

/* lanes of a row-major vector of R rows' scalars, spread so that row r fills lanes r*W .. r*W+W-1 */
AVX512 static inline __m512i spread_rows(int first, int W) {
    int idx[16];
    for (int i = 0; i < 16; i++) idx[i] = first + i / W;
    return _mm512_loadu_si512((const void *)idx);
}
/* rows 2p and 2p+1's block sums (each folded to ggml's eight lanes) side by side */
AVX512 static inline __m512i fold_pair512(__m512i s0, __m512i s1) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(s0, s1, 0x44), _mm512_shuffle_i64x2(s0, s1, 0xEE));
}

/* The float steps of a block run for several rows in one register — two rows' eight lanes, four
 * rows' four minimum lanes — each lane the one-row kernel's operation on the same operands: the
 * scales as ggml multiplies them (yd * d, -yd * dmin), one FMA each. */
AVX512 static inline __attribute__((always_inline)) void dotR_q4_K_512(const uint8_t *w, const Act *a, int t, int nb,
                                                                       int R, float *res) {
    const int8_t *q8[8]; const float *yd[8]; const int16_t *bs[8];
    q8_K_rows(a, t, nb, R, q8, yd, bs);
    const float *dT = a->dT + t; const int16_t *kT = a->kT + (size_t)t * 8; const size_t ts = (size_t)a->ts;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256 neg = _mm256_set1_ps(-0.0f);
    __m512 acc[4], acc_m[2];
    __m512i pick_d[4], pick_m[2];
    for (int p = 0; p < R / 2; p++) { acc[p] = _mm512_setzero_ps(); pick_d[p] = spread_rows(2 * p, 8); }
    for (int g = 0; g < R / 4; g++) { acc_m[g] = _mm512_setzero_ps(); pick_m[g] = spread_rows(4 * g, 4); }
    for (int b = 0; b < nb; b++, w += 144) {
        if (R == 4) prefetch_stream(w, 144);     /* a few sequences' decode step */
        const float xd = H2F(w), xm = H2F(w + 2);
        __m128i mins; __m256i scales;
        k4_block_scales(w, &mins, &scales);
        __m512i sumi[8];
        for (int r = 0; r < R; r++) sumi[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const __m512i q = pair512(_mm256_and_si256(bits, m4), _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4));
            const __m512i s = pair512(_mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j)),
                                      _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1)));
            for (int r = 0; r < R; r++) {
                const __m512i y = _mm512_loadu_si512((const void *)(q8[r] + b * 256 + 64 * j));
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], s, _mm512_maddubs_epi16(q, y));
            }
        }
        /* the rows' scales of this block (dT holds 8 lanes past the last row) */
        const __m256 yd8 = _mm256_loadu_ps(dT + b * ts);
        const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(yd8, _mm256_set1_ps(xd)));
        const __m512 dmin = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_xor_ps(yd8, neg), _mm256_set1_ps(xm)));
        const __m512i mins4 = _mm512_broadcast_i32x4(mins);
        for (int g = 0; g < R / 4; g++) {
            const __m512i q8s = _mm512_loadu_si512((const void *)(kT + (b * ts + 4 * g) * 8));
            acc_m[g] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_m[g], dmin),
                                       _mm512_cvtepi32_ps(_mm512_madd_epi16(mins4, q8s)), acc_m[g]);
        }
        for (int p = 0; p < R / 2; p++)
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_d[p], d),
                                     _mm512_cvtepi32_ps(fold_pair512(sumi[2 * p], sumi[2 * p + 1])), acc[p]);
    }
    float lanes[8 * 8], mlanes[8 * 4];
    for (int p = 0; p < R / 2; p++) _mm512_storeu_ps(lanes + 16 * p, acc[p]);
    for (int g = 0; g < R / 4; g++) _mm512_storeu_ps(mlanes + 16 * g, acc_m[g]);
    for (int r = 0; r < R; r++) res[r] = q4_K_end(_mm256_loadu_ps(lanes + 8 * r), _mm_loadu_ps(mlanes + 4 * r));
}

AVX512 static inline __attribute__((always_inline)) void dotR_q5_K_512(const uint8_t *w, const Act *a, int t, int nb,
                                                                       int R, float *res) {
    const int8_t *q8[8]; const float *yd[8]; const int16_t *bs[8];
    q8_K_rows(a, t, nb, R, q8, yd, bs);
    const float *dT = a->dT + t; const int16_t *kT = a->kT + (size_t)t * 8; const size_t ts = (size_t)a->ts;
    const __m256i m4 = _mm256_set1_epi8(0xF), mone = _mm256_set1_epi8(1);
    const __m256 neg = _mm256_set1_ps(-0.0f);
    /* each row's minimum term of a block is an exact integer (its lane of a 128-bit group summed):
       the eight rows' gathered into one vector, then the one-row kernel's fmaf, eight at once */
    const __m512i gather = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4];
    __m512i pick_d[4];
    __m256 summs = _mm256_setzero_ps();
    for (int p = 0; p < R / 2; p++) { acc[p] = _mm512_setzero_ps(); pick_d[p] = spread_rows(2 * p, 8); }
    for (int b = 0; b < nb; b++, w += 176) {
        if (R == 4) prefetch_stream(w, 176);
        const float xd = H2F(w), xm = H2F(w + 2);
        __m128i mins; __m256i scales;
        k4_block_scales(w, &mins, &scales);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
        __m512i v[4], sc[4];
        __m256i hmask = mone;
        int bit = 0;
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * j));
            const __m256i h0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
            hmask = _mm256_slli_epi16(hmask, 1);
            const __m256i h1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
            hmask = _mm256_slli_epi16(hmask, 1);
            v[j] = pair512(_mm256_add_epi8(_mm256_and_si256(bits, m4), h0),
                           _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h1));
            sc[j] = pair512(_mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j)),
                            _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1)));
        }
        __m512i sumi[8];
        for (int r = 0; r < R; r++) {
            const int8_t *y = q8[r] + b * 256;
            sumi[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++)
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], sc[j], _mm512_maddubs_epi16(v[j], _mm512_loadu_si512((const void *)(y + 64 * j))));
        }
        const __m256 yd8 = _mm256_loadu_ps(dT + b * ts);
        const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(yd8, _mm256_set1_ps(xd)));
        for (int p = 0; p < R / 2; p++)
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_d[p], d),
                                     _mm512_cvtepi32_ps(fold_pair512(sumi[2 * p], sumi[2 * p + 1])), acc[p]);
        const __m512i mins4 = _mm512_broadcast_i32x4(mins);
        __m512i m0 = _mm512_madd_epi16(mins4, _mm512_loadu_si512((const void *)(kT + b * ts * 8))),
                m1 = R == 8 ? _mm512_madd_epi16(mins4, _mm512_loadu_si512((const void *)(kT + (b * ts + 4) * 8)))
                            : _mm512_setzero_si512();
        m0 = _mm512_add_epi32(m0, _mm512_shuffle_epi32(m0, 0x4E)); m0 = _mm512_add_epi32(m0, _mm512_shuffle_epi32(m0, 0xB1));
        m1 = _mm512_add_epi32(m1, _mm512_shuffle_epi32(m1, 0x4E)); m1 = _mm512_add_epi32(m1, _mm512_shuffle_epi32(m1, 0xB1));
        const __m256i msum = _mm512_castsi512_si256(_mm512_permutex2var_epi32(m0, gather, m1));
        summs = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_xor_ps(yd8, neg), _mm256_set1_ps(xm)), _mm256_cvtepi32_ps(msum), summs);
    }
    float lanes[8 * 8], ms[8];
    for (int p = 0; p < R / 2; p++) _mm512_storeu_ps(lanes + 16 * p, acc[p]);
    _mm256_storeu_ps(ms, summs);
    for (int r = 0; r < R; r++) res[r] = hsum_avx(_mm256_loadu_ps(lanes + 8 * r)) + ms[r];
}

AVX512 static inline __attribute__((always_inline)) void dotR_q6_K_512(const uint8_t *w, const Act *a, int t, int nb,
                                                                       int R, float *res) {
    const int8_t *q8[8]; const float *yd[8]; const int16_t *bs[8];
    q8_K_rows(a, t, nb, R, q8, yd, bs);
    const float *dT = a->dT + t; const size_t ts = (size_t)a->ts;
    __m512 acc[4];
    __m512i pick_d[4];
    for (int p = 0; p < R / 2; p++) { acc[p] = _mm512_setzero_ps(); pick_d[p] = spread_rows(2 * p, 8); }
    for (int b = 0; b < nb; b++, w += 210) {
        if (R == 4) prefetch_stream(w, 210);
        const float xd = H2F(w + 208);
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m512i v[4], sc[4];
        for (int j = 0; j < 2; j++) {
            __m256i h[4];
            q6_K_half(w, j, h);
            v[2 * j] = pair512(h[0], h[1]);
            v[2 * j + 1] = pair512(h[2], h[3]);
            for (int k = 0; k < 2; k++)
                sc[2 * j + k] = pair512(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(4 * j + 2 * k))),
                                        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_q6(4 * j + 2 * k + 1))));
        }
        __m512i sumi[8];
        for (int r = 0; r < R; r++) {
            const int8_t *y = q8[r] + b * 256;
            sumi[r] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++)
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], sc[k], _mm512_maddubs_epi16(v[k], _mm512_loadu_si512((const void *)(y + 64 * k))));
        }
        /* two rows a register: ggml's subtraction of 32 × the scaled sums, then the block's FMA */
        const __m512 d = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(dT + b * ts), _mm256_set1_ps(xd)));
        const __m512i sc2 = pair512(scales_16, scales_16);
        for (int p = 0; p < R / 2; p++) {
            const __m512i q8sums = pair512(_mm256_loadu_si256((const __m256i *)(bs[2 * p] + b * 16)),
                                           _mm256_loadu_si256((const __m256i *)(bs[2 * p + 1] + b * 16)));
            const __m512i sub = _mm512_slli_epi32(_mm512_madd_epi16(q8sums, sc2), 5);
            const __m512i s = _mm512_sub_epi32(fold_pair512(sumi[2 * p], sumi[2 * p + 1]), sub);
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_d[p], d), _mm512_cvtepi32_ps(s), acc[p]);
        }
    }
    float lanes[8 * 8];
    for (int p = 0; p < R / 2; p++) _mm512_storeu_ps(lanes + 16 * p, acc[p]);
    for (int r = 0; r < R; r++) res[r] = hsum_avx(_mm256_loadu_ps(lanes + 8 * r));
}

/* R activation rows from t against one Q4_K/Q5_K/Q6_K weight row: 0 when the type has none. R is
 * 8 or 4 (constants, so each kernel's row loops unroll and the sums stay in registers). */
AVX512 int dotR_kquant_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res) {
    switch (type) {
    case T_Q4_K: if (R == 8) dotR_q4_K_512(w, a, t, nb, 8, res); else dotR_q4_K_512(w, a, t, nb, 4, res); return 1;
    case T_Q5_K: if (R == 8) dotR_q5_K_512(w, a, t, nb, 8, res); else dotR_q5_K_512(w, a, t, nb, 4, res); return 1;
    case T_Q6_K: if (R == 8) dotR_q6_K_512(w, a, t, nb, 8, res); else dotR_q6_K_512(w, a, t, nb, 4, res); return 1;
    }
    return 0;
}
#endif
