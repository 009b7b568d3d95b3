/* Activation quantization and the dot product of every weight type with it.
 *
 * matmul(x, W): W stays in its GGUF blocks. Each activation row is quantized as ggml quantizes
 * it for that weight type (vec_dot_type: Q8_0, Q8_1, Q8_K, fp16, bf16, or none for F32), then
 * every output element is one thread's dot product over the row's blocks in a fixed order.
 * So a row's result never depends on how many rows were multiplied with it or on the thread
 * count — prefix reuse and batched decode give the same bits as a fresh, single run.
 *
 * AVX2/FMA kernels (dot_avx2.c, chosen at run time) for every type but BF16 — ggml's own
 * arithmetic — and portable C here for every type, so a build is not tied to the machine that
 * made it.
 */
#include "kiln.h"

/* ---- type table ----------------------------------------------------------------------------- */

int type_info(int t, TypeInfo *ti) {
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
    case T_MXFP4: *ti = (TypeInfo){32, 17, A_Q8_0}; return 1;
    }
    return 0;
}

static void quantize_row(const float *x, int K, int kind, float *xr, int8_t *q, float *d, float *s,
                         int16_t *bs) {
    if (kind == A_F16) { for (int i = 0; i < K; i++) xr[i] = round_fp16(x[i]); return; }
    if (kind == A_BF16) { for (int i = 0; i < K; i++) xr[i] = round_bf16(x[i]); return; }
    int B = kind == A_Q8_K ? 256 : 32;
#ifdef KILN_X86
    if (g_avx2 && B == 32) {
        for (int b = 0; b < K / 32; b++) {
            float amax;
            int sum = quantize_q8_block_avx2(x + b * 32, q + b * 32, &amax);
            float dd = amax / 127.f;
            d[b] = round_fp16(dd);
            if (s) s[b] = round_fp16(dd * (float)sum);
        }
        return;
    }
#endif
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
        if (kind == A_Q8_K) {
            /* ggml stores 1/iscale (its sign follows the largest value's; the products are
             * the same bits either way) and the sums of 16 for the weights' minimums */
            d[b] = amax != 0.f ? 1.f / id : 0.f;
            for (int j = 0; j < B / 16; j++) {
                int s16 = 0;
                for (int i = 0; i < 16; i++) s16 += q[b * B + j * 16 + i];
                bs[b * (B / 16) + j] = (int16_t)s16;
            }
        } else {
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

static float dot_mxfp4(const uint8_t *w, const Act *a, int t, int nb) {     /* ggml's generic order */
    const int8_t *q = a->q + (size_t)t * nb * 32; const float *d = a->d + (size_t)t * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; b++, w += 17) {
        const uint8_t *qs = w + 1; const int8_t *y = q + b * 32; int s1 = 0, s2 = 0;
        for (int j = 0; j < 16; j++) { s1 += y[j] * KVALUES_MXFP4[qs[j] & 0xf]; s2 += y[j + 16] * KVALUES_MXFP4[qs[j] >> 4]; }
        acc += d[b] * e8m0_to_fp32_half(w[0]) * (float)(s1 + s2);
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


int g_avx2 = 0;
int g_avx512 = 0;

float dot_row(int type, const TypeInfo *ti, const uint8_t *w, const Act *a, int t, int K) {
    int nb = K / ti->block;
#ifdef KILN_X86
    float r;
    if (g_avx512 && dot_row_avx512(type, w, a, t, nb, &r)) return r;
    if (g_avx2 && dot_row_avx2(type, w, a, t, K, nb, &r)) return r;
#endif
    switch (type) {
    case T_Q4_0: return dot_q4_0(w, a, t, nb);
    case T_Q4_1: return dot_q4_1(w, a, t, nb);
    case T_Q5_0: return dot_q5_0(w, a, t, nb);
    case T_Q5_1: return dot_q5_1(w, a, t, nb);
    case T_Q8_0: return dot_q8_0(w, a, t, nb);
    case T_MXFP4: return dot_mxfp4(w, a, t, nb);
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K:
        return dot_kquant(type, ti->bytes, w, a, t, nb);
    default: return dot_float(type, w, a, t, K);
    }
}

/* ---- threads and activation rows ------------------------------------------------------------ */

int default_threads = 0;

int pick_threads(int requested) {      /* 0: the default; the default 0: all OpenMP threads */
    int n = requested > 0 ? requested : default_threads;
#ifdef _OPENMP
    if (n <= 0) n = omp_get_max_threads();
#endif
    return n > 0 ? n : 1;
}

/* Activations of T rows of x (T, K) as weight type ti multiplies them: allocated, then quantized
 * row by row (each row on its own, so who quantizes it changes nothing). */
void act_alloc(Act *a, const TypeInfo *ti, const float *x, int T, int K) {
    int B = ti->act == A_Q8_K ? 256 : 32;
    *a = (Act){ti->act, x, NULL, NULL, NULL, NULL, NULL, NULL, NULL, T};
    if (ti->act == A_F16 || ti->act == A_BF16) a->xr = malloc((size_t)T * K * sizeof(float));
    if (ti->act >= A_Q8_0) {
        a->q = malloc((size_t)T * K); a->d = malloc((size_t)T * (K / B) * sizeof(float));
        a->s = malloc((size_t)T * (K / B) * sizeof(float));
        /* + 8: a kernel's vector load past the last row (lanes it ignores) */
        a->dT = calloc((size_t)T * (K / B) + 8, sizeof(float));
        if (ti->act == A_Q8_K) {
            a->bs = malloc((size_t)T * (K / 16) * sizeof(int16_t));
            a->kT = calloc(((size_t)T * (K / B) + 8) * 8, sizeof(int16_t));
        } else a->sT = calloc((size_t)T * (K / B) + 8, sizeof(float));
#ifdef KILN_X86
        if (ti->act == A_Q8_0 && g_avx512 && T >= 4) a->qu = malloc((size_t)T * K);
        if (ti->act == A_Q8_0 && g_avx512) a->ys = malloc((size_t)T * (K / 4) * sizeof(int32_t));
#endif
    }
}
void act_row(Act *a, int t, int K) {
    if (a->kind == A_F32) return;
    int B = a->kind == A_Q8_K ? 256 : 32;
    quantize_row(a->xf + (size_t)t * K, K, a->kind, a->xr ? a->xr + (size_t)t * K : NULL,
                 a->q ? a->q + (size_t)t * K : NULL, a->d ? a->d + (size_t)t * (K / B) : NULL,
                 a->s ? a->s + (size_t)t * (K / B) : NULL, a->bs ? a->bs + (size_t)t * (K / 16) : NULL);
    if (a->dT)
        for (int b = 0; b < K / B; b++) {
            a->dT[(size_t)b * a->ts + t] = a->d[(size_t)t * (K / B) + b];
            if (a->sT) a->sT[(size_t)b * a->ts + t] = a->s[(size_t)t * (K / B) + b];
            if (a->kT)
                for (int i = 0; i < 8; i++) {
                    const int16_t *bs = a->bs + (size_t)t * (K / 16) + 16 * b;
                    a->kT[((size_t)b * a->ts + t) * 8 + i] = (int16_t)(bs[2 * i] + bs[2 * i + 1]);
                }
        }
    if (a->qu) {
        const int8_t *q = a->q + (size_t)t * K;
        uint8_t *u = a->qu + (size_t)t * K;
        for (int i = 0; i < K; i++) u[i] = (uint8_t)(q[i] + 128);
    }
    if (a->ys) {
        const int8_t *q = a->q + (size_t)t * K;
        int32_t *ys = a->ys + (size_t)t * (K / 4);
        for (int i = 0; i < K / 4; i++) ys[i] = -8 * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
    }
}
void act_free(Act *a) {
    free(a->xr); free(a->q); free(a->d); free(a->s); free(a->bs); free(a->dT); free(a->sT); free(a->kT); free(a->qu); free(a->ys);
}
/* Row t of a as a one-row Act (no copy): to multiply one row of a batch on its own. */
Act act_view(const Act *a, int t, int K) {
    int B = a->kind == A_Q8_K ? 256 : 32;
    Act v = *a;
    v.xf = a->xf + (size_t)t * K;
    if (a->xr) v.xr = a->xr + (size_t)t * K;
    if (a->q) v.q = a->q + (size_t)t * K;
    if (a->d) v.d = a->d + (size_t)t * (K / B);
    if (a->s) v.s = a->s + (size_t)t * (K / B);
    if (a->bs) v.bs = a->bs + (size_t)t * (K / 16);
    if (a->dT) { v.dT = a->dT + t; v.sT = a->sT ? a->sT + t : NULL; }   /* the same stride: row t is lane 0 */
    if (a->kT) v.kT = a->kT + (size_t)t * 8;
    if (a->qu) v.qu = a->qu + (size_t)t * K;
    if (a->ys) v.ys = a->ys + (size_t)t * (K / 4);
    return v;
}
