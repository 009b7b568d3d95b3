/* qwen35's gated delta net (linear attention with a recurrent state) for runs of a sequence's
 * tokens: a decode step's one, or a prompt's.
 *
 * delta_rows is the net from the rows' projections to the output before ssm_out: the causal
 * conv over the sequence's last K-1 inputs and the run's, SiLU, q and k L2-normed per key head
 * (q scaled by 1/sqrt(dk)), then per value head h (key head h mod Hk), token after token, the
 * delta rule
 *     S = e^g S;  S += k ⊗ β (v − kᵀS);  o = qᵀS
 * with β = sigmoid(beta·x), g = a · softplus(alpha·x + dt), o RMS-normed per head × SiLU(gate·x).
 * The recurrence, not llama.cpp's chunked solve: the same values to rounding, and a prompt's bits
 * those of the same tokens decoded one by one. The block path (arch/qwen35.py) calls it, and so
 * does delta_layer_rows — a decode step's whole layer in one call: norm, projections, this,
 * ssm_out, the residual, the FFN (ffn_rows.c) — so the two give the same bits. */
#include "kiln.h"

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ggml_l2_norm: float squares summed in double, x / max(‖x‖, eps) */
static void l2_norm_row(float *x, int n, float eps) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += (double)(x[i] * x[i]);
    float inv = 1.0f / fmaxf(sqrtf((float)s), eps);
    for (int i = 0; i < n; i++) x[i] = x[i] * inv;
}

/* one value head's delta rule over its state S (dk x dv), in place; o (dv) its output. Each
 * value is a product then a sum, never fused, on either path: the AVX2 one is the portable one's
 * arithmetic 8 columns at a time (the same bits), its sums over i held in registers. */
static void delta_head_c(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                         int dk, int dv, float *o) {
    float kv[DELTA_MAX_DV], delta[DELTA_MAX_DV];
    for (int j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int i = 0; i < dk; i++) {            /* S decays; kᵀS of the decayed state */
        float *s = S + (size_t)i * dv, ki = k[i];
        for (int j = 0; j < dv; j++) { s[j] = s[j] * decay; kv[j] = kv[j] + ki * s[j]; }
    }
    for (int j = 0; j < dv; j++) { delta[j] = (v[j] - kv[j]) * beta; o[j] = 0.0f; }
    for (int i = 0; i < dk; i++) {            /* the correction, then qᵀS of the new state */
        float *s = S + (size_t)i * dv, ki = k[i], qi = q[i];
        for (int j = 0; j < dv; j++) { s[j] = s[j] + ki * delta[j]; o[j] = o[j] + qi * s[j]; }
    }
}

/* the decay and beta of head h at row t */
static inline void gates(const DeltaSpec *d, const float *bl, const float *al, int t, int h, float *decay, float *beta) {
    const int Hv = d->Hv;
    const float x = al[(size_t)t * Hv + h] + d->dt[h];
    *beta = sigmoidf(bl[(size_t)t * Hv + h]);
    *decay = expf((x > 20.0f ? x : log1pf(expf(x))) * d->a[h]);     /* e^(a softplus(x)), softplus linear past 20 */
}

/* the run's output row of head h, normed and gated */
static inline void finish(const DeltaSpec *d, const float *z, int t, int h, float *o) {
    rms_row(o, d->norm, o, d->dv, d->eps);
    silu_gate_row(o, z + ((size_t)t * d->Hv + h) * d->dv, d->dv);    /* × SiLU(gate) */
}

#ifdef KILN_X86
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#define LD _mm256_loadu_ps
#define ST _mm256_storeu_ps
/* Head h through the run's tokens, delta_head_c's arithmetic 32 columns at a time, its sums over i
 * in registers — and one pass over S per token, not two: the correction of token t, its qᵀS, and
 * token t+1's decay and kᵀS of the decayed state, each value as the two passes make it. */
AVX2 static void delta_run_avx2(const DeltaSpec *d, const DeltaSeg *g, int h, const float *conv, const float *bl,
                                const float *al, const float *z, float *out) {
    const int Hk = d->Hk, Hv = d->Hv, dk = d->dk, dv = d->dv, C = 2 * Hk * dk + Hv * dv, kh = h % Hk;
    const size_t qo = (size_t)kh * dk, ko = (size_t)(Hk + kh) * dk, vo = (size_t)2 * Hk * dk + (size_t)h * dv;
    float *S = g->S + (size_t)h * dk * dv, kv[DELTA_MAX_DV], delta[DELTA_MAX_DV], decay, beta;
    const int end = g->start + g->len;
    gates(d, bl, al, g->start, h, &decay, &beta);
    const float *k = conv + (size_t)g->start * C + ko;
    for (int j0 = 0; j0 < dv; j0 += 32) {     /* the first token's decay and kᵀS */
        const __m256 dec = _mm256_set1_ps(decay);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < dk; i++) {
            float *s = S + (size_t)i * dv + j0;
            const __m256 ki = _mm256_set1_ps(k[i]);
            __m256 s0 = MUL(LD(s), dec), s1 = MUL(LD(s + 8), dec), s2 = MUL(LD(s + 16), dec), s3 = MUL(LD(s + 24), dec);
            ST(s, s0); ST(s + 8, s1); ST(s + 16, s2); ST(s + 24, s3);
            a0 = ADD(a0, MUL(ki, s0)); a1 = ADD(a1, MUL(ki, s1)); a2 = ADD(a2, MUL(ki, s2)); a3 = ADD(a3, MUL(ki, s3));
        }
        ST(kv + j0, a0); ST(kv + j0 + 8, a1); ST(kv + j0 + 16, a2); ST(kv + j0 + 24, a3);
    }
    for (int t = g->start; t < end; t++) {
        const float *row = conv + (size_t)t * C, *q = row + qo, *v = row + vo;
        float *o = out + ((size_t)t * Hv + h) * dv, next_decay = 0.f, next_beta = 0.f;
        k = row + ko;
        for (int j = 0; j < dv; j++) delta[j] = (v[j] - kv[j]) * beta;
        const int more = t + 1 < end;
        const float *kn = more ? conv + (size_t)(t + 1) * C + ko : k;
        if (more) gates(d, bl, al, t + 1, h, &next_decay, &next_beta);
        const __m256 dec = _mm256_set1_ps(next_decay);
        for (int j0 = 0; j0 < dv; j0 += 32) {
            const __m256 d0 = LD(delta + j0), d1 = LD(delta + j0 + 8), d2 = LD(delta + j0 + 16), d3 = LD(delta + j0 + 24);
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, n0 = o0, n1 = o0, n2 = o0, n3 = o0;
            for (int i = 0; i < dk; i++) {
                float *s = S + (size_t)i * dv + j0;
                const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
                __m256 s0 = ADD(LD(s), MUL(ki, d0)), s1 = ADD(LD(s + 8), MUL(ki, d1)),
                       s2 = ADD(LD(s + 16), MUL(ki, d2)), s3 = ADD(LD(s + 24), MUL(ki, d3));
                o0 = ADD(o0, MUL(qi, s0)); o1 = ADD(o1, MUL(qi, s1)); o2 = ADD(o2, MUL(qi, s2)); o3 = ADD(o3, MUL(qi, s3));
                if (more) {                   /* the next token's decay and kᵀS, while S is here */
                    const __m256 kn_i = _mm256_set1_ps(kn[i]);
                    s0 = MUL(s0, dec); s1 = MUL(s1, dec); s2 = MUL(s2, dec); s3 = MUL(s3, dec);
                    n0 = ADD(n0, MUL(kn_i, s0)); n1 = ADD(n1, MUL(kn_i, s1)); n2 = ADD(n2, MUL(kn_i, s2)); n3 = ADD(n3, MUL(kn_i, s3));
                }
                ST(s, s0); ST(s + 8, s1); ST(s + 16, s2); ST(s + 24, s3);
            }
            ST(o + j0, o0); ST(o + j0 + 8, o1); ST(o + j0 + 16, o2); ST(o + j0 + 24, o3);
            ST(kv + j0, n0); ST(kv + j0 + 8, n1); ST(kv + j0 + 16, n2); ST(kv + j0 + 24, n3);
        }
        finish(d, z, t, h, o);
        beta = next_beta;
    }
}
#undef MUL
#undef ADD
#undef LD
#undef ST
#endif

/* Segments of rows, each a run of one sequence's next tokens (sg[s]: rows start..start+len-1 and
 * its state): mixed (R, C) the conv's inputs, z (R, Hv dv) the gate, bl/al (R, Hv) the beta and
 * alpha projections; conv (R, C) scratch; out (R, Hv dv). Token after token, the recurrence — a
 * prompt's rows as a decode step's, so a sequence's bits do not depend on how its tokens came.
 * Every thread of a parallel region calls it (orphaned loops). */
void delta_rows(const DeltaSpec *d, int nseg, const DeltaSeg *sg, int R, const float *mixed, const float *z,
                const float *bl, const float *al, float *conv, float *out) {
    const int Hk = d->Hk, Hv = d->Hv, dk = d->dk, dv = d->dv, K = d->K, C = 2 * Hk * dk + Hv * dv;
    const int cb = (C + 63) / 64;             /* channels in blocks of 64 per task */
    const float qscale = 1.0f / sqrtf((float)dk);
    #pragma omp for schedule(static)
    for (int task = 0; task < nseg * cb; task++) {
        const DeltaSeg *g = &sg[task / cb];
        const int c0 = 64 * (task % cb), c1 = c0 + 64 < C ? c0 + 64 : C;
        const int m = c1 - c0;
        float wt[64 * 64];                    /* the block's weights tap-major: a tap's 64 channels in a row */
        for (int c = 0; c < m; c++) for (int j = 0; j < K; j++) wt[j * 64 + c] = d->conv_w[(size_t)(c0 + c) * K + j];
        for (int t = 0; t < g->len; t++) {    /* the causal conv: the kept inputs, oldest first, then the run's */
            float *o = conv + (size_t)(g->start + t) * C + c0;
            for (int j = 0; j < K; j++) {
                const int u = t - (K - 1) + j;
                const float *in = (u < 0 ? g->conv + (size_t)(K - 1 + u) * C : mixed + (size_t)(g->start + u) * C) + c0;
                const float *w = wt + j * 64;
                if (j == 0) for (int c = 0; c < m; c++) o[c] = in[c] * w[c];
                else for (int c = 0; c < m; c++) o[c] = o[c] + in[c] * w[c];
            }
        }
        for (int r = 0; r < K - 1; r++) {     /* keep the last K-1 inputs (row r + len read before written) */
            const int u = r + g->len;
            const float *src = u < K - 1 ? g->conv + (size_t)u * C : mixed + (size_t)(g->start + u - (K - 1)) * C;
            memmove(g->conv + (size_t)r * C + c0, src + c0, (size_t)m * sizeof(float));
        }
    }
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        float *c = conv + (size_t)r * C;
        silu_row(c, C);
        for (int h = 0; h < 2 * Hk; h++) l2_norm_row(c + (size_t)h * dk, dk, d->eps);
        for (int i = 0; i < Hk * dk; i++) c[i] = c[i] * qscale;
    }
    #pragma omp for schedule(static)
    for (int task = 0; task < nseg * Hv; task++) {
        const DeltaSeg *g = &sg[task / Hv];
        const int h = task % Hv, kh = h % Hk;
#ifdef KILN_X86
        if (g_avx2 && dv % 32 == 0) { delta_run_avx2(d, g, h, conv, bl, al, z, out); continue; }
#endif
        for (int t = g->start; t < g->start + g->len; t++) {
            const float *c = conv + (size_t)t * C;
            float decay, beta, *o = out + ((size_t)t * Hv + h) * dv;
            gates(d, bl, al, t, h, &decay, &beta);
            delta_head_c(g->S + (size_t)h * dk * dv, c + (size_t)kh * dk, c + (size_t)(Hk + kh) * dk,
                         c + (size_t)2 * Hk * dk + (size_t)h * dv, decay, beta, dk, dv, o);
            finish(d, z, t, h, o);
        }
    }
}

/* B decode rows x (B, n) through a delta-net layer — attn_norm, the four projections, the step,
 * ssm_out, the residual, then L's FFN — in place, in one parallel region. The caller has checked
 * every size. */
int delta_layer_rows(const DeltaSpec *d, const LayerSpec *L, float *x, int B, const DeltaSeg *sg, int nt) {
    int missing = 0;
#ifdef KILN_X86
    const int n = L->n, Hv = d->Hv, C = 2 * d->Hk * d->dk + Hv * d->dv, inner = Hv * d->dv;
    const uint8_t *W[4] = {d->wqkv, d->wgate, d->wbeta, d->walpha}, *Wo[1] = {d->wout};
    const int types[4] = {d->qkv_t, d->gate_t, d->beta_t, d->alpha_t}, Nw[4] = {C, inner, Hv, Hv}, No[1] = {n};
    float *a = malloc((size_t)B * n * 4), *mixed = malloc((size_t)B * C * 4), *z = malloc((size_t)B * inner * 4),
          *bl = malloc((size_t)B * Hv * 4), *al = malloc((size_t)B * Hv * 4), *conv = malloc((size_t)B * C * 4),
          *o = malloc((size_t)B * inner * 4), *dn = malloc((size_t)B * n * 4);
    float *Ow[4] = {mixed, z, bl, al}, *Oo[1] = {dn};
    TypeInfo ti[4], to;
    Act acts[4], ao;
    for (int p = 0; p < 4; p++) { type_info(types[p], &ti[p]); act_alloc(&acts[p], &ti[p], a, B, n); }
    type_info(d->out_t, &to); act_alloc(&ao, &to, o, B, inner);
    FfnWork fw;
    ffn_work_init(&fw, L, B);
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rms_row(x + (size_t)b * n, L->attn_norm, a + (size_t)b * n, n, L->eps);
            for (int p = 0; p < 4; p++) act_row(&acts[p], b, n);
        }
        for (int p = 0; p < 4; p++) rows_dot(&acts[p], B, n, types[p], &ti[p], 1, W + p, Nw + p, Ow + p);
        delta_rows(d, B, sg, B, mixed, z, bl, al, conv, o);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) act_row(&ao, b, inner);
        rows_dot(&ao, B, inner, d->out_t, &to, 1, Wo, No, Oo);
        residual_rows(x, dn, B, n);
        ffn_rows(L, &fw, x, B, &missing);
    }
    for (int p = 0; p < 4; p++) act_free(&acts[p]);
    act_free(&ao); ffn_work_free(&fw);
    free(a); free(mixed); free(z); free(bl); free(al); free(conv); free(o); free(dn);
#endif
    return missing;
}
