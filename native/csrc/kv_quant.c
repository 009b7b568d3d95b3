/* A KV cache in 8 or 4 bits: rows stored as ggml stores them (Q8_0, Q4_0 blocks of 32 values
 * with an fp16 scale) and attention that reads those blocks directly.
 *
 * llama.cpp writes a quantized cache row with the type's own CPU quantizer (set_rows →
 * from_float: AVX2's quantize_row_q8_0, the reference quantize_row_q4_0) and, in its flash
 * attention, quantizes the query to the key type's vec_dot_type (Q8_0 for both) so that a score
 * is the integer dot product of two block rows; values are widened to float one row at a time.
 * So here: a score is dot_row(K type, key row, query as Q8_0) — the weights' own kernels —, a
 * value row is dequantized into a D-float buffer (never the cache) and summed in the lanes the
 * fp16 path uses. Any K type with any V type (f32, f16, q8_0, q4_0), as llama.cpp allows. */
#include "kiln.h"

/* llama.cpp rotates what a quantized cache holds: keys (and the queries) by an orthonormal
 * Walsh-Hadamard matrix of the largest power of two (from 64) dividing head_dim, values by one of
 * 64, the attention's output back by the same (H·H = I) — outliers spread over the block, so 4 bits
 * lose less (its PR 21038; LLAMA_ATTN_ROT_DISABLE turns it off there). Heads whose size is not a
 * multiple of 64 are not rotated. Returns the rotation's size, 0 for none. */
int kv_rot(int type, int D, int keys) {
    if ((type != T_Q8_0 && type != T_Q4_0) || D <= 0 || D % 64) return 0;
    if (!keys) return 64;
    int n = 64;
    while (2 * n <= D && D % (2 * n) == 0) n *= 2;
    return n;
}

/* x (D values) times the Walsh-Hadamard matrix of size n, block by block, in place, as ggml's
 * fwht: scaled by 1/sqrt(n) first, then the butterflies (u + v, u - v) from stride 1 up. */
void kv_fwht(float *x, int D, int n) {
    const float scale = 1.0f / sqrtf((float)n);
    for (int i = 0; i < D; i++) x[i] *= scale;
    for (int c = 0; c < D; c += n)
        for (int len = 1; len < n; len <<= 1)
            for (int i = c; i < c + n; i += 2 * len)
                for (int j = 0; j < len; j++) {
                    const float u = x[i + j], v = x[i + len + j];
                    x[i + j] = u + v;
                    x[i + len + j] = u - v;
                }
}

int kv_row_bytes(int type, int D) {
    switch (type) {
    case T_F32: return 4 * D;
    case T_F16: return 2 * D;
    case T_Q8_0: return D % 32 ? 0 : D / 32 * 34;
    case T_Q4_0: return D % 32 ? 0 : D / 32 * 18;
    }
    return 0;
}

static void q8_0_row(const float *x, uint8_t *y, int D) {
    for (int b = 0; b < D / 32; b++, x += 32, y += 34) {
        float amax = 0.f;
        int8_t *q = (int8_t *)(y + 2);
#ifdef KILN_X86
        if (g_avx2) quantize_q8_block_avx2(x, q, &amax);        /* ggml's AVX2 quantize_row_q8_0 */
        else
#endif
        {
            for (int i = 0; i < 32; i++) { float a = fabsf(x[i]); if (a > amax) amax = a; }
            float id = amax != 0.f ? 127.f / amax : 0.f;
            for (int i = 0; i < 32; i++) q[i] = (int8_t)nearbyintf(x[i] * id);
        }
        uint16_t d = fp32_to_fp16(amax / 127.f);
        memcpy(y, &d, 2);
    }
}

static void q4_0_row(const float *x, uint8_t *y, int D) {     /* ggml's quantize_row_q4_0_ref */
    for (int b = 0; b < D / 32; b++, x += 32, y += 18) {
        float amax = 0.f, max = 0.f;
        for (int i = 0; i < 32; i++)
            if (amax < fabsf(x[i])) { amax = fabsf(x[i]); max = x[i]; }
        const float d = max / -8, id = d ? 1.0f / d : 0.0f;
        uint16_t h = fp32_to_fp16(d);
        memcpy(y, &h, 2);
        for (int j = 0; j < 16; j++) {
            const float x0 = x[j] * id, x1 = x[16 + j] * id;
            const uint8_t xi0 = (uint8_t)((int8_t)(x0 + 8.5f) < 15 ? (int8_t)(x0 + 8.5f) : 15);
            const uint8_t xi1 = (uint8_t)((int8_t)(x1 + 8.5f) < 15 ? (int8_t)(x1 + 8.5f) : 15);
            y[2 + j] = xi0 | (uint8_t)(xi1 << 4);
        }
    }
}

/* a row of D values as the cache stores it (rot: the rotation applied first, 0 for none) */
void kv_store_row(int type, const float *x, uint8_t *y, int D, int rot) {
    float r[MAX_HEAD_DIM];
    if (rot) { memcpy(r, x, (size_t)D * 4); kv_fwht(r, D, rot); x = r; }
    switch (type) {
    case T_F32: memcpy(y, x, (size_t)D * 4); break;
    case T_F16: { uint16_t *h = (uint16_t *)y; for (int i = 0; i < D; i++) h[i] = fp32_to_fp16(x[i]); break; }
    case T_Q8_0: q8_0_row(x, y, D); break;
    case T_Q4_0: q4_0_row(x, y, D); break;
    }
}

/* a stored row's values (rot: its rotation, undone after widening) */
void kv_load_row(int type, const uint8_t *x, float *y, int D, int rot) {
    switch (type) {
    case T_F32: memcpy(y, x, (size_t)D * 4); break;
    case T_F16: for (int i = 0; i < D; i++) y[i] = fp16_to_fp32(rd16(x + 2 * i)); break;
    case T_Q8_0:
        for (int b = 0; b < D / 32; b++, x += 34) {
            const float d = fp16_to_fp32(rd16(x));
            for (int i = 0; i < 32; i++) y[b * 32 + i] = d * (float)((const int8_t *)(x + 2))[i];
        }
        break;
    case T_Q4_0:
        for (int b = 0; b < D / 32; b++, x += 18) {
            const float d = fp16_to_fp32(rd16(x));
            for (int j = 0; j < 16; j++) {
                y[b * 32 + j] = d * (float)((x[2 + j] & 0x0F) - 8);
                y[b * 32 + 16 + j] = d * (float)((x[2 + j] >> 4) - 8);
            }
        }
        break;
    }
    if (rot) kv_fwht(y, D, rot);
}

#ifdef KILN_X86
/* a Q8_0 or Q4_0 block's 32 codes as signed bytes (Q4_0: its nibbles minus 8, as ggml's dot) */
#define CODES_Q8_0(blk) _mm256_loadu_si256((const __m256i *)((blk) + 2))
#define CODES_Q4_0(blk) _mm256_sub_epi8(nibbles32((blk) + 2), _mm256_set1_epi8(8))
/* The scores of keys s0..s1-1 against a Q8_0 query (qq, qd): per key ggml's vec_dot_q8_0_q8_0 /
 * vec_dot_q4_0_q8_0 — per block fmadd(dk·dq, Σ codes·codes) in 8 lanes, then their sum — four
 * keys at a time (four independent chains, each reduced as a lone key's). */
#define KV_SCORES(NAME, BYTES, CODES)                                                               \
AVX2 static void NAME(const uint8_t *K0, size_t ks, const int8_t *qq, const float *qd, int nb,       \
                      int s0, int s1, float scale, float *row) {                                    \
    int s = s0;                                                                                     \
    for (; s + 4 <= s1; s += 4) {                                                                   \
        const uint8_t *k0 = K0 + s * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;               \
        for (int r = 0; r < 4 && s + PREFETCH_ROWS + 4 <= s1; r++) prefetch_row(k0 + (PREFETCH_ROWS + r) * ks, (size_t)nb * BYTES); \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                 \
        for (int b = 0; b < nb; b++) {                                                              \
            const __m256i y = _mm256_loadu_si256((const __m256i *)(qq + 32 * b));                   \
            const size_t o = (size_t)b * BYTES;                                                     \
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(H2F(k0 + o) * qd[b]), sum_i8_pairs(CODES(k0 + o), y), a0); \
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(H2F(k1 + o) * qd[b]), sum_i8_pairs(CODES(k1 + o), y), a1); \
            a2 = _mm256_fmadd_ps(_mm256_set1_ps(H2F(k2 + o) * qd[b]), sum_i8_pairs(CODES(k2 + o), y), a2); \
            a3 = _mm256_fmadd_ps(_mm256_set1_ps(H2F(k3 + o) * qd[b]), sum_i8_pairs(CODES(k3 + o), y), a3); \
        }                                                                                           \
        row[s] = hsum_avx(a0) * scale; row[s + 1] = hsum_avx(a1) * scale;                           \
        row[s + 2] = hsum_avx(a2) * scale; row[s + 3] = hsum_avx(a3) * scale;                       \
    }                                                                                               \
    for (; s < s1; s++) {                                                                           \
        const uint8_t *k = K0 + s * ks;                                                             \
        __m256 a = _mm256_setzero_ps();                                                             \
        for (int b = 0; b < nb; b++) {                                                              \
            const size_t o = (size_t)b * BYTES;                                                     \
            a = _mm256_fmadd_ps(_mm256_set1_ps(H2F(k + o) * qd[b]),                                 \
                                sum_i8_pairs(CODES(k + o), _mm256_loadu_si256((const __m256i *)(qq + 32 * b))), a); \
        }                                                                                           \
        row[s] = hsum_avx(a) * scale;                                                               \
    }                                                                                               \
}
KV_SCORES(scores_q8_0_avx2, 34, CODES_Q8_0)
KV_SCORES(scores_q4_0_avx2, 18, CODES_Q4_0)

AVX2 static inline __m256 widen8(__m128i c) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)); }
/* Lanes i0..i1-1 of the value sums (lane i: positions i, i+8, … in order) into acc (8 x D), a
 * value row widened block by block in registers — d·code, as ggml's dequantize_row — then
 * fmadd'ed with its probability, as attn_kv_vlanes's generic path does it in memory. */
#define KV_VLANES(NAME, BYTES, CODES)                                                               \
AVX2 static void NAME(const float *row, const uint8_t *V0, size_t vs, int D, int n, int i0, int i1, \
                      float *acc) {                                                                 \
    for (int b = 0; b < D / 32; b++)                                                                \
        for (int i = i0; i < i1; i++) {                                                             \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                             \
            for (int j = i; j < n; j += 8) {                                                        \
                const uint8_t *blk = V0 + j * vs + (size_t)b * BYTES;                               \
                const __m256i c = CODES(blk);                                                       \
                const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);  \
                const __m256 d = _mm256_set1_ps(H2F(blk)), p = _mm256_set1_ps(row[j]);              \
                a0 = _mm256_fmadd_ps(_mm256_mul_ps(widen8(lo), d), p, a0);                          \
                a1 = _mm256_fmadd_ps(_mm256_mul_ps(widen8(_mm_srli_si128(lo, 8)), d), p, a1);       \
                a2 = _mm256_fmadd_ps(_mm256_mul_ps(widen8(hi), d), p, a2);                          \
                a3 = _mm256_fmadd_ps(_mm256_mul_ps(widen8(_mm_srli_si128(hi, 8)), d), p, a3);       \
            }                                                                                       \
            float *o = acc + (size_t)i * D + 32 * b;                                                \
            _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, a1);                                   \
            _mm256_storeu_ps(o + 16, a2); _mm256_storeu_ps(o + 24, a3);                             \
        }                                                                                           \
}
KV_VLANES(vlanes_q8_0_avx2, 34, CODES_Q8_0)
KV_VLANES(vlanes_q4_0_avx2, 18, CODES_Q4_0)
AVX2 static int fma_row_avx2(float *a, const float *v, float p, int D) {    /* a += v * p, 8 at a time */
    __m256 pp = _mm256_set1_ps(p); int d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(a + d, _mm256_fmadd_ps(_mm256_loadu_ps(v + d), pp, _mm256_loadu_ps(a + d)));
    return d;
}
#endif

/* The scores of positions s0..s1-1 against query row t, head h, for a key cache of type kt whose
 * KV head (h's) starts at K, ks bytes between positions. */
void attn_kv_scores(const float *Q, const uint8_t *K, size_t ks, int kt, int t, int h, int H, int D,
                    int s0, int s1, float scale, float *row) {
    const float *q = Q + ((size_t)t * H + h) * D;
#ifdef KILN_X86
    if (g_avx2 && kt == T_F16) { attn_f16_scores(Q, (const uint16_t *)K, ks / 2, t, h, H, D, s0, s1, scale, row); return; }
    if (g_avx2 && kt == T_F32) { attn_f32_scores(Q, (const float *)K, ks / 4, t, h, H, D, s0, s1, scale, row); return; }
#endif
    if (kt == T_F32 || kt == T_F16) {            /* portable: the row widened, q rounded as the cache */
        float kr[MAX_HEAD_DIM], qr[MAX_HEAD_DIM];
        for (int i = 0; i < D; i++) qr[i] = kt == T_F16 ? round_fp16(q[i]) : q[i];
        for (int s = s0; s < s1; s++) {
            kv_load_row(kt, K + s * ks, kr, D, 0);
            float dot = 0.f;
            for (int i = 0; i < D; i++) dot += qr[i] * kr[i];
            row[s] = dot * scale;
        }
        return;
    }
    /* the query rotated as the keys were, then as Q8_0, as ggml's flash attention converts it
       to the key type's vec_dot_type */
    float qr[MAX_HEAD_DIM];
    const int rot = kv_rot(kt, D, 1);
    if (rot) { memcpy(qr, q, (size_t)D * 4); kv_fwht(qr, D, rot); q = qr; }
    int8_t qq[MAX_HEAD_DIM];
    float qd[MAX_HEAD_DIM / 32], qs[MAX_HEAD_DIM / 32], dT[MAX_HEAD_DIM / 32 + 8], sT[MAX_HEAD_DIM / 32 + 8];
    Act a = {A_Q8_0, q, NULL, qq, qd, qs, NULL, dT, sT, 1};
    act_row(&a, 0, D);
#ifdef KILN_X86
    if (g_avx2) {
        if (kt == T_Q8_0) scores_q8_0_avx2(K, ks, qq, qd, D / 32, s0, s1, scale, row);
        else scores_q4_0_avx2(K, ks, qq, qd, D / 32, s0, s1, scale, row);
        return;
    }
#endif
    TypeInfo ti; type_info(kt, &ti);
    for (int s = s0; s < s1; s++) row[s] = dot_row(kt, &ti, K + s * ks, &a, 0, D) * scale;
}

/* Lanes i0..i1-1 of the value sums into acc (8 x D): lane i sums p · v over positions i, i+8, …
 * in order (the fp16 path's lanes), each value row widened from its type. V: the KV head's position
 * 0, vs bytes between positions. */
void attn_kv_vlanes(const float *row, const uint8_t *V, size_t vs, int vt, int D, int n, int i0, int i1,
                    float *acc) {
#ifdef KILN_X86
    if (g_avx2 && vt == T_Q8_0) { vlanes_q8_0_avx2(row, V, vs, D, n, i0, i1, acc); return; }
    if (g_avx2 && vt == T_Q4_0) { vlanes_q4_0_avx2(row, V, vs, D, n, i0, i1, acc); return; }
    if (g_avx2 && vt == T_F16 && D % 64 == 0) { attn_f16_vlanes(row, (const uint16_t *)V, vs / 2, D, n, i0, i1, acc); return; }
    if (g_avx2 && vt == T_F32 && D % 64 == 0) { attn_f32_vlanes(row, (const float *)V, vs / 4, D, n, i0, i1, acc); return; }
#endif
    float vr[MAX_HEAD_DIM];
    for (int i = i0; i < i1; i++) {
        float *a = acc + (size_t)i * D;
        for (int d = 0; d < D; d++) a[d] = 0.f;
        for (int j = i; j < n; j += 8) {
            kv_load_row(vt, V + j * vs, vr, D, 0);
            int d = 0;
#ifdef KILN_X86
            if (g_avx2) d = fma_row_avx2(a, vr, row[j], D);
#endif
            for (; d < D; d++) a[d] = fmaf(vr[d], row[j], a[d]);
        }
    }
}

/* the lanes' sum into o, rotated back when the values were stored rotated (type vt) */
void attn_kv_reduce(const float *acc, float *o, int D, int vt) {
#ifdef KILN_X86
    if (g_avx2 && D % 8 == 0) attn_reduce_lanes(acc, o, D);
    else
#endif
    for (int d = 0; d < D; d++)
        o[d] = ((acc[d] + acc[4 * D + d]) + (acc[2 * D + d] + acc[6 * D + d])) +
               ((acc[D + d] + acc[5 * D + d]) + (acc[3 * D + d] + acc[7 * D + d]));
    const int rot = kv_rot(vt, D, 0);
    if (rot) kv_fwht(o, D, rot);
}

static void softmax_plain(float *row, int n, int win, const float *sink) {
    int lo = win > 0 && n > win ? n - win : 0;
    float mx = -INFINITY;
    for (int s = 0; s < n; s++) { if (s < lo) row[s] = -INFINITY; if (row[s] > mx) mx = row[s]; }
    if (sink && *sink > mx) mx = *sink;
    double sum = 0.0;
    for (int s = 0; s < n; s++) { row[s] = expf(row[s] - mx); sum += row[s]; }
    if (sink) sum += expf(*sink - mx);
    float inv = (float)(1.0 / sum);
    for (int s = 0; s < n; s++) row[s] *= inv;
}

#ifdef KILN_X86
/* The value sums of flash attention's pass, 64 dimensions at a time in eight registers: per key
 * the sums scaled by ms when the key raised the maximum (ggml's vec_scale_f32), then its row
 * widened, d·code (to_float), and added times vs (vec_mad_f32: fused). w[s]: the key's vs, or -ms
 * for a key that raised the maximum (sign bit set, -0.0 included; vs is then 1). Each dimension's
 * sum sees the same operations in the same order as ggml's loop over the whole row. */
#define FA_BLOCK(BLK, A0)                                                                           \
    {                                                                                               \
        const __m256i c = vt == T_Q8_0 ? CODES_Q8_0(BLK) : CODES_Q4_0(BLK);                         \
        const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);          \
        const __m256 d = _mm256_set1_ps(H2F(BLK));                                                  \
        a[A0] = _mm256_fmadd_ps(_mm256_mul_ps(widen8(lo), d), p, a[A0]);                            \
        a[A0 + 1] = _mm256_fmadd_ps(_mm256_mul_ps(widen8(_mm_srli_si128(lo, 8)), d), p, a[A0 + 1]); \
        a[A0 + 2] = _mm256_fmadd_ps(_mm256_mul_ps(widen8(hi), d), p, a[A0 + 2]);                    \
        a[A0 + 3] = _mm256_fmadd_ps(_mm256_mul_ps(widen8(_mm_srli_si128(hi, 8)), d), p, a[A0 + 3]); \
    }
AVX2 static void fa_values_avx2(const float *w, const uint8_t *V0, size_t vstride, int vt, int D, int lo, int n,
                                float *acc) {
    const int bytes = vt == T_Q8_0 ? 34 : 18;
    for (int g = 0; g < D; g += 64) {
        __m256 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
        const uint8_t *vg = V0 + (size_t)(g / 32) * bytes;
        for (int s = lo; s < n; s++) {
            const float ws = w[s];
            __m256 p;
            if (signbit(ws)) {
                const __m256 m = _mm256_set1_ps(-ws);
                for (int k = 0; k < 8; k++) a[k] = _mm256_mul_ps(a[k], m);
                p = _mm256_set1_ps(1.0f);
            } else p = _mm256_set1_ps(ws);
            const uint8_t *v = vg + s * vstride;
            FA_BLOCK(v, 0)
            FA_BLOCK(v + bytes, 4)
        }
        for (int k = 0; k < 8; k++) _mm256_storeu_ps(acc + g + 8 * k, a[k]);
    }
}
#endif

/* A quantized value cache takes llama.cpp's flash-attention arithmetic, the only one llama.cpp has
 * for it (ggml's flash_attn_ext one_chunk): keys in order, a running maximum M and sum S, the
 * accumulated values rescaled by expf(Mold - M) when the maximum grows, each value row widened
 * (to_float) and added times expf(s - M); the sink logit after the keys; then / S.
 * attn_kv_fa_pass is that pass over scores already computed (row: scaled, as llama.cpp's s; they
 * may be computed split between threads, attn_kv_scores): the running maximum is known from the
 * scores alone, so every expf is taken first in a loop of its own (the same arguments, the same
 * values) and the sequential part is the value sums. */
void attn_kv_fa_pass(float *row, const uint8_t *V0, size_t vstride, int vt, int D, int n, int win, const float *sink,
                     float *o) {
    float acc[MAX_HEAD_DIM], vr[MAX_HEAD_DIM];
    const int lo = win > 0 && n > win ? n - win : 0;
    /* row[s] becomes the key's weight vs; a key that raises the maximum has vs 1 and scales what
       came before by ms = expf(Mold - M), kept as -ms (sign bit set, -0.0 for the first key) */
    float M = -INFINITY, S = 0.f;
    for (int s = lo; s < n; s++) {
        const float sc = row[s];
        if (sc > M) { const float ms = expf(M - sc); row[s] = -ms; M = sc; S = S * ms + 1.0f; }
        else { const float vs = expf(sc - M); row[s] = vs; S = S + vs; }      /* S·1 + vs */
    }
#ifdef KILN_X86
    if (g_avx2 && D % 64 == 0) fa_values_avx2(row, V0, vstride, vt, D, lo, n, acc);
    else
#endif
    {
        for (int d = 0; d < D; d++) acc[d] = 0.f;
        for (int s = lo; s < n; s++) {
            const int raised = signbit(row[s]) != 0;
            const float ms = raised ? -row[s] : 1.0f, vs = raised ? 1.0f : row[s];
            kv_load_row(vt, V0 + s * vstride, vr, D, 0);
            for (int d = 0; d < D; d++) acc[d] = fmaf(vr[d], vs, raised ? acc[d] * ms : acc[d]);
        }
    }
    if (sink) {
        const float sk = *sink;
        float ms = 1.0f, vs = 1.0f;
        if (sk > M) { ms = expf(M - sk); M = sk; for (int d = 0; d < D; d++) acc[d] *= ms; }
        else vs = expf(sk - M);
        S = S * ms + vs;
    }
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
    const int rot = kv_rot(vt, D, 0);
    if (rot) kv_fwht(o, D, rot);
}

void attn_kv_softmax(float *row, int n, int win, const float *sink, int vt) {
#ifdef KILN_X86
    /* an fp16 value cache gets probabilities rounded to fp16, as the all-fp16 path does */
    if (g_avx2) { if (vt == T_F16) attn_f16_softmax(row, n, win, sink); else attn_f32_softmax(row, n, win, sink); return; }
#endif
    softmax_plain(row, n, win, sink);
    if (vt == T_F16) for (int s = 0; s < n; s++) row[s] = round_fp16(row[s]);
}

/* One (query row t, head h) over positions 0..n-1 of caches of types kt and vt (K, V: the KV head's
 * position 0; ks, vs: bytes between positions). row: n + 8 floats. */
void attn_task_kv(const float *Q, const uint8_t *K, size_t ks, const uint8_t *V, size_t vs, int kt, int vt,
                  float *O, int t, int h, int H, int D, int n, float scale, float *row, int win, const float *sinks) {
    if (vt == T_Q8_0 || vt == T_Q4_0) {
        attn_kv_scores(Q, K, ks, kt, t, h, H, D, 0, n, scale, row);
        attn_kv_fa_pass(row, V, vs, vt, D, n, win, sinks ? sinks + h : NULL, O + ((size_t)t * H + h) * D);
        return;
    }
    float acc[8 * MAX_HEAD_DIM] __attribute__((aligned(32)));
    attn_kv_scores(Q, K, ks, kt, t, h, H, D, 0, n, scale, row);
    attn_kv_softmax(row, n, win, sinks ? sinks + h : NULL, vt);
    attn_kv_vlanes(row, V, vs, vt, D, n, 0, 8, acc);
    attn_kv_reduce(acc, O + ((size_t)t * H + h) * D, D, vt);
}
