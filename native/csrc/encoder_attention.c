/* An encoder's attention (bidirectional, one input) as llama.cpp's no-cache graph computes it with
 * flash attention off (llm_graph_context::build_attn_mha): the scores by ggml_vec_dot_f32 (the
 * queries are a permuted view, so ggml's generic product runs, never tinyBLAS), the softmax as
 * ggml_compute_forward_soft_max_f32 (scaled, its exp 8 lanes at a time as ggml_v_expf, the sums
 * in double, the tail by the C library's expf), and the values by tinyBLAS's F32 product where
 * llamafile_sgemm takes it (two or more rows, a multiple of 8 keys, head_dim a multiple of 4),
 * else ggml_vec_dot_f32. Same operands, same order: llama.cpp's float32 bits. */
#include "kiln.h"


#ifdef KILN_X86
/* ggml_vec_dot_f32 for AVX2: four 8-lane FMA accumulators over 32 at a time, reduced pairwise and
 * by two hadds; the tail multiplied, then added, in order — not contracted to an FMA (measured
 * against llama.cpp on a head_dim of 16, where the whole dot product is the tail; this file is
 * built -std=c11, so gcc contracts nothing here) */
AVX2 float vdot_ggml(const float *x, const float *y, int n) {
    const int np = n & ~31;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int i = 0; i < np; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), s3);
    }
    s0 = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    __m128 t1 = _mm_hadd_ps(t0, t0);
    float sum = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    for (int i = np; i < n; i++) sum += x[i] * y[i];
    return sum;
}

/* vdot_ggml of x0 and of x1 with y, n a multiple of 32 (no tail): the two dot products' operations
   interleaved, each in vdot_ggml's own order — the same bits, twice the work in flight */
AVX2 static void vdot2_ggml(const float *x0, const float *x1, const float *y, int n, float *out0, float *out1) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, t0 = s0, t1 = s0, t2 = s0, t3 = s0;
    for (int i = 0; i < n; i += 32) {
        const __m256 y0 = _mm256_loadu_ps(y + i), y1 = _mm256_loadu_ps(y + i + 8),
                     y2 = _mm256_loadu_ps(y + i + 16), y3 = _mm256_loadu_ps(y + i + 24);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i), y0, s0);
        t0 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i), y0, t0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 8), y1, s1);
        t1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 8), y1, t1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 16), y2, s2);
        t2 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 16), y2, t2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 24), y3, s3);
        t3 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 24), y3, t3);
    }
    s0 = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    t0 = _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1));
    a = _mm_hadd_ps(a, a);
    b = _mm_hadd_ps(b, b);
    *out0 = _mm_cvtss_f32(_mm_hadd_ps(a, a));
    *out1 = _mm_cvtss_f32(_mm_hadd_ps(b, b));
}

/* tinyBLAS<8, __m256>: one FMA chain of 8 lanes along the row, then its lanes' sum */
AVX2 static float vdot_tinyblas(const float *x, const float *y, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    return hsum_avx(acc);
}

/* four of vdot_tinyblas at once (rows r[0..3] with y): four independent FMA chains in lockstep —
   each exactly the one-row chain, so the same bits, but not waiting on one FMA's latency */
AVX2 static void vdot4_tinyblas(const float *r0, const float *r1, const float *r2, const float *r3, const float *y,
                                int n, float *out, size_t stride) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < n; i += 8) {
        const __m256 yv = _mm256_loadu_ps(y + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + i), yv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + i), yv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + i), yv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + i), yv, a3);
    }
    out[0] = hsum_avx(a0); out[stride] = hsum_avx(a1); out[2 * stride] = hsum_avx(a2); out[3 * stride] = hsum_avx(a3);
}

/* ggml_vec_cvar_f32's AVX2 loop: y = x - mean, the squares' 8 lanes summed as ((0+4)+(2+6)) +
 * ((1+5)+(3+7)) and added in double; returns where the scalar tail starts */
AVX2 static int cvar8_avx2(const float *x, float *y, int n, float mean, double *sum) {
    int i = 0;
    for (; i + 7 < n; i += 8) {
        __m256 val = _mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(mean));
        _mm256_storeu_ps(y + i, val);
        val = _mm256_mul_ps(val, val);
        __m128 v2 = _mm_add_ps(_mm256_extractf128_ps(val, 1), _mm256_castps256_ps128(val));
        v2 = _mm_add_ps(v2, _mm_movehl_ps(v2, v2));
        v2 = _mm_add_ss(v2, _mm_movehdup_ps(v2));
        *sum += (double)_mm_cvtss_f32(v2);
    }
    return i;
}

/* ggml_compute_forward_soft_max_f32 on one row, in place; slope != 0: ALiBi, the mask -|i - j|
 * (query row `row`) times the head's slope added after the scale, as ggml adds a mask; `blocks`:
 * keys of another block masked (their weights 0, still in every sum's lanes, as ggml's) */
AVX2 static void softmax_ggml(float *w, int n, float scale, float slope, int row, int window, const int *blocks) {
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        w[j] *= scale;
        if (slope != 0.0f) w[j] += slope * (float)(-abs(row - j));
        if (window > 0 && abs(row - j) > window) w[j] = -INFINITY;     /* outside a local layer's window */
        if (blocks && blocks[j] != blocks[row]) w[j] = -INFINITY;
        max = w[j] > max ? w[j] : max;
    }
    double sum = 0;
    int i = 0;
    for (; i + 7 < n; i += 8) {
        __m256 val = expf8(_mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(max)));
        _mm256_storeu_ps(w + i, val);
        __m128 v2 = _mm_add_ps(_mm256_extractf128_ps(val, 1), _mm256_castps256_ps128(val));
        v2 = _mm_add_ps(v2, _mm_movehl_ps(v2, v2));
        v2 = _mm_add_ss(v2, _mm_movehdup_ps(v2));
        sum += (double)_mm_cvtss_f32(v2);
    }
    for (; i < n; i++) {
        float v = expf(w[i] - max);
        sum += (double)v;
        w[i] = v;
    }
    const float inv = (float)(1.0 / sum);
    for (int j = 0; j < n; j++) w[j] *= inv;
}

/* q, k, v, out: (n, H*D) float32 rows; scale multiplies the scores. Returns 0 without AVX2. */
int encoder_attention(const float *q, const float *k, const float *v, float *out, int n, int H, int D,
                      float scale, int nt, const float *slopes, int window, const int *blocks) {
    if (!g_avx2 || n < 1) return 0;
    const int tiny = n >= 2 && n % 8 == 0 && D % 4 == 0;      /* llamafile_sgemm takes the values' product */
    float *vt = malloc((size_t)H * D * n * sizeof(float));    /* each head's values, a row per channel */
    for (int h = 0; h < H; h++)
        for (int c = 0; c < D; c++)
            for (int j = 0; j < n; j++) vt[((size_t)h * D + c) * n + j] = v[(size_t)j * H * D + h * D + c];
    /* blocks in runs (Qwen2.5-VL's windows) with tinyBLAS's product: a row computes only its run's
     * keys, widened to whole groups of 8 — the masked keys' weights are 0 and every sum runs in
     * 8-lane groups from key 0, so leaving them out changes no bit (a 64-patch window of 2,304) */
    int *span = blocks && tiny && !slopes && !window ? malloc(2 * (size_t)n * sizeof(int)) : NULL;
    for (int i = 0; span && i < n; ) {
        int e = i;
        while (e < n && blocks[e] == blocks[i]) e++;
        for (int r = 0; r < i && span; r++)
            if (blocks[r] == blocks[i]) { free(span); span = NULL; }       /* a block in two runs */
        for (int r = i; span && r < e; r++) { span[2 * r] = i & ~7; span[2 * r + 1] = (e + 7) & ~7; }
        i = e;
    }
    #pragma omp parallel num_threads(nt)
    {
        float *p = malloc((size_t)n * sizeof(float));
        #pragma omp for schedule(static)
        for (int task = 0; task < H * n; task++) {
            const int h = task / n, i = task % n;
            const int a = span ? span[2 * i] : 0, m = span ? span[2 * i + 1] - a : n;     /* keys a..a+m-1 */
            const float *qi = q + (size_t)i * H * D + h * D;
            float *pa = p + a;
            int j = a;
            if (D % 32 == 0)                   /* no tail: two keys at a time */
                for (; j + 1 < a + m; j += 2)
                    vdot2_ggml(k + (size_t)j * H * D + h * D, k + (size_t)(j + 1) * H * D + h * D, qi, D, p + j, p + j + 1);
            for (; j < a + m; j++) p[j] = vdot_ggml(k + (size_t)j * H * D + h * D, qi, D);
            softmax_ggml(pa, m, scale, slopes ? slopes[h] : 0.0f, i - a, window, blocks ? blocks + a : NULL);
            float *o = out + (size_t)i * H * D + h * D;
            const float *rows = vt + (size_t)h * D * n + a;
            if (tiny)                          /* D % 4 == 0 when tinyBLAS takes the product */
                for (int c = 0; c < D; c += 4)
                    vdot4_tinyblas(rows + (size_t)c * n, rows + (size_t)(c + 1) * n, rows + (size_t)(c + 2) * n,
                                   rows + (size_t)(c + 3) * n, pa, m, o + c, 1);
            else
                for (int c = 0; c < D; c++) o[c] = vdot_ggml(rows + (size_t)c * n, pa, m);
        }
        free(p);
    }
    free(span);
    free(vt);
    return 1;
}
#else
int encoder_attention(const float *q, const float *k, const float *v, float *out, int n, int H, int D,
                      float scale, int nt, const float *slopes, int window, const int *blocks) { return 0; }
#endif

/* ggml_norm's AVX2 arithmetic on T rows of n, then times w plus b (an encoder's LayerNorm): the
 * mean from a double sum rounded to float and divided in float; the variance from float squares
 * summed 8 at a time in ggml_vec_cvar_f32's lane order, in double; one float scale. */
void layer_norm_rows(const float *x, const float *w, const float *b, float *out, int T, int n, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n;
        float *y = out + (size_t)t * n;
        double s = 0;
        for (int i = 0; i < n; i++) s += (double)xr[i];
        const float mean = (float)s / (float)n;
        double sq = 0;
        int i = 0;
#ifdef KILN_X86
        if (g_avx2) i = cvar8_avx2(xr, y, n, mean, &sq);
#endif
        for (; i < n; i++) {
            float v = xr[i] - mean;
            y[i] = v;
            v *= v;
            sq += (double)v;
        }
        const float variance = (float)(sq / n);
        const float scale = 1.0f / sqrtf(variance + eps);
        for (int j = 0; j < n; j++) y[j] = (y[j] * scale) * w[j] + b[j];
    }
}

/* ggml's GELU on float32 (GGML_GELU_FP16): the fp16 table between -10 and 10, 0 below, x above;
 * `table` holds the 65,536 results as float32 (native/ggml_round.py gelu_table) */
#ifdef KILN_X86
/* the same lookup 8 at a time: F16C rounds to the fp16 index (nearest even, as fp32_to_fp16), a
 * gather reads the table; below -10 zero, from 10 up x itself */
AVX2 static size_t gelu_avx2(float *x, size_t n, const float *table) {
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        __m256 t = _mm256_i32gather_ps(table, _mm256_cvtepu16_epi32(h), 4);
        t = _mm256_blendv_ps(t, v, _mm256_cmp_ps(v, hi, _CMP_GE_OQ));
        t = _mm256_andnot_ps(_mm256_cmp_ps(v, lo, _CMP_LE_OQ), t);
        _mm256_storeu_ps(x + i, t);
    }
    return i;
}
#endif

void gelu_rows(float *x, size_t n, const float *table) {
    size_t i0 = 0;
#ifdef KILN_X86
    if (g_avx2) i0 = gelu_avx2(x, n, table);
#endif
    for (size_t i = i0; i < n; i++) {
        const float v = x[i];
        x[i] = v <= -10.0f ? 0.0f : v >= 10.0f ? v : table[fp32_to_fp16(v)];
    }
}
