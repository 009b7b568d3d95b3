/* Weights quantized as llama.cpp's quantizer writes them (`kiln models quantize`).
 *
 * Without an importance matrix llama.cpp quantizes every type through ggml's reference row
 * functions (ggml-quants.c: quantize_row_*_ref), compiled in ggml-base with no FMA. These are
 * those functions' arithmetic, operation for operation and in the same order, so that the bytes
 * are the same: nothing here may be reassociated or fused (this file has no target("fma")
 * function, and float sums are never vectorized by GCC without -ffast-math). Ported from ggml
 * (MIT, the ggml authors). */
#include "kiln.h"

#define QMIN(a, b) ((a) < (b) ? (a) : (b))
#define QMAX(a, b) ((a) > (b) ? (a) : (b))
#define GROUP_MAX_EPS 1e-15f

static inline int nearest_int(float fval) {      /* round half to even through the float adder */
    float val = fval + 12582912.f;
    int i; memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}
static inline void put16(uint8_t *p, float f) { uint16_t h = fp32_to_fp16(f); memcpy(p, &h, 2); }
static inline float get16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return fp16_to_fp32(h); }

/* ---- 32-value blocks -------------------------------------------------------------------------- */

static void row_q4_0(const float *x, uint8_t *y, int64_t k) {       /* block: d, qs[16] */
    for (int64_t i = 0; i < k / 32; i++, x += 32, y += 18) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++) { const float v = x[j]; if (amax < fabsf(v)) { amax = fabsf(v); max = v; } }
        const float d = max / -8, id = d ? 1.0f / d : 0.0f;
        put16(y, d);
        for (int j = 0; j < 16; ++j) {
            const float x0 = x[j] * id, x1 = x[16 + j] * id;
            const uint8_t xi0 = QMIN(15, (int8_t)(x0 + 8.5f)), xi1 = QMIN(15, (int8_t)(x1 + 8.5f));
            y[2 + j] = xi0 | (xi1 << 4);
        }
    }
}

static void row_q4_1(const float *x, uint8_t *y, int64_t k) {       /* block: d, m, qs[16] */
    for (int64_t i = 0; i < k / 32; i++, x += 32, y += 20) {
        float min = 3.402823466e+38f, max = -3.402823466e+38f;
        for (int j = 0; j < 32; j++) { const float v = x[j]; if (v < min) min = v; if (v > max) max = v; }
        const float d = (max - min) / ((1 << 4) - 1), id = d ? 1.0f / d : 0.0f;
        put16(y, d); put16(y + 2, min);
        for (int j = 0; j < 16; ++j) {
            const float x0 = (x[j] - min) * id, x1 = (x[16 + j] - min) * id;
            const uint8_t xi0 = QMIN(15, (int8_t)(x0 + 0.5f)), xi1 = QMIN(15, (int8_t)(x1 + 0.5f));
            y[4 + j] = xi0 | (xi1 << 4);
        }
    }
}

static void row_q5_0(const float *x, uint8_t *y, int64_t k) {       /* block: d, qh[4], qs[16] */
    for (int64_t i = 0; i < k / 32; i++, x += 32, y += 22) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++) { const float v = x[j]; if (amax < fabsf(v)) { amax = fabsf(v); max = v; } }
        const float d = max / -16, id = d ? 1.0f / d : 0.0f;
        put16(y, d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            const float x0 = x[j] * id, x1 = x[16 + j] * id;
            const uint8_t xi0 = QMIN(31, (int8_t)(x0 + 16.5f)), xi1 = QMIN(31, (int8_t)(x1 + 16.5f));
            y[6 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
            qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
        }
        memcpy(y + 2, &qh, 4);
    }
}

static void row_q5_1(const float *x, uint8_t *y, int64_t k) {       /* block: d, m, qh[4], qs[16] */
    for (int64_t i = 0; i < k / 32; i++, x += 32, y += 24) {
        float min = 3.402823466e+38f, max = -3.402823466e+38f;
        for (int j = 0; j < 32; j++) { const float v = x[j]; if (v < min) min = v; if (v > max) max = v; }
        const float d = (max - min) / ((1 << 5) - 1), id = d ? 1.0f / d : 0.0f;
        put16(y, d); put16(y + 2, min);
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            const float x0 = (x[j] - min) * id, x1 = (x[16 + j] - min) * id;
            const uint8_t xi0 = (uint8_t)(x0 + 0.5f), xi1 = (uint8_t)(x1 + 0.5f);
            y[8 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
            qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
        }
        memcpy(y + 4, &qh, 4);
    }
}

static void row_q8_0(const float *x, uint8_t *y, int64_t k) {       /* block: d, qs[32] */
    for (int64_t i = 0; i < k / 32; i++, x += 32, y += 34) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) { const float v = x[j]; amax = QMAX(amax, fabsf(v)); }
        const float d = amax / ((1 << 7) - 1), id = d ? 1.0f / d : 0.0f;
        put16(y, d);
        for (int j = 0; j < 32; ++j) { const float x0 = x[j] * id; ((int8_t *)y)[2 + j] = roundf(x0); }
    }
}

/* ---- super-blocks of 256: the scale searches ------------------------------------------------- */

/* make_qx_quants, as Q6_K calls it (rmse_type 1, no importance weights) */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) { float ax = fabsf(x[i]); if (ax > amax) { amax = ax; max = x[i]; } }
    if (amax < GROUP_MAX_EPS) { for (int i = 0; i < n; ++i) L[i] = 0; return 0.f; }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = QMAX(-nmax, QMIN(nmax - 1, l));
        L[i] = l + nmax;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = QMAX(-nmax, QMIN(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) { int l = nearest_int(iscale * x[i]); L[i] = nmax + QMAX(-nmax, QMIN(nmax - 1, l)); }
            scale = sumlx / suml2; best = scale * sumlx;
        }
    }
    return scale;
}

static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L, float *the_min,
                              uint8_t *Laux, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0];
    float sum_w = weights[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) { for (int i = 0; i < n; ++i) L[i] = 0; *the_min = -min; return 0.f; }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * (x[i] - min));
        L[i] = QMAX(0, QMIN(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = diff * diff;
        float w = weights[i];
        best_error += w * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * (x[i] - min));
            l = QMAX(0, QMIN(nmax, l));
            Laux[i] = l;
            float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) { this_min = 0; this_scale = sum_xl / sum_l2; }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = diff * diff;
                float w = weights[i];
                cur_error += w * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; ++i) L[i] = Laux[i];
                best_error = cur_error; scale = this_scale; min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4); }
}

/* Q4_K and Q5_K share the scale search and the packing of the eight (scale, min) pairs; nmax is
 * 15 or 31. Block: d, dmin, scales[12], then (Q5_K) qh[32], then qs[128]. */
static void row_kmin(const float *x, uint8_t *y, int64_t k, int nmax) {
    const int q5 = nmax == 31, bytes = q5 ? 176 : 144;
    uint8_t L[256], Laux[32];
    float weights[32], mins[8], scales[8];
    for (int64_t i = 0; i < k / 256; i++, x += 256, y += bytes) {
        uint8_t *sc12 = y + 4;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; ++j) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
            float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
            scales[j] = q5 ? make_qkx2_quants(32, 31, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -0.5f, 0.1f, 15)
                           : make_qkx2_quants(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20);
            float scale = scales[j];
            if (scale > max_scale) max_scale = scale;
            float min = mins[j];
            if (min > max_min) max_min = min;
        }
        float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        memset(sc12, 0, 12);
        for (int j = 0; j < 8; ++j) {
            uint8_t ls = nearest_int(inv_scale * scales[j]);
            uint8_t lm = nearest_int(inv_min * mins[j]);
            ls = QMIN(63, ls);
            lm = QMIN(63, lm);
            if (j < 4) { sc12[j] = ls; sc12[j + 4] = lm; }
            else {
                sc12[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                sc12[j - 4] |= ((ls >> 4) << 6);
                sc12[j - 0] |= ((lm >> 4) << 6);
            }
        }
        put16(y, max_scale / 63.f);
        put16(y + 2, max_min / 63.f);
        uint8_t sc, m;
        for (int j = 0; j < 8; ++j) {
            get_scale_min_k4(j, sc12, &sc, &m);
            const float d = get16(y) * sc;
            if (!d) continue;
            const float dm = get16(y + 2) * m;
            for (int ii = 0; ii < 32; ++ii) {
                int l = nearest_int((x[32 * j + ii] + dm) / d);
                l = QMAX(0, QMIN(nmax, l));
                L[32 * j + ii] = l;
            }
        }
        if (!q5) {
            uint8_t *q = y + 16;
            for (int j = 0; j < 256; j += 64, q += 32)
                for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (L[j + l + 32] << 4);
            continue;
        }
        uint8_t *qh = y + 16, *ql = y + 48;
        memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < 256; n += 64, ql += 32) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[n + j];
                if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
                int l2 = L[n + j + 32];
                if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
                ql[j] = l1 | (l2 << 4);
            }
            m1 <<= 2; m2 <<= 2;
        }
    }
}

static void row_q6_K(const float *x, uint8_t *y, int64_t k) {       /* block: ql[128], qh[64], scales[16], d */
    int8_t L[256];
    float scales[16];
    for (int64_t i = 0; i < k / 256; i++, x += 256, y += 210) {
        int8_t *sc = (int8_t *)(y + 192);
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ++ib) {
            const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
            scales[ib] = scale;
            const float abs_scale = fabsf(scale);
            if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = scale; }
        }
        if (max_abs_scale < GROUP_MAX_EPS) { memset(y, 0, 210); put16(y + 208, 0.f); continue; }
        float iscale = -128.f / max_scale;
        put16(y + 208, 1 / iscale);
        for (int ib = 0; ib < 16; ++ib) sc[ib] = QMIN(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < 16; ++j) {
            float d = get16(y + 208) * sc[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                l = QMAX(-32, QMIN(31, l));
                L[16 * j + ii] = l + 32;
            }
        }
        uint8_t *ql = y, *qh = y + 128;
        for (int j = 0; j < 256; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l + 0] & 0xF, q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l + 0] = q1 | (q3 << 4);
                ql[l + 32] = q2 | (q4 << 4);
                qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                        ((L[j + l + 96] >> 4) << 6);
            }
        }
    }
}

static void row_f16(const float *x, uint8_t *y, int64_t k) {
    for (int64_t i = 0; i < k; i++) put16(y + 2 * i, x[i]);
}

/* Bytes of one row of n values in `type`, 0 for a type this file does not write. */
int64_t quantized_row_bytes(int type, int64_t n) {
    switch (type) {
    case T_F16: return 2 * n;
    case T_Q4_0: return n % 32 ? 0 : n / 32 * 18;
    case T_Q4_1: return n % 32 ? 0 : n / 32 * 20;
    case T_Q5_0: return n % 32 ? 0 : n / 32 * 22;
    case T_Q5_1: return n % 32 ? 0 : n / 32 * 24;
    case T_Q8_0: return n % 32 ? 0 : n / 32 * 34;
    case T_Q4_K: return n % 256 ? 0 : n / 256 * 144;
    case T_Q5_K: return n % 256 ? 0 : n / 256 * 176;
    case T_Q6_K: return n % 256 ? 0 : n / 256 * 210;
    default: return 0;
    }
}

/* rows × n float32 values → rows of `type`, the rows split between threads (each row's bytes
 * depend on that row alone, so the split changes nothing). */
void quantize_rows(int type, const float *x, int64_t rows, int64_t n, uint8_t *out, int threads) {
    const int64_t rb = quantized_row_bytes(type, n);
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 16) if(rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        uint8_t *yr = out + r * rb;
        switch (type) {
        case T_F16: row_f16(xr, yr, n); break;
        case T_Q4_0: row_q4_0(xr, yr, n); break;
        case T_Q4_1: row_q4_1(xr, yr, n); break;
        case T_Q5_0: row_q5_0(xr, yr, n); break;
        case T_Q5_1: row_q5_1(xr, yr, n); break;
        case T_Q8_0: row_q8_0(xr, yr, n); break;
        case T_Q4_K: row_kmin(xr, yr, n, 15); break;
        case T_Q5_K: row_kmin(xr, yr, n, 31); break;
        case T_Q6_K: row_q6_K(xr, yr, n); break;
        }
    }
}
