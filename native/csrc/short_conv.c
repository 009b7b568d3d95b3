/* LFM2's gated short convolution (arch/lfm2.py ShortConv) for the B rows of a decode step, the
 * whole layer in one call: attn_norm, in_proj (B | C | x), B·x through the causal depthwise
 * conv over each sequence's last K-1 inputs (its state, then shifted), C·conv, out_proj, the
 * residual, then the layer's FFN (ffn_rows.c) — the blocks' operations in their order, so the
 * two give the same bits. */
#include "kiln.h"

/* ggml_ssm_conv as the blocks compute it: the first tap a float product, each later one the
 * product exact in double plus the sum, rounded once to float */
static inline float conv_channel(const float *st, float bx, const float *w, int K, int E, int c) {
    float acc = (K > 1 ? st[c] : bx) * w[0];
    for (int j = 1; j < K; j++) {
        const float in = j < K - 1 ? st[(size_t)j * E + c] : bx;
        acc = (float)((double)in * (double)w[j] + (double)acc);
    }
    return acc;
}

/* B decode rows x (B, n) through the conv layer and L's FFN, in place; st[b]: row b's state
 * (K-1, n), updated. The caller has checked every size. */
int conv_layer_rows(const ConvSpec *s, const LayerSpec *L, float *x, int B, float *const *st, int nt) {
    int missing = 0;
#ifdef KILN_X86
    const int n = L->n, K = s->K;
    const uint8_t *Wi[1] = {s->w_in}, *Wo[1] = {s->w_out};
    const int Ni[1] = {3 * n}, No[1] = {n};
    float *a = malloc((size_t)B * n * 4), *bcx = malloc((size_t)B * 3 * n * 4), *y = malloc((size_t)B * n * 4),
          *dn = malloc((size_t)B * n * 4);
    float *Oi[1] = {bcx}, *Oo[1] = {dn};
    TypeInfo ti, to;
    Act ai, ao;
    type_info(s->in_t, &ti); act_alloc(&ai, &ti, a, B, n);
    type_info(s->out_t, &to); act_alloc(&ao, &to, y, B, n);
    FfnWork fw;
    ffn_work_init(&fw, L, B);
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rms_row(x + (size_t)b * n, L->attn_norm, a + (size_t)b * n, n, L->eps);
            act_row(&ai, b, n);
        }
        rows_dot(&ai, B, n, s->in_t, &ti, 1, Wi, Ni, Oi);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {         /* the conv, the gate, the state's shift: a row's own */
            const float *r = bcx + (size_t)b * 3 * n;
            float *sb = st[b], *yb = y + (size_t)b * n;
            for (int c = 0; c < n; c++) {
                const float bx = r[c] * r[2 * n + c];
                yb[c] = r[n + c] * conv_channel(sb, bx, s->conv_w + (size_t)c * K, K, n, c);
                for (int j = 0; j + 1 < K - 1; j++) sb[(size_t)j * n + c] = sb[(size_t)(j + 1) * n + c];
                if (K > 1) sb[(size_t)(K - 2) * n + c] = bx;
            }
            act_row(&ao, b, n);
        }
        rows_dot(&ao, B, n, s->out_t, &to, 1, Wo, No, Oo);
        residual_rows(x, dn, B, n);
        ffn_rows(L, &fw, x, B, &missing);
    }
    act_free(&ai); act_free(&ao); ffn_work_free(&fw);
    free(a); free(bcx); free(y); free(dn);
#endif
    return missing;
}
