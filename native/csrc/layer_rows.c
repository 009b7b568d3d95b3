/* The pieces of a decoder layer, one row at a time, in ggml's arithmetic: RMS norm, the RoPE table
 * and rotation, SwiGLU, the router's choice of experts. Used by the one-call decode (layer.c) and,
 * through the extension, by the step-by-step path. */
#include "kiln.h"

void rms_row(const float *x, const float *w, float *o, int n, float eps) {
    double sum = 0.0;                       /* double accumulation, as ggml */
    for (int i = 0; i < n; i++) sum += (double)(x[i] * x[i]);   /* float square, double sum */
    float scale = 1.0f / sqrtf((float)(sum / n) + eps);
    for (int i = 0; i < n; i++) o[i] = x[i] * scale * w[i];
}

/* cos/sin of positions [p0, p0 + n) for R/2 pairs as ggml's rope cache makes them: the angle of pair i
 * is the previous pair's times powf(base, -2/R) in float32 (from the position), then the C library's
 * cosf/sinf — glibc's, like llama.cpp's; they differ from correctly rounded values in ~2 % of
 * entries, enough to move a query or key by an ulp. */
void rope_table(int p0, int n, int half, float base, float freq_scale, const float *ff, float ext_factor,
                float corr0, float corr1, float mscale, float *c, float *s) {
    const float theta_scale = powf(base, -2.0f / (float)(2 * half));
    for (int p = 0; p < n; p++) {
        float theta = (float)(p0 + p);      /* a negative p0: a context shift's re-rope (kv_cache.py) */
        for (int i = 0; i < half; i++) {
            /* ggml's rope cache (rope_yarn): theta/ff, the linear scale, and with YaRN a ramp
             * between interpolated and extrapolated angles; the products fused as gcc fuses them */
            float extrap = theta / ff[i], t = freq_scale * extrap;
            if (ext_factor != 0.0f) {
                float y = ((float)i - corr0) / fmaxf(0.001f, corr1 - corr0);
                float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
                t = fmaf(t, 1.0f - ramp, extrap * ramp);
            }
            c[(size_t)p * half + i] = cosf(t) * mscale;
            s[(size_t)p * half + i] = sinf(t) * mscale;
            theta *= theta_scale;
        }
    }
}

void rope_row(float *x, const float *c, const float *s, int H, int D, int R, int neox) {
    int half = R / 2;                       /* the first R of each head's D dimensions rotate */
    for (int h = 0; h < H; h++) {
        float *v = x + (size_t)h * D;
        for (int i = 0; i < half; i++) {
            int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
            float a = v[i0], b = v[i1];
            /* as ggml's rotate_pairs comes out of gcc -march=native: the first product fused */
            v[i0] = fmaf(a, c[i], -(b * s[i]));
            v[i1] = fmaf(a, s[i], b * c[i]);
        }
    }
}

#ifdef KILN_X86
AVX2 static void swiglu_avx2(float *g, const float *u, size_t n) {       /* as ggml_vec_swiglu_f32 */
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), expf8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

AVX2 static double softmax_avx2(float *p, int n, float mx) {            /* as ggml_vec_soft_max_f32 */
    double sum = 0.0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = expf8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(p + i, e);
        sum += (double)hsum_avx(e);
    }
    for (; i < n; i++) { p[i] = expf(p[i] - mx); sum += (double)p[i]; }
    return sum;
}
#endif

void swiglu_row(float *g, const float *u, size_t n) {
#ifdef KILN_X86
    if (g_avx2) { swiglu_avx2(g, u, n); return; }
#endif
    for (size_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Mixture-of-experts routing of one row, as llama.cpp's build_moe_ffn: probabilities by softmax
 * over the E router logits (max subtracted, expf, the sum in double, as ggml's soft_max) or by
 * sigmoid (rr->sigmoid); the k experts chosen on them plus rr->bias (a tie goes to the lower
 * index), among the rr->groups_used best groups when rr->groups > 1 (a group's score: its two
 * best values summed); weighed by their unbiased probabilities, optionally renormalised to sum 1
 * (the sum in double, clamped at fp16's smallest normal as ggml_clamp does — never reached by a
 * softmax's top k), times rr->scale. The chosen experts come back in ascending order — the order
 * their outputs are summed in — with their weights. E <= MAX_EXPERTS, k <= E. */
void route_row(const float *logits, int E, int k, int normalize, const RouteRule *rr, int *sel, float *w) {
    float p[MAX_EXPERTS], pick[MAX_EXPERTS];
    unsigned char used[MAX_EXPERTS] = {0};
    if (rr->sigmoid) {
        for (int i = 0; i < E; i++) p[i] = 1.0f / (1.0f + expf(-logits[i]));     /* ggml_vec_sigmoid_f32 */
    } else {
        float mx = -INFINITY;
        for (int i = 0; i < E; i++) { p[i] = logits[i]; if (logits[i] > mx) mx = logits[i]; }
        double sum = 0.0;
#ifdef KILN_X86
        if (g_avx2) sum = softmax_avx2(p, E, mx);
        else
#endif
        for (int i = 0; i < E; i++) { p[i] = expf(p[i] - mx); sum += p[i]; }
        float inv = (float)(1.0 / sum);
        for (int i = 0; i < E; i++) p[i] *= inv;
    }
    for (int i = 0; i < E; i++) pick[i] = rr->bias ? p[i] + rr->bias[i] : p[i];
    if (rr->groups > 1) {                       /* the groups' scores; the others' experts out of reach */
        int G = rr->groups, per = E / G;
        float score[MAX_EXPERTS];
        unsigned char keep[MAX_EXPERTS] = {0};
        for (int g = 0; g < G; g++) {
            float b0 = -INFINITY, b1 = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; i++)
                if (pick[i] > b0) { b1 = b0; b0 = pick[i]; } else if (pick[i] > b1) b1 = pick[i];
            score[g] = b0 + b1;
        }
        for (int j = 0; j < rr->groups_used; j++) {
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || score[g] > score[best])) best = g;
            keep[best] = 1;
        }
        for (int i = 0; i < E; i++) if (!keep[i / per]) pick[i] = -INFINITY;
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < E; i++)
            if (!used[i] && (best < 0 || pick[i] > pick[best])) best = i;
        used[best] = 1; sel[j] = best; w[j] = p[best];
    }
    if (normalize) {                            /* ggml: sum_rows (double, rounded), clamp, then div */
        double s = 0.0;
        for (int j = 0; j < k; j++) s += (double)w[j];
        float fs = (float)s;
        if (fs < 6.103515625e-5f) fs = 6.103515625e-5f;
        for (int j = 0; j < k; j++) w[j] = w[j] / fs;
    }
    if (rr->scale != 0.0f && rr->scale != 1.0f)
        for (int j = 0; j < k; j++) w[j] = w[j] * rr->scale;
    for (int j = 1; j < k; j++)                 /* ascending expert id, weights alongside */
        for (int m = j; m > 0 && sel[m - 1] > sel[m]; m--) {
            int ts = sel[m]; sel[m] = sel[m - 1]; sel[m - 1] = ts;
            float tw = w[m]; w[m] = w[m - 1]; w[m - 1] = tw;
        }
}

/* The routed FFN of row f (normed, as ag's row and ar) added to x: called by every thread of the
 * region (orphaned worksharing), one row at a time — each row has its own experts. */

/* The gates' sigmoid, 1 / (1 + e^-x), e^-x by expf8 (ggml's vector expf) for every element — a
 * short tail through a padded vector — so a value's result never depends on where it sits in
 * its row or batch: the blocks (through the extension) and the one-call decode agree. Without
 * AVX2, the C library's expf (the one-call decode needs AVX2). */
#ifdef KILN_X86
AVX2 static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.f);
    return _mm256_div_ps(one, _mm256_add_ps(one, expf8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
/* op 0: x = sigmoid(x); 1: x = x * sigmoid(g); 2: x = x * sigmoid(x) (SiLU); 3: x = x * (g * sigmoid(g)) */
AVX2 static inline __m256 gate8(__m256 xv, __m256 gv, int op) {
    return op == 0 ? sigmoid8(xv) : op == 1 ? _mm256_mul_ps(xv, sigmoid8(gv)) : op == 2 ? _mm256_mul_ps(xv, sigmoid8(xv))
                   : _mm256_mul_ps(xv, _mm256_mul_ps(gv, sigmoid8(gv)));
}
AVX2 static void gate_avx2(float *x, const float *g, size_t n, int op) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, gate8(_mm256_loadu_ps(x + i), g ? _mm256_loadu_ps(g + i) : _mm256_setzero_ps(), op));
    if (i < n) {                              /* the tail, padded: the same lanes' arithmetic */
        float xt[8] = {0}, gt[8] = {0};
        memcpy(xt, x + i, (n - i) * 4);
        if (g) memcpy(gt, g + i, (n - i) * 4);
        _mm256_storeu_ps(xt, gate8(_mm256_loadu_ps(xt), _mm256_loadu_ps(gt), op));
        memcpy(x + i, xt, (n - i) * 4);
    }
}
#endif
static float sigmoid1(float x) { return 1.0f / (1.0f + expf(-x)); }
static void gate_rows(float *x, const float *g, size_t n, int op) {
#ifdef KILN_X86
    if (g_avx2) { gate_avx2(x, g, n, op); return; }
#endif
    for (size_t i = 0; i < n; i++)
        x[i] = op == 0 ? sigmoid1(x[i]) : op == 1 ? x[i] * sigmoid1(g[i]) : op == 2 ? x[i] * sigmoid1(x[i])
                                         : x[i] * (g[i] * sigmoid1(g[i]));
}
void sigmoid_row(float *x, size_t n) { gate_rows(x, NULL, n, 0); }
void sigmoid_mul_row(float *x, const float *g, int n) { gate_rows(x, g, (size_t)n, 1); }
void silu_row(float *x, int n) { gate_rows(x, NULL, (size_t)n, 2); }
void silu_gate_row(float *x, const float *g, int n) { gate_rows(x, g, (size_t)n, 3); }
