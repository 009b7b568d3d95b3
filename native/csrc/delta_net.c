/* qwen35's gated delta net (linear attention with a recurrent state) for the rows of a decode
 * step, each a sequence's next token.
 *
 * delta_step_rows is the step itself, from the rows' projections to the output before ssm_out:
 * the causal conv over the sequence's last K-1 inputs and this one, SiLU, q and k L2-normed per
 * key head (q scaled by 1/sqrt(dk)), then per value head h (key head h mod Hk) the delta rule
 *     S = e^g S;  S += k ⊗ β (v − kᵀS);  o = qᵀS
 * with β = sigmoid(beta·x), g = a · softplus(alpha·x + dt), o RMS-normed per head × SiLU(gate·x).
 * The block path (arch/qwen35.py) calls it for its decode rows, and delta_layer_rows — the
 * whole layer in one call: norm, projections, this step, ssm_out, the residual, the FFN
 * (ffn_rows.c) — calls the same code, so the two give the same bits. A prompt's rows take the
 * blocks' chunked form. */
#include "kiln.h"

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ggml_l2_norm: float squares summed in double, x / max(‖x‖, eps) */
static void l2_norm_row(float *x, int n, float eps) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += (double)(x[i] * x[i]);
    float inv = 1.0f / fmaxf(sqrtf((float)s), eps);
    for (int i = 0; i < n; i++) x[i] = x[i] * inv;
}

/* one value head's delta rule over its state S (dk x dv), in place; o (dv) its output */
static void delta_head(float *S, const float *q, const float *k, const float *v, float g, float beta,
                       int dk, int dv, float *o) {
    float kv[DELTA_MAX_DV], delta[DELTA_MAX_DV];
    const float decay = expf(g);
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

/* B rows: mixed (B, C) the conv's inputs, z (B, Hv dv) the gate, bl/al (B, Hv) the beta and
 * alpha projections; st[b] row b's sequence's state, updated; conv (B, C) scratch; out (B, Hv dv).
 * Every thread of a parallel region calls it (orphaned loops). */
void delta_step_rows(const DeltaSpec *d, int B, const float *mixed, const float *z, const float *bl, const float *al,
                     const DeltaState *st, float *conv, float *out) {
    const int Hk = d->Hk, Hv = d->Hv, dk = d->dk, dv = d->dv, K = d->K, C = 2 * Hk * dk + Hv * dv;
    const float qscale = 1.0f / sqrtf((float)dk);
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        const float *in = mixed + (size_t)b * C;
        float *cs = st[b].conv, *c = conv + (size_t)b * C;
        for (int ch = 0; ch < C; ch++) {      /* the kept inputs, oldest first, then this one */
            const float *w = d->conv_w + (size_t)ch * K;
            float acc = (K > 1 ? cs[ch] : in[ch]) * w[0];
            for (int j = 1; j < K; j++) acc = acc + (j < K - 1 ? cs[(size_t)j * C + ch] : in[ch]) * w[j];
            c[ch] = acc;
        }
        silu_row(c, C);
        if (K > 1) {                          /* keep the last K-1 inputs */
            memmove(cs, cs + C, (size_t)(K - 2) * C * sizeof(float));
            memcpy(cs + (size_t)(K - 2) * C, in, (size_t)C * sizeof(float));
        }
        for (int h = 0; h < 2 * Hk; h++) l2_norm_row(c + (size_t)h * dk, dk, d->eps);
        for (int i = 0; i < Hk * dk; i++) c[i] = c[i] * qscale;
    }
    #pragma omp for schedule(static)
    for (int task = 0; task < B * Hv; task++) {
        const int b = task / Hv, h = task % Hv, kh = h % Hk;
        const float *c = conv + (size_t)b * C;
        const float beta = sigmoidf(bl[task]), x = al[task] + d->dt[h];
        const float g = (x > 20.0f ? x : log1pf(expf(x))) * d->a[h];     /* softplus, linear past 20 */
        float *o = out + (size_t)task * dv;
        delta_head(st[b].S + (size_t)h * dk * dv, c + (size_t)kh * dk, c + (size_t)(Hk + kh) * dk,
                   c + (size_t)2 * Hk * dk + (size_t)h * dv, g, beta, dk, dv, o);
        rms_row(o, d->norm, o, dv, d->eps);
        silu_gate_row(o, z + (size_t)task * dv, dv);                     /* × SiLU(gate) */
    }
}

/* B decode rows x (B, n) through a delta-net layer — attn_norm, the four projections, the step,
 * ssm_out, the residual, then L's FFN — in place, in one parallel region. The caller has checked
 * every size. */
int delta_layer_rows(const DeltaSpec *d, const LayerSpec *L, float *x, int B, const DeltaState *st, int nt) {
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
    int lrmax = 0;
    for (int i = 0; L->lora && i < B * LORA_TARGETS; i++) if (L->lora[i].a && L->lora[i].r > lrmax) lrmax = L->lora[i].r;
    float *ltmp = lrmax ? malloc((size_t)B * lrmax * sizeof(float)) : NULL;
    FfnWork fw;
    ffn_work_init(&fw, L, B, ltmp, lrmax);
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rms_row(x + (size_t)b * n, L->attn_norm, a + (size_t)b * n, n, L->eps);
            for (int p = 0; p < 4; p++) act_row(&acts[p], b, n);
        }
        for (int p = 0; p < 4; p++) rows_dot(&acts[p], B, n, types[p], &ti[p], 1, W + p, Nw + p, Ow + p);
        delta_step_rows(d, B, mixed, z, bl, al, st, conv, o);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) act_row(&ao, b, inner);
        rows_dot(&ao, B, inner, d->out_t, &to, 1, Wo, No, Oo);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xb = x + (size_t)b * n, *db = dn + (size_t)b * n;
            for (int i = 0; i < n; i++) xb[i] = xb[i] + db[i];
        }
        ffn_rows(L, &fw, x, B, &missing);
    }
    for (int p = 0; p < 4; p++) act_free(&acts[p]);
    act_free(&ao); ffn_work_free(&fw);
    free(a); free(mixed); free(z); free(bl); free(al); free(conv); free(o); free(dn); free(ltmp);
#endif
    return missing;
}
