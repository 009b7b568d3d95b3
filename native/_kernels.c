/* Kiln's compiled kernels: quantized matrix products and attention, batch-invariant.
 *
 * matmul(x, W): W stays in its GGUF blocks. Each activation row is quantized as ggml quantizes
 * it for that weight type (vec_dot_type: Q8_0, Q8_1, Q8_K, fp16, bf16, or none for F32), then
 * every output element is one thread's dot product over the row's blocks in a fixed order.
 * So a row's result never depends on how many rows were multiplied with it or on the thread
 * count — prefix reuse and batched decode give the same bits as a fresh, single run.
 *
 * AVX2/FMA paths (chosen at run time) for Q4_0, Q4_1, Q8_0 — the types of the default model —
 * and portable C for every type, so a build is not tied to the machine that made it.
 * The GIL is released while computing; OpenMP threads split the output rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KILN_X86 1
#endif

/* ggml type ids */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
/* activation forms */
enum { A_F32, A_F16, A_BF16, A_Q8_0, A_Q8_1, A_Q8_K };

/* ---- fp16 / bf16 ---------------------------------------------------------------------------- */

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {                                      /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            mant &= 0x3ff;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f; memcpy(&f, &bits, 4); return f;
}

static inline uint16_t fp32_to_fp16(float f) {     /* round to nearest even, as numpy */
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000; int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = mant >> 13, rem = mant & 0x1fff;
    uint32_t h = sign | ((uint32_t)exp << 10) | r;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) h++;
    return (uint16_t)h;
}
static inline float round_fp16(float f) { return fp16_to_fp32(fp32_to_fp16(f)); }

static inline float bf16_to_fp32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static inline float round_bf16(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    b = (b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &b, 4); return f;
}

/* ---- type table ----------------------------------------------------------------------------- */

typedef struct { int block; int bytes; int act; } TypeInfo;

static int type_info(int t, TypeInfo *ti) {
    switch (t) {
    case T_F32:  *ti = (TypeInfo){1, 4, A_F32}; return 1;
    case T_F16:  *ti = (TypeInfo){1, 2, A_F16}; return 1;
    case T_BF16: *ti = (TypeInfo){1, 2, A_BF16}; return 1;
    case T_Q4_0: *ti = (TypeInfo){32, 18, A_Q8_0}; return 1;
    case T_Q4_1: *ti = (TypeInfo){32, 20, A_Q8_1}; return 1;
    case T_Q5_0: *ti = (TypeInfo){32, 22, A_Q8_0}; return 1;
    case T_Q5_1: *ti = (TypeInfo){32, 24, A_Q8_1}; return 1;
    case T_Q8_0: *ti = (TypeInfo){32, 34, A_Q8_0}; return 1;
    case T_Q2_K: *ti = (TypeInfo){256, 84, A_Q8_K}; return 1;
    case T_Q3_K: *ti = (TypeInfo){256, 110, A_Q8_K}; return 1;
    case T_Q4_K: *ti = (TypeInfo){256, 144, A_Q8_K}; return 1;
    case T_Q5_K: *ti = (TypeInfo){256, 176, A_Q8_K}; return 1;
    case T_Q6_K: *ti = (TypeInfo){256, 210, A_Q8_K}; return 1;
    }
    return 0;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---- activations ---------------------------------------------------------------------------- */

typedef struct {
    int kind;
    const float *xf;      /* A_F32: the input; A_F16/A_BF16: rounded copy */
    float *xr;
    int8_t *q;            /* quantized values */
    float *d;             /* per block scale (fp16-rounded for Q8_0/Q8_1) */
    float *s;             /* Q8_1: fp16(d * sum q) */
} Act;

static void quantize_row(const float *x, int K, int kind, float *xr, int8_t *q, float *d, float *s) {
    if (kind == A_F16) { for (int i = 0; i < K; i++) xr[i] = round_fp16(x[i]); return; }
    if (kind == A_BF16) { for (int i = 0; i < K; i++) xr[i] = round_bf16(x[i]); return; }
    int B = kind == A_Q8_K ? 256 : 32;
    for (int b = 0; b < K / B; b++) {
        const float *xb = x + b * B;
        float amax = 0.f;
        for (int i = 0; i < B; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; }
        float dd = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < B; i++) {
            float v = nearbyintf(xb[i] * id);          /* half to even, as _mm256_round_ps */
            if (v > 127.f) v = 127.f;
            if (v < -127.f) v = -127.f;
            q[b * B + i] = (int8_t)v;
            sum += (int)v;
        }
        if (kind == A_Q8_K) { d[b] = dd; }
        else {
            d[b] = round_fp16(dd);
            if (s) s[b] = round_fp16(dd * (float)sum);
        }
    }
}

/* ---- portable dot products ------------------------------------------------------------------ */

static float dot_q4_0(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; b++, w += 18) {
        const uint8_t *qs = w + 2; const int8_t *y = q + b * 32; int sum = 0;
        for (int j = 0; j < 16; j++) sum += ((qs[j] & 0xf) - 8) * y[j] + ((qs[j] >> 4) - 8) * y[j + 16];
        acc += fp16_to_fp32(rd16(w)) * d[b] * (float)sum;
    }
    return acc;
}

static float dot_q4_1(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb, *s = a->s + (size_t)t * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; b++, w += 20) {
        const uint8_t *qs = w + 4; const int8_t *y = q + b * 32; int sum = 0;
        for (int j = 0; j < 16; j++) sum += (qs[j] & 0xf) * y[j] + (qs[j] >> 4) * y[j + 16];
        acc += fp16_to_fp32(rd16(w)) * d[b] * (float)sum + fp16_to_fp32(rd16(w + 2)) * s[b];
    }
    return acc;
}

static float dot_q5_0(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; b++, w += 22) {
        uint32_t qh; memcpy(&qh, w + 2, 4); const uint8_t *qs = w + 6; const int8_t *y = q + b * 32; int sum = 0;
        for (int j = 0; j < 16; j++) {
            int v0 = ((qs[j] & 0xf) | (((qh >> j) & 1) << 4)) - 16;
            int v1 = ((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            sum += v0 * y[j] + v1 * y[j + 16];
        }
        acc += fp16_to_fp32(rd16(w)) * d[b] * (float)sum;
    }
    return acc;
}

static float dot_q5_1(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb, *s = a->s + (size_t)t * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; b++, w += 24) {
        uint32_t qh; memcpy(&qh, w + 4, 4); const uint8_t *qs = w + 8; const int8_t *y = q + b * 32; int sum = 0;
        for (int j = 0; j < 16; j++) {
            int v0 = (qs[j] & 0xf) | (((qh >> j) & 1) << 4);
            int v1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            sum += v0 * y[j] + v1 * y[j + 16];
        }
        acc += fp16_to_fp32(rd16(w)) * d[b] * (float)sum + fp16_to_fp32(rd16(w + 2)) * s[b];
    }
    return acc;
}

static float dot_q8_0(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; b++, w += 34) {
        const int8_t *qs = (const int8_t *)(w + 2); const int8_t *y = q + b * 32; int sum = 0;
        for (int j = 0; j < 32; j++) sum += qs[j] * y[j];
        acc += fp16_to_fp32(rd16(w)) * d[b] * (float)sum;
    }
    return acc;
}

/* K-quants: dequantize the 256-weight block (mirroring gguf-py's reference), then a float dot
 * with the Q8_K activation block. */
static void get_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static void deq_kblock(int type, const uint8_t *w, float *y) {
    switch (type) {
    case T_Q4_K: case T_Q5_K: {
        float d = fp16_to_fp32(rd16(w)), dmin = fp16_to_fp32(rd16(w + 2));
        const uint8_t *scales = w + 4, *qh = type == T_Q5_K ? w + 16 : NULL, *qs = type == T_Q5_K ? w + 48 : w + 16;
        for (int e = 0; e < 256; e++) {
            int j = e / 64, s = (e / 32) % 2, l = e % 32;
            uint8_t sc, m; get_scale_min_k4(e / 32, scales, &sc, &m);
            int v = (qs[j * 32 + l] >> (4 * s)) & 0xf;
            if (qh) v |= ((qh[l] >> (e / 32)) & 1) << 4;
            y[e] = d * sc * v - dmin * m;
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = w, *qh = w + 128; const int8_t *sc = (const int8_t *)(w + 192);
        float d = fp16_to_fp32(rd16(w + 208));
        for (int e = 0; e < 256; e++) {
            int h = e / 128, r = e % 128;
            int lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0xf;
            int hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
            y[e] = d * sc[e / 16] * (float)((lo | (hi << 4)) - 32);
        }
        break;
    }
    case T_Q2_K: {
        const uint8_t *scales = w, *qs = w + 16;
        float d = fp16_to_fp32(rd16(w + 80)), dmin = fp16_to_fp32(rd16(w + 82));
        for (int e = 0; e < 256; e++) {
            int h = e / 128, s = (e / 32) % 4, l = e % 32;
            int v = (qs[h * 32 + l] >> (2 * s)) & 3;
            uint8_t sc = scales[e / 16];
            y[e] = d * (sc & 0xf) * v - dmin * (sc >> 4);
        }
        break;
    }
    case T_Q3_K: {
        const uint8_t *hmask = w, *qs = w + 32, *sc = w + 96;
        float d = fp16_to_fp32(rd16(w + 108));
        for (int e = 0; e < 256; e++) {
            int sb = e / 16;
            int lo4 = (sc[sb % 8] >> (4 * (sb / 8))) & 0xf;
            int hi2 = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
            int scale = (lo4 | (hi2 << 4)) - 32;
            int h = e / 128, s = (e / 32) % 4, l = e % 32;
            int v = (qs[h * 32 + l] >> (2 * s)) & 3;
            int hb = (hmask[l] >> (e / 32)) & 1;
            y[e] = d * scale * (float)(v - (hb ? 0 : 4));
        }
        break;
    }
    }
}

static float dot_kquant(int type, int bytes, const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 256; const float *d = a->d + (size_t)t * nb;
    float acc = 0.f, y[256];
    for (int b = 0; b < nb; b++, w += bytes) {
        deq_kblock(type, w, y);
        const int8_t *x = q + b * 256; float sum = 0.f;
        for (int i = 0; i < 256; i++) sum += y[i] * (float)x[i];
        acc += d[b] * sum;
    }
    return acc;
}

static float dot_float(int type, const uint8_t *w, const Act *a, int t, int K) {
    const float *x = (type == T_F32 ? a->xf : a->xr) + (size_t)t * K;
    float acc = 0.f;
    if (type == T_F32) { const float *wf = (const float *)w; for (int i = 0; i < K; i++) acc += wf[i] * x[i]; }
    else if (type == T_F16) { for (int i = 0; i < K; i++) acc += fp16_to_fp32(rd16(w + 2 * i)) * x[i]; }
    else { for (int i = 0; i < K; i++) acc += bf16_to_fp32(rd16(w + 2 * i)) * x[i]; }
    return acc;
}

/* ---- AVX2 dot products (ggml's maddubs scheme) ---------------------------------------------- */
#ifdef KILN_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define H2F(p) _cvtsh_ss(rd16(p))

AVX2 static inline float hsum_avx(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
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
AVX2 static float dot_q4_0_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 18) {
        __m256i x = _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8));
        __m256i y = _mm256_loadu_si256((const __m256i *)(q + b * 32));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w) * d[b]), sum_i8_pairs(x, y), acc);
    }
    return hsum_avx(acc);
}
AVX2 static float dot_q4_1_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb, *s = a->s + (size_t)t * nb;
    __m256 acc = _mm256_setzero_ps(); float accm = 0.f;
    for (int b = 0; b < nb; b++, w += 20) {
        __m256i y = _mm256_loadu_si256((const __m256i *)(q + b * 32));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w) * d[b]), sum_u8_i8(nibbles32(w + 4), y), acc);
        accm += H2F(w + 2) * s[b];
    }
    return hsum_avx(acc) + accm;
}
AVX2 static float dot_q8_0_avx2(const uint8_t *w, const Act *a, int t, int nb) {
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 34) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(w + 2));
        __m256i y = _mm256_loadu_si256((const __m256i *)(q + b * 32));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(H2F(w) * d[b]), sum_i8_pairs(x, y), acc);
    }
    return hsum_avx(acc);
}
AVX2 static float dot_f32_avx2(const float *w, const float *x, int K) {
    __m256 acc = _mm256_setzero_ps(); int i = 0;
    for (; i + 8 <= K; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
    float r = hsum_avx(acc);
    for (; i < K; i++) r += w[i] * x[i];
    return r;
}

/* Four activation rows against one weight row: the weight block is unpacked once. Each row's
 * operations are exactly those of the one-row kernel, so the results are bit-identical. */
#define DOT4_BEGIN(BYTES)                                                                     \
    const int8_t *q0 = a->q + (size_t)t * nb * 32, *q1 = q0 + nb * 32, *q2 = q1 + nb * 32, *q3 = q2 + nb * 32; \
    const float *d0 = a->d + (size_t)t * nb, *d1 = d0 + nb, *d2 = d1 + nb, *d3 = d2 + nb;      \
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
#define DOT4_ROW(C, Q, D, SUM) C = _mm256_fmadd_ps(_mm256_set1_ps(dw * D[b]), SUM(x, _mm256_loadu_si256((const __m256i *)(Q + b * 32))), C)

AVX2 static void dot4_q4_0_avx2(const uint8_t *w, const Act *a, int t, int nb, float *r) {
    DOT4_BEGIN(18)
    for (int b = 0; b < nb; b++, w += 18) {
        __m256i x = _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8)); float dw = H2F(w);
        DOT4_ROW(c0, q0, d0, sum_i8_pairs); DOT4_ROW(c1, q1, d1, sum_i8_pairs);
        DOT4_ROW(c2, q2, d2, sum_i8_pairs); DOT4_ROW(c3, q3, d3, sum_i8_pairs);
    }
    r[0] = hsum_avx(c0); r[1] = hsum_avx(c1); r[2] = hsum_avx(c2); r[3] = hsum_avx(c3);
}
AVX2 static void dot4_q8_0_avx2(const uint8_t *w, const Act *a, int t, int nb, float *r) {
    DOT4_BEGIN(34)
    for (int b = 0; b < nb; b++, w += 34) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(w + 2)); float dw = H2F(w);
        DOT4_ROW(c0, q0, d0, sum_i8_pairs); DOT4_ROW(c1, q1, d1, sum_i8_pairs);
        DOT4_ROW(c2, q2, d2, sum_i8_pairs); DOT4_ROW(c3, q3, d3, sum_i8_pairs);
    }
    r[0] = hsum_avx(c0); r[1] = hsum_avx(c1); r[2] = hsum_avx(c2); r[3] = hsum_avx(c3);
}
AVX2 static void dot4_q4_1_avx2(const uint8_t *w, const Act *a, int t, int nb, float *r) {
    DOT4_BEGIN(20)
    const float *s0 = a->s + (size_t)t * nb, *s1 = s0 + nb, *s2 = s1 + nb, *s3 = s2 + nb;
    float m0 = 0.f, m1 = 0.f, m2 = 0.f, m3 = 0.f;
    for (int b = 0; b < nb; b++, w += 20) {
        __m256i x = nibbles32(w + 4); float dw = H2F(w), mw = H2F(w + 2);
        DOT4_ROW(c0, q0, d0, sum_u8_i8); DOT4_ROW(c1, q1, d1, sum_u8_i8);
        DOT4_ROW(c2, q2, d2, sum_u8_i8); DOT4_ROW(c3, q3, d3, sum_u8_i8);
        m0 += mw * s0[b]; m1 += mw * s1[b]; m2 += mw * s2[b]; m3 += mw * s3[b];
    }
    r[0] = hsum_avx(c0) + m0; r[1] = hsum_avx(c1) + m1; r[2] = hsum_avx(c2) + m2; r[3] = hsum_avx(c3) + m3;
}

/* attention helpers */
AVX2 static float vdot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps(); int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float r = hsum_avx(acc);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}
AVX2 static void vaxpy_avx2(float *o, float p, const float *v, int n) {
    __m256 pp = _mm256_set1_ps(p); int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (; i < n; i++) o[i] += p * v[i];
}

/* exp(x) for 8 floats (Cephes-style range reduction + degree-5 polynomial, ~1 ulp), x <= 0 */
AVX2 static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* One (query row, head) task; sc holds n scores. Scores take four keys at a time (four
 * independent FMA chains, each reduced as a lone key's would be), so a decode step is not bound
 * by the latency of one long chain; the output row of D == 64 lives in eight registers. The arithmetic of a task
 * depends only on its row and position, never on how many rows run: batch-invariant.
 * One body for both KV element types: ATTN_TASK(name, element type, load 8 as floats, load 1). */
#define LD8_F32(p) _mm256_loadu_ps(p)
#define LD1_F32(x) (x)
#define LD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LD1_F16(x) _cvtsh_ss(x)
#define ATTN_TASK(NAME, T, LD8, LD1)                                                              \
AVX2 static void NAME(const float *Q, const T *Kc, const T *V, float *O, int t, int h,           \
                      int H, int Hkv, int D, int n, float scale, float *row) {                    \
    int kh = h / (H / Hkv);                                                                       \
    size_t ks = (size_t)Hkv * D;                   /* stride between positions */               \
    const float *q = Q + ((size_t)t * H + h) * D;                                                 \
    const T *K0 = Kc + (size_t)kh * D;                                                            \
    float mx = -INFINITY; int s = 0;                                                              \
    if (D % 8 == 0) {                                                                             \
        for (; s + 4 <= n; s += 4) {                                                              \
            const T *k0 = K0 + s * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;               \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                           \
            for (int i = 0; i < D; i += 8) {                                                      \
                __m256 qq = _mm256_loadu_ps(q + i);                                               \
                a0 = _mm256_fmadd_ps(qq, LD8(k0 + i), a0); a1 = _mm256_fmadd_ps(qq, LD8(k1 + i), a1); \
                a2 = _mm256_fmadd_ps(qq, LD8(k2 + i), a2); a3 = _mm256_fmadd_ps(qq, LD8(k3 + i), a3); \
            }                                                                                     \
            /* each key's sum is reduced exactly as a lone key's (hsum_avx): same bits */         \
            row[s] = hsum_avx(a0) * scale; row[s + 1] = hsum_avx(a1) * scale;                     \
            row[s + 2] = hsum_avx(a2) * scale; row[s + 3] = hsum_avx(a3) * scale;                 \
            for (int j = 0; j < 4; j++) if (row[s + j] > mx) mx = row[s + j];                     \
        }                                                                                         \
    }                                                                                             \
    for (; s < n; s++) {                                                                          \
        const T *k = K0 + s * ks;                                                                 \
        __m256 acc = _mm256_setzero_ps(); int i = 0;                                              \
        for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), LD8(k + i), acc); \
        float dot = hsum_avx(acc);                                                                \
        for (; i < D; i++) dot += q[i] * LD1(k[i]);                                               \
        row[s] = dot * scale;                                                                     \
        if (row[s] > mx) mx = row[s];                                                             \
    }                                                                                             \
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps(); s = 0;                           \
    for (; s + 8 <= n; s += 8) {                                                                  \
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + s), vmx));                          \
        _mm256_storeu_ps(row + s, e);                                                             \
        vsum = _mm256_add_ps(vsum, e);                                                            \
    }                                                                                             \
    float sum = hsum_avx(vsum);                                                                   \
    for (; s < n; s++) { row[s] = expf(row[s] - mx); sum += row[s]; }                            \
    float inv = 1.0f / sum, *o = O + ((size_t)t * H + h) * D;                                    \
    const T *V0 = V + (size_t)kh * D;                                                             \
    if (D == 64) {                                 /* the output row lives in 8 registers */     \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
        for (int j = 0; j < n; j++) {                                                             \
            const T *v = V0 + j * ks; __m256 p = _mm256_set1_ps(row[j] * inv);                    \
            a0 = _mm256_fmadd_ps(p, LD8(v), a0);      a1 = _mm256_fmadd_ps(p, LD8(v + 8), a1);      \
            a2 = _mm256_fmadd_ps(p, LD8(v + 16), a2); a3 = _mm256_fmadd_ps(p, LD8(v + 24), a3);     \
            a4 = _mm256_fmadd_ps(p, LD8(v + 32), a4); a5 = _mm256_fmadd_ps(p, LD8(v + 40), a5);     \
            a6 = _mm256_fmadd_ps(p, LD8(v + 48), a6); a7 = _mm256_fmadd_ps(p, LD8(v + 56), a7);     \
        }                                                                                         \
        _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, a1); _mm256_storeu_ps(o + 16, a2);      \
        _mm256_storeu_ps(o + 24, a3); _mm256_storeu_ps(o + 32, a4); _mm256_storeu_ps(o + 40, a5); \
        _mm256_storeu_ps(o + 48, a6); _mm256_storeu_ps(o + 56, a7);                               \
    } else {                                                                                      \
        for (int i = 0; i < D; i++) o[i] = 0.f;                                                   \
        for (int j = 0; j < n; j++) {                                                             \
            const T *v = V0 + j * ks; float p = row[j] * inv; int i = 0;                          \
            for (; i + 8 <= D; i += 8)                                                            \
                _mm256_storeu_ps(o + i, _mm256_fmadd_ps(_mm256_set1_ps(p), LD8(v + i), _mm256_loadu_ps(o + i))); \
            for (; i < D; i++) o[i] += p * LD1(v[i]);                                             \
        }                                                                                         \
    }                                                                                             \
}
ATTN_TASK(attn_task_avx2, float, LD8_F32, LD1_F32)
ATTN_TASK(attn_task_avx2_h, uint16_t, LD8_F16, LD1_F16)
#endif

static int g_avx2 = 0;

static inline float dot_row(int type, const TypeInfo *ti, const uint8_t *w, const Act *a, int t, int K) {
    int nb = K / ti->block;
#ifdef KILN_X86
    if (g_avx2) {
        switch (type) {
        case T_Q4_0: return dot_q4_0_avx2(w, a, t, nb);
        case T_Q4_1: return dot_q4_1_avx2(w, a, t, nb);
        case T_Q8_0: return dot_q8_0_avx2(w, a, t, nb);
        case T_F32: return dot_f32_avx2((const float *)w, a->xf + (size_t)t * K, K);
        }
    }
#endif
    switch (type) {
    case T_Q4_0: return dot_q4_0(w, a, t, nb);
    case T_Q4_1: return dot_q4_1(w, a, t, nb);
    case T_Q5_0: return dot_q5_0(w, a, t, nb);
    case T_Q5_1: return dot_q5_1(w, a, t, nb);
    case T_Q8_0: return dot_q8_0(w, a, t, nb);
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K:
        return dot_kquant(type, ti->bytes, w, a, t, nb);
    default: return dot_float(type, w, a, t, K);
    }
}

/* ---- Python entry points -------------------------------------------------------------------- */

static int default_threads = 0;

static int pick_threads(int requested) {      /* 0: the default; the default 0: all OpenMP threads */
    int n = requested > 0 ? requested : default_threads;
#ifdef _OPENMP
    if (n <= 0) n = omp_get_max_threads();
#endif
    return n > 0 ? n : 1;
}

/* Activations of T rows of x (T, K) as weight type ti multiplies them: allocated, then quantized
 * row by row (each row on its own, so who quantizes it changes nothing). */
static void act_alloc(Act *a, const TypeInfo *ti, const float *x, int T, int K) {
    int B = ti->act == A_Q8_K ? 256 : 32;
    *a = (Act){ti->act, x, NULL, NULL, NULL, NULL};
    if (ti->act == A_F16 || ti->act == A_BF16) a->xr = malloc((size_t)T * K * sizeof(float));
    if (ti->act >= A_Q8_0) {
        a->q = malloc((size_t)T * K); a->d = malloc((size_t)T * (K / B) * sizeof(float));
        a->s = malloc((size_t)T * (K / B) * sizeof(float));
    }
}
static void act_row(Act *a, int t, int K) {
    if (a->kind == A_F32) return;
    int B = a->kind == A_Q8_K ? 256 : 32;
    quantize_row(a->xf + (size_t)t * K, K, a->kind, a->xr ? a->xr + (size_t)t * K : NULL,
                 a->q ? a->q + (size_t)t * K : NULL, a->d ? a->d + (size_t)t * (K / B) : NULL,
                 a->s ? a->s + (size_t)t * (K / B) : NULL);
}
static void act_free(Act *a) { free(a->xr); free(a->q); free(a->d); free(a->s); }

/* Every output row of nw weights (one type, one Act) as one worksharing loop: call it inside a
 * parallel region (it is an orphaned `omp for`), or alone. */
static void rows_dot(const Act *a, int T, int K, int type, const TypeInfo *ti, int nw,
                     const uint8_t **W, const int *N, float **out) {
    size_t row_bytes = (size_t)(K / ti->block) * ti->bytes;
    int total = 0;
    for (int i = 0; i < nw; i++) total += N[i];
    #pragma omp for schedule(static)
    for (int r = 0; r < total; r++) {
        int i = 0, n = r;
        while (n >= N[i]) n -= N[i++];
        const uint8_t *w = W[i] + (size_t)n * row_bytes;
        float *o = out[i];
        int Ni = N[i], t = 0;
#ifdef KILN_X86
        if (g_avx2 && (type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0)) {
            int nb = K / ti->block; float res[4];
            for (; t + 4 <= T; t += 4) {
                if (type == T_Q4_0) dot4_q4_0_avx2(w, a, t, nb, res);
                else if (type == T_Q4_1) dot4_q4_1_avx2(w, a, t, nb, res);
                else dot4_q8_0_avx2(w, a, t, nb, res);
                for (int j = 0; j < 4; j++) o[(size_t)(t + j) * Ni + n] = res[j];
            }
        }
#endif
        for (; t < T; t++) o[(size_t)t * Ni + n] = dot_row(type, ti, w, a, t, K);
    }
}

/* y_i = x W_i^T for nw weights of one type that share the input x (T, K): the activations are
 * quantized once and every output row of every weight is one task of one parallel loop. A row's
 * arithmetic is the same whichever call computes it, so fusing changes no bit. */
static void matmul_core(const float *x, int T, int K, int type, const TypeInfo *ti, int nw,
                        const uint8_t **W, const int *N, float **out, int nt) {
    Act a;
    act_alloc(&a, ti, x, T, K);
    #pragma omp parallel for num_threads(nt) schedule(static) if(T > 1)
    for (int t = 0; t < T; t++) act_row(&a, t, K);
    #pragma omp parallel num_threads(nt)
    rows_dot(&a, T, K, type, ti, nw, W, N, out);
    act_free(&a);
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    Py_buffer xb, wb, ob;
    int type, T, K, N, threads;
    if (!PyArg_ParseTuple(args, "y*y*iiiiw*i", &xb, &wb, &type, &T, &K, &N, &ob, &threads)) return NULL;
    TypeInfo ti;
    PyObject *ret = NULL;
    if (!type_info(type, &ti)) { PyErr_Format(PyExc_ValueError, "ggml type %d has no compiled kernel", type); goto done; }
    if (K % ti.block) { PyErr_Format(PyExc_ValueError, "row length %d is not a multiple of block %d", K, ti.block); goto done; }
    size_t row_bytes = (size_t)(K / ti.block) * ti.bytes;
    if ((size_t)xb.len < (size_t)T * K * 4 || (size_t)wb.len < row_bytes * N || (size_t)ob.len < (size_t)T * N * 4) {
        PyErr_SetString(PyExc_ValueError, "matmul: a buffer is smaller than its shape"); goto done;
    }
    const uint8_t *W = (const uint8_t *)wb.buf;
    float *out = (float *)ob.buf;
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    matmul_core((const float *)xb.buf, T, K, type, &ti, 1, &W, &N, &out, nt);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&ob);
    return ret;
}

/* matmul_many(x, type, T, K, [(w, N, out), ...], threads): several weights of one type, one x. */
static PyObject *py_matmul_many(PyObject *self, PyObject *args) {
    Py_buffer xb;
    int type, T, K, threads;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "y*iiiO!i", &xb, &type, &T, &K, &PyList_Type, &list, &threads)) return NULL;
    PyObject *ret = NULL;
    int nw = (int)PyList_GET_SIZE(list), got = 0;
    Py_buffer wb[8], ob[8];
    const uint8_t *W[8]; float *O[8]; int N[8];
    TypeInfo ti;
    if (nw < 1 || nw > 8) { PyErr_SetString(PyExc_ValueError, "matmul_many: 1 to 8 weights"); goto done; }
    if (!type_info(type, &ti)) { PyErr_Format(PyExc_ValueError, "ggml type %d has no compiled kernel", type); goto done; }
    if (K % ti.block) { PyErr_Format(PyExc_ValueError, "row length %d is not a multiple of block %d", K, ti.block); goto done; }
    if ((size_t)xb.len < (size_t)T * K * 4) { PyErr_SetString(PyExc_ValueError, "matmul_many: x is smaller than its shape"); goto done; }
    size_t row_bytes = (size_t)(K / ti.block) * ti.bytes;
    for (; got < nw; got++) {
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, got), "y*iw*", &wb[got], &N[got], &ob[got])) goto done;
        if ((size_t)wb[got].len < row_bytes * N[got] || (size_t)ob[got].len < (size_t)T * N[got] * 4) {
            PyBuffer_Release(&wb[got]); PyBuffer_Release(&ob[got]);
            PyErr_SetString(PyExc_ValueError, "matmul_many: a buffer is smaller than its shape"); goto done;
        }
        W[got] = (const uint8_t *)wb[got].buf; O[got] = (float *)ob[got].buf;
    }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    matmul_core((const float *)xb.buf, T, K, type, &ti, nw, W, N, O, nt);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    for (int i = 0; i < got; i++) { PyBuffer_Release(&wb[i]); PyBuffer_Release(&ob[i]); }
    PyBuffer_Release(&xb);
    return ret;
}

static inline float vdot(const float *a, const float *b, int n) {
#ifdef KILN_X86
    if (g_avx2) return vdot_avx2(a, b, n);
#endif
    float r = 0.f;
    for (int i = 0; i < n; i++) r += a[i] * b[i];
    return r;
}
static inline void vaxpy(float *o, float p, const float *v, int n) {
#ifdef KILN_X86
    if (g_avx2) { vaxpy_avx2(o, p, v, n); return; }
#endif
    for (int i = 0; i < n; i++) o[i] += p * v[i];
}

/* attention(q (T,H,d), k (S,Hkv,d), v (S,Hkv,d), out (T,H*d), T, H, Hkv, d, S, start, threads):
 * causal; query t sits at position start+t; head h reads KV head h / (H/Hkv). One (t, h) per
 * task, keys in order: batch-invariant. */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    Py_buffer qb, kb, vb, ob;
    int T, H, Hkv, D, S, start, threads, f16 = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*w*iiiiiii|p", &qb, &kb, &vb, &ob, &T, &H, &Hkv, &D, &S, &start, &threads, &f16))
        return NULL;
    PyObject *ret = NULL;
    size_t es = f16 ? 2 : 4;
    if ((size_t)qb.len < (size_t)T * H * D * 4 || (size_t)kb.len < (size_t)S * Hkv * D * es ||
        (size_t)vb.len < (size_t)S * Hkv * D * es || (size_t)ob.len < (size_t)T * H * D * 4 || start + T > S) {
        PyErr_SetString(PyExc_ValueError, "attention: a buffer is smaller than its shape"); goto done;
    }
    if (f16 && D > 512) { PyErr_SetString(PyExc_ValueError, "attention: fp16 KV needs head_dim <= 512"); goto done; }
    const float *Q = qb.buf, *Kc = kb.buf, *V = vb.buf;
    float *O = ob.buf;
    int G = H / Hkv, nt = pick_threads(threads);
    float scale = 1.0f / sqrtf((float)D);
    Py_BEGIN_ALLOW_THREADS
#ifdef KILN_X86
    if (g_avx2) {
        #pragma omp parallel num_threads(nt) if(T * H > 1)
        {
            float *sc = malloc((size_t)S * sizeof(float));
            #pragma omp for schedule(static)
            for (int task = 0; task < T * H; task++) {
                if (f16) attn_task_avx2_h(Q, (const uint16_t *)kb.buf, (const uint16_t *)vb.buf, O, task / H, task % H,
                                          H, Hkv, D, start + task / H + 1, scale, sc);
                else attn_task_avx2(Q, Kc, V, O, task / H, task % H, H, Hkv, D, start + task / H + 1, scale, sc);
            }
            free(sc);
        }
    } else
#endif
    #pragma omp parallel num_threads(nt)
    {
        float *sc = malloc((size_t)S * sizeof(float));
        #pragma omp for schedule(static)
        for (int task = 0; task < T * H; task++) {
            int t = task / H, h = task % H, kh = h / G, n = start + t + 1;
            const float *q = Q + ((size_t)t * H + h) * D;
            float mx = -INFINITY;
            for (int s = 0; s < n; s++) {
                float kt[512]; const float *k = Kc + ((size_t)s * Hkv + kh) * D;
                if (f16) { const uint16_t *kh16 = (const uint16_t *)kb.buf + ((size_t)s * Hkv + kh) * D;
                           for (int i = 0; i < D; i++) kt[i] = fp16_to_fp32(kh16[i]); k = kt; }
                sc[s] = vdot(q, k, D) * scale;
                if (sc[s] > mx) mx = sc[s];
            }
            float sum = 0.f;
            for (int s = 0; s < n; s++) { sc[s] = expf(sc[s] - mx); sum += sc[s]; }
            float inv = 1.0f / sum, *o = O + ((size_t)t * H + h) * D;
            for (int i = 0; i < D; i++) o[i] = 0.f;
            for (int s = 0; s < n; s++) {
                float vt[512]; const float *v = V + ((size_t)s * Hkv + kh) * D;
                if (f16) { const uint16_t *vh16 = (const uint16_t *)vb.buf + ((size_t)s * Hkv + kh) * D;
                           for (int i = 0; i < D; i++) vt[i] = fp16_to_fp32(vh16[i]); v = vt; }
                vaxpy(o, sc[s] * inv, v, D);
            }
        }
        free(sc);
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&qb); PyBuffer_Release(&kb); PyBuffer_Release(&vb); PyBuffer_Release(&ob);
    return ret;
}


/* rms_norm(x (T,n), w (n), out (T,n), T, n, eps): per row, double accumulation as ggml. */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    Py_buffer xb, wb, ob; int T, n; double eps;
    if (!PyArg_ParseTuple(args, "y*y*w*iid", &xb, &wb, &ob, &T, &n, &eps)) return NULL;
    PyObject *ret = NULL;
    if ((size_t)xb.len < (size_t)T * n * 4 || (size_t)wb.len < (size_t)n * 4 || (size_t)ob.len < (size_t)T * n * 4) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: a buffer is smaller than its shape"); goto done;
    }
    const float *x = xb.buf, *w = wb.buf; float *o = ob.buf;
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n; float *orow = o + (size_t)t * n;
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += (double)xr[i] * xr[i];
        float scale = 1.0f / sqrtf((float)(sum / n) + (float)eps);
        for (int i = 0; i < n; i++) orow[i] = xr[i] * scale * w[i];
    }
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&ob);
    return ret;
}

/* rope(x (T,H,D) in place, cos (T,R/2), sin (T,R/2), T, H, D, R, neox) */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    Py_buffer xb, cb, sb; int T, H, D, R, neox;
    if (!PyArg_ParseTuple(args, "w*y*y*iiiip", &xb, &cb, &sb, &T, &H, &D, &R, &neox)) return NULL;
    PyObject *ret = NULL;
    int half = R / 2;
    if ((size_t)xb.len < (size_t)T * H * D * 4 || (size_t)cb.len < (size_t)T * half * 4 || (size_t)sb.len < (size_t)T * half * 4 || R > D) {
        PyErr_SetString(PyExc_ValueError, "rope: a buffer is smaller than its shape"); goto done;
    }
    float *x = xb.buf; const float *c = cb.buf, *s = sb.buf;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            float *v = x + ((size_t)t * H + h) * D; const float *ct = c + (size_t)t * half, *st = s + (size_t)t * half;
            for (int i = 0; i < half; i++) {
                int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                float a = v[i0], b = v[i1];
                v[i0] = a * ct[i] - b * st[i];
                v[i1] = a * st[i] + b * ct[i];
            }
        }
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&cb); PyBuffer_Release(&sb);
    return ret;
}

/* swiglu(gate (n) in place, up (n)): gate = silu(gate) * up */
static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    Py_buffer gb, ub;
    if (!PyArg_ParseTuple(args, "w*y*", &gb, &ub)) return NULL;
    PyObject *ret = NULL;
    if (gb.len != ub.len) { PyErr_SetString(PyExc_ValueError, "swiglu: shapes differ"); goto done; }
    float *g = gb.buf; const float *u = ub.buf; Py_ssize_t n = gb.len / 4;
    for (Py_ssize_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&gb); PyBuffer_Release(&ub);
    return ret;
}

static void rms_row(const float *x, const float *w, float *o, int n, float eps) {
    double sum = 0.0;                       /* exactly py_rms_norm's arithmetic */
    for (int i = 0; i < n; i++) sum += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(sum / n) + eps);
    for (int i = 0; i < n; i++) o[i] = x[i] * scale * w[i];
}
static void rope_row(float *x, const float *c, const float *s, int H, int D, int R, int neox) {
    int half = R / 2;                       /* exactly py_rope's arithmetic, one position */
    for (int h = 0; h < H; h++) {
        float *v = x + (size_t)h * D;
        for (int i = 0; i < half; i++) {
            int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
            float a = v[i0], b = v[i1];
            v[i0] = a * c[i] - b * s[i];
            v[i1] = a * s[i] + b * c[i];
        }
    }
}

/* Mixture-of-experts routing of one row: softmax over the E router logits (max subtracted, expf,
 * the sum in double, as ggml's soft_max), the k most probable experts (a tie goes to the lower
 * index), optionally renormalised to sum 1. The chosen experts come back in ascending order —
 * the order their outputs are summed in — with their weights. E <= 256, k <= E. */
static void route_row(const float *logits, int E, int k, int normalize, int *sel, float *w) {
    float p[256];
    unsigned char used[256] = {0};
    float mx = -INFINITY;
    for (int i = 0; i < E; i++) if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int i = 0; i < E; i++) { p[i] = expf(logits[i] - mx); sum += p[i]; }
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < E; i++) p[i] *= inv;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < E; i++)
            if (!used[i] && (best < 0 || p[i] > p[best])) best = i;
        used[best] = 1; sel[j] = best; w[j] = p[best];
    }
    if (normalize) {
        float s = 0.f;
        for (int j = 0; j < k; j++) s += w[j];
        for (int j = 0; j < k; j++) w[j] = w[j] / s;
    }
    for (int j = 1; j < k; j++)                 /* ascending expert id, weights alongside */
        for (int m = j; m > 0 && sel[m - 1] > sel[m]; m--) {
            int ts = sel[m]; sel[m] = sel[m - 1]; sel[m - 1] = ts;
            float tw = w[m]; w[m] = w[m - 1]; w[m - 1] = tw;
        }
}

/* route(logits (T,E), T, E, k, normalize, experts int32 (T,k) out, weights (T,k) out) */
static PyObject *py_route(PyObject *self, PyObject *args) {
    Py_buffer lb, eb, wb; int T, E, k, norm;
    if (!PyArg_ParseTuple(args, "y*iiipw*w*", &lb, &T, &E, &k, &norm, &eb, &wb)) return NULL;
    PyObject *ret = NULL;
    if (E < 1 || E > 256 || k < 1 || k > E) { PyErr_Format(PyExc_ValueError, "route: %d of %d experts (1 <= k <= E <= 256)", k, E); goto done; }
    if ((size_t)lb.len < (size_t)T * E * 4 || (size_t)eb.len < (size_t)T * k * 4 || (size_t)wb.len < (size_t)T * k * 4) {
        PyErr_SetString(PyExc_ValueError, "route: a buffer is smaller than its shape"); goto done;
    }
    for (int t = 0; t < T; t++)
        route_row((const float *)lb.buf + (size_t)t * E, E, k, norm, (int *)eb.buf + (size_t)t * k, (float *)wb.buf + (size_t)t * k);
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&lb); PyBuffer_Release(&eb); PyBuffer_Release(&wb);
    return ret;
}

/* decode_layer(x (n) in place, attn_norm, eps, (wq, wk, wv), qkv_type, wo, wo_type, kcache, vcache,
 *              pos, cos, sin, H, Hkv, D, R, neox, ffn, threads)
 *   ffn: None (the caller runs the FFN), a dense SwiGLU (ffn_norm, wg, wu, gu_type, wd, wd_type, n_ff),
 *        or a routed one (ffn_norm, router F32 (E, n), wg_exps, wu_exps, gu_type, wd_exps, wd_type,
 *        n_ff, E, k, normalize) with the experts stacked (E, n_ff, n) / (E, n, n_ff).
 * One decode row through a pre-norm llama layer — the same operations, in the same order, as the
 * step-by-step path (rms_norm, matmul_many, rope, KV store, attention, matmul, swiglu; route and
 * each chosen expert's SwiGLU summed in ascending expert order), so the row is bit-identical to
 * it; but one call and one parallel region instead of dozens of Python calls and regions. The
 * layer's K/V caches (capacity, Hkv, D) float32 get position `pos` written; attention reads
 * positions 0..pos. */
enum { FFN_NONE, FFN_DENSE, FFN_MOE };
#define MAX_K 16

static PyObject *py_decode_layer(PyObject *self, PyObject *args) {
    Py_buffer xb, anb, fnb = {0}, rtb = {0}, wb[3], wob, gb[2] = {{0}}, wdb = {0}, kb, vb, cb, sb;
    int qkv_t, wo_t, gu_t = 0, wd_t = 0, pos, H, Hkv, D, R, neox, n_ff = 0, threads, ffn = FFN_NONE;
    int E = 1, k = 1, norm = 0;
    double eps;
    PyObject *ffn_obj;
    if (!PyArg_ParseTuple(args, "w*y*d(y*y*y*)iy*iw*w*iy*y*iiiipOi",
                          &xb, &anb, &eps, &wb[0], &wb[1], &wb[2], &qkv_t, &wob, &wo_t,
                          &kb, &vb, &pos, &cb, &sb, &H, &Hkv, &D, &R, &neox, &ffn_obj, &threads))
        return NULL;
    PyObject *ret = NULL;
    if (ffn_obj != Py_None) {
        int ok;
        if (PyTuple_Check(ffn_obj) && PyTuple_GET_SIZE(ffn_obj) == 11) {
            ffn = FFN_MOE;
            ok = PyArg_ParseTuple(ffn_obj, "y*y*y*y*iy*iiiip", &fnb, &rtb, &gb[0], &gb[1], &gu_t, &wdb, &wd_t,
                                  &n_ff, &E, &k, &norm);
        } else {
            ffn = FFN_DENSE;
            ok = PyArg_ParseTuple(ffn_obj, "y*y*y*iy*ii", &fnb, &gb[0], &gb[1], &gu_t, &wdb, &wd_t, &n_ff);
        }
        if (!ok) {
            PyBuffer_Release(&xb); PyBuffer_Release(&anb); PyBuffer_Release(&wob);
            for (int i = 0; i < 3; i++) PyBuffer_Release(&wb[i]);
            PyBuffer_Release(&kb); PyBuffer_Release(&vb); PyBuffer_Release(&cb); PyBuffer_Release(&sb);
            return NULL;
        }
    }
    int n = (int)(xb.len / 4), qn = H * D, kvn = Hkv * D;
    TypeInfo tq, to, tg = {1, 4, A_F32}, td = {1, 4, A_F32}, tr = {1, 4, A_F32};
    if (!g_avx2) { PyErr_SetString(PyExc_RuntimeError, "decode_layer needs the AVX2 kernels"); goto done; }
    if (!type_info(qkv_t, &tq) || !type_info(wo_t, &to) || (ffn && (!type_info(gu_t, &tg) || !type_info(wd_t, &td)))) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: a weight type has no compiled kernel"); goto done;
    }
    if (n % tq.block || qn % to.block ||
        (size_t)wb[0].len < (size_t)qn * (n / tq.block) * tq.bytes || (size_t)wb[1].len < (size_t)kvn * (n / tq.block) * tq.bytes ||
        (size_t)wb[2].len < (size_t)kvn * (n / tq.block) * tq.bytes || (size_t)wob.len < (size_t)n * (qn / to.block) * to.bytes ||
        (size_t)kb.len < (size_t)(pos + 1) * kvn * 4 || (size_t)vb.len < (size_t)(pos + 1) * kvn * 4 ||
        (size_t)cb.len < (size_t)(R / 2) * 4 || (size_t)sb.len < (size_t)(R / 2) * 4 || R > D ||
        (size_t)anb.len < (size_t)n * 4) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: a buffer is smaller than its shape"); goto done;
    }
    if (ffn == FFN_MOE && (E < 1 || E > 256 || k < 1 || k > E || k > MAX_K || (size_t)rtb.len < (size_t)E * n * 4)) {
        PyErr_Format(PyExc_ValueError, "decode_layer: %d of %d experts, or a router smaller than its shape "
                     "(the one-call path takes 1 <= k <= %d, k <= E <= 256)", k, E, MAX_K);
        goto done;
    }
    size_t gu_row = ffn ? (size_t)(n / tg.block) * tg.bytes : 0, d_row = ffn ? (size_t)(n_ff / td.block) * td.bytes : 0;
    if (ffn && (n % tg.block || n_ff % td.block || (size_t)fnb.len < (size_t)n * 4 ||
                (size_t)gb[0].len < (size_t)E * n_ff * gu_row || (size_t)gb[1].len < (size_t)E * n_ff * gu_row ||
                (size_t)wdb.len < (size_t)E * n * d_row)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: an FFN buffer is smaller than its shape"); goto done;
    }
    {
        float *x = xb.buf, *kc = kb.buf, *vc = vb.buf;
        const float *an = anb.buf, *fn = fnb.buf, *cs = cb.buf, *sn = sb.buf;
        int ke = ffn == FFN_MOE ? k : 1;         /* FFNs run: the chosen experts, or the one */
        size_t nf = ffn ? (size_t)n_ff * ke : 1;
        float *a = malloc((size_t)n * 4), *q = malloc((size_t)qn * 4), *kk = kc + (size_t)pos * kvn,
              *v = vc + (size_t)pos * kvn, *att = malloc((size_t)qn * 4), *o = malloc((size_t)n * 4),
              *f = malloc((size_t)n * 4), *g = malloc(nf * 4), *u = malloc(nf * 4), *dn = malloc((size_t)n * ke * 4),
              *logits = malloc((size_t)E * 4);
        float *kt = malloc((size_t)kvn * 4), *vt = malloc((size_t)kvn * 4);
        const uint8_t *Wqkv[3] = {wb[0].buf, wb[1].buf, wb[2].buf}, *Wo[1] = {wob.buf}, *Wr[1] = {rtb.buf},
                      *Wgu[2 * MAX_K] = {gb[0].buf, gb[1].buf}, *Wd = wdb.buf;
        int Nqkv[3] = {qn, kvn, kvn}, No[1] = {n}, Nr[1] = {E}, Ngu[2 * MAX_K] = {n_ff, n_ff}, sel[MAX_K] = {0};
        float *Oqkv[3] = {q, kt, vt}, *Oo[1] = {o}, *Or[1] = {logits}, *Ogu[2 * MAX_K] = {g, u}, wsel[MAX_K] = {1.f};
        Act aq, ao, ag = {0}, ad = {0}, ar = {0};
        act_alloc(&aq, &tq, a, 1, n); act_alloc(&ao, &to, att, 1, qn);
        if (ffn) { act_alloc(&ag, &tg, f, 1, n); act_alloc(&ad, &td, g, ke, n_ff); act_alloc(&ar, &tr, f, 1, n); }
        int nt = pick_threads(threads), S = pos + 1;
        float scale = 1.0f / sqrtf((float)D);
        Py_BEGIN_ALLOW_THREADS
        #pragma omp parallel num_threads(nt)
        {
            float *sc = malloc((size_t)S * sizeof(float));
            #pragma omp single
            { rms_row(x, an, a, n, (float)eps); act_row(&aq, 0, n); }
            rows_dot(&aq, 1, n, qkv_t, &tq, 3, Wqkv, Nqkv, Oqkv);
            #pragma omp single
            {
                rope_row(q, cs, sn, H, D, R, neox); rope_row(kt, cs, sn, Hkv, D, R, neox);
                memcpy(kk, kt, (size_t)kvn * 4); memcpy(v, vt, (size_t)kvn * 4);
            }
            #pragma omp for schedule(static)
            for (int h = 0; h < H; h++) {
#ifdef KILN_X86
                attn_task_avx2(q, kc, vc, att, 0, h, H, Hkv, D, S, scale, sc);
#endif
            }
            #pragma omp single
            act_row(&ao, 0, qn);
            rows_dot(&ao, 1, qn, wo_t, &to, 1, Wo, No, Oo);
            #pragma omp single
            {
                for (int i = 0; i < n; i++) x[i] = x[i] + o[i];
                if (ffn) { rms_row(x, fn, f, n, (float)eps); act_row(&ag, 0, n); }
            }
            if (ffn == FFN_MOE) {
                rows_dot(&ar, 1, n, T_F32, &tr, 1, Wr, Nr, Or);
                #pragma omp single
                {
                    route_row(logits, E, k, norm, sel, wsel);
                    for (int j = 0; j < k; j++) {
                        Wgu[2 * j] = (const uint8_t *)gb[0].buf + (size_t)sel[j] * n_ff * gu_row;
                        Wgu[2 * j + 1] = (const uint8_t *)gb[1].buf + (size_t)sel[j] * n_ff * gu_row;
                        Ngu[2 * j] = Ngu[2 * j + 1] = n_ff;
                        Ogu[2 * j] = g + (size_t)j * n_ff; Ogu[2 * j + 1] = u + (size_t)j * n_ff;
                    }
                }
            }
            if (ffn) {
                rows_dot(&ag, 1, n, gu_t, &tg, 2 * ke, Wgu, Ngu, Ogu);
                #pragma omp single
                for (int j = 0; j < ke; j++) {
                    float *gj = g + (size_t)j * n_ff; const float *uj = u + (size_t)j * n_ff;
                    for (int i = 0; i < n_ff; i++) gj[i] = gj[i] / (1.0f + expf(-gj[i])) * uj[i];
                    act_row(&ad, j, n_ff);
                }
                /* every chosen expert's down rows, one task each (ad's row j is expert j's input) */
                #pragma omp for schedule(static)
                for (int r = 0; r < ke * n; r++) {
                    int j = r / n, i = r % n;
                    dn[r] = dot_row(wd_t, &td, Wd + ((size_t)sel[j] * n + i) * d_row, &ad, j, n_ff);
                }
                #pragma omp single
                for (int i = 0; i < n; i++) {
                    if (ffn == FFN_DENSE) { x[i] = x[i] + dn[i]; continue; }
                    float acc = 0.f;        /* the step path's zeros, += weight * expert out, in order */
                    for (int j = 0; j < ke; j++) acc = acc + wsel[j] * dn[(size_t)j * n + i];
                    x[i] = x[i] + acc;
                }
            }
            free(sc);
        }
        Py_END_ALLOW_THREADS
        act_free(&aq); act_free(&ao);
        if (ffn) { act_free(&ag); act_free(&ad); act_free(&ar); }
        free(a); free(q); free(att); free(o); free(f); free(g); free(u); free(dn); free(logits); free(kt); free(vt);
    }
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&anb);
    for (int i = 0; i < 3; i++) PyBuffer_Release(&wb[i]);
    PyBuffer_Release(&wob);
    PyBuffer_Release(&kb); PyBuffer_Release(&vb); PyBuffer_Release(&cb); PyBuffer_Release(&sb);
    if (ffn) { PyBuffer_Release(&fnb); PyBuffer_Release(&gb[0]); PyBuffer_Release(&gb[1]); PyBuffer_Release(&wdb); }
    if (ffn == FFN_MOE) PyBuffer_Release(&rtb);
    return ret;
}

static PyObject *py_features(PyObject *self, PyObject *noargs) {
    int omp = 0, maxt = 1;
#ifdef _OPENMP
    omp = 1; maxt = omp_get_max_threads();
#endif
    return Py_BuildValue("{s:O,s:O,s:i,s:i}", "avx2_fma", g_avx2 ? Py_True : Py_False,
                         "openmp", omp ? Py_True : Py_False, "max_threads", maxt, "threads", default_threads);
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    default_threads = n;
    Py_RETURN_NONE;
}

static PyObject *py_set_simd(PyObject *self, PyObject *args) {  /* for tests: force the portable path */
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#ifdef KILN_X86
    g_avx2 = on && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    return PyBool_FromLong(g_avx2);
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(x, w, type, T, K, N, out, threads)"},
    {"matmul_many", py_matmul_many, METH_VARARGS, "matmul_many(x, type, T, K, [(w, N, out), ...], threads)"},
    {"decode_layer", py_decode_layer, METH_VARARGS, "one decode row through a plain llama layer, in place"},
    {"route", py_route, METH_VARARGS, "route(logits, T, E, k, normalize, experts_out, weights_out)"},
    {"attention", py_attention, METH_VARARGS, "attention(q, k, v, out, T, H, Hkv, d, S, start, threads)"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, w, out, T, n, eps)"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cos, sin, T, H, D, R, neox) in place"},
    {"swiglu", py_swiglu, METH_VARARGS, "swiglu(gate, up): gate = silu(gate) * up, in place"},
    {"features", py_features, METH_NOARGS, "CPU features and threading of this build"},
    {"set_threads", py_set_threads, METH_VARARGS, "default thread count (0: OpenMP's)"},
    {"set_simd", py_set_simd, METH_VARARGS, "enable/disable the AVX2 paths; returns whether they are on"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Kiln's compiled kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef KILN_X86
    __builtin_cpu_init();
    g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    return PyModule_Create(&module);
}
