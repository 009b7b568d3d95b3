/* A layer's FFN for the B rows of a decode step, inside the one call's parallel region (layer.c
 * after the attention, delta_net.c after the delta net): the FFN norm, a dense SwiGLU (or GELU)
 * FFN or the routed experts, the residual add — the step-by-step path's operations in its order. */
#include "kiln.h"

#ifdef KILN_X86
static void route_one(const LayerSpec *L, const Act *ar, float *logits, int *sel, float *wsel) {
    static const TypeInfo tr = {1, 4, A_F32};
    const uint8_t *Wr[1] = {(const uint8_t *)L->router};
    int Nr[1] = {L->E};
    float *Or[1] = {logits};
    rows_dot(ar, 1, L->n, T_F32, &tr, 1, Wr, Nr, Or);
    #pragma omp single
    route_row(logits, L->E, L->k, L->normalize, &L->route, sel, wsel);
}

/* shared: the row's gated shared-expert output (n), added to the experts' sum before the residual; NULL: none */
static void moe_row(const LayerSpec *L, float *x, const Act *ar, const Act *ag, Act *ad, float *logits,
                    float *g, float *u, float *dn, const TypeInfo *tg, const TypeInfo *td, int *sel, float *wsel,
                    int routed, const float *shared) {
    int n = L->n, n_ff = L->n_ff, k = L->k;
    size_t gu_row = (size_t)(n / tg->block) * tg->bytes, d_row = (size_t)(n_ff / td->block) * td->bytes;
    const uint8_t *Wgu[2 * MAX_K];
    int Ngu[2 * MAX_K];
    float *Ogu[2 * MAX_K];
    if (!routed) route_one(L, ar, logits, sel, wsel);
    const uint64_t *xt = L->xtab;             /* streamed: each expert where its cache slot is */
    for (int j = 0; j < k; j++) {             /* every thread builds the same lists */
        Wgu[2 * j] = xt ? (const uint8_t *)(uintptr_t)xt[3 * sel[j]] : L->wg + (size_t)sel[j] * n_ff * gu_row;
        Wgu[2 * j + 1] = xt ? (const uint8_t *)(uintptr_t)xt[3 * sel[j] + 1] : L->wu + (size_t)sel[j] * n_ff * gu_row;
        Ngu[2 * j] = Ngu[2 * j + 1] = n_ff;
        Ogu[2 * j] = g + (size_t)j * n_ff; Ogu[2 * j + 1] = u + (size_t)j * n_ff;
    }
    rows_dot(ag, 1, n, L->gu_t, tg, 2 * k, Wgu, Ngu, Ogu);
    #pragma omp single
    for (int j = 0; j < k; j++) {
        swiglu_row(g + (size_t)j * n_ff, u + (size_t)j * n_ff, n_ff);
        act_row(ad, j, n_ff);
    }
    #pragma omp for schedule(static)          /* every chosen expert's down rows, one task each */
    for (int r = 0; r < k * n; r++) {
        int j = r / n, i = r % n;
        const uint8_t *wd = xt ? (const uint8_t *)(uintptr_t)xt[3 * sel[j] + 2] + (size_t)i * d_row
                               : L->wd + ((size_t)sel[j] * n + i) * d_row;
        dn[r] = dot_row(L->wd_t, td, wd, ad, j, n_ff);
    }
    #pragma omp single
    for (int i = 0; i < n; i++) {
        float acc = 0.f;                      /* the step path's zeros, += weight * expert out, in order */
        for (int j = 0; j < k; j++) acc = acc + wsel[j] * dn[(size_t)j * n + i];
        if (shared) acc = acc + shared[i];
        x[i] = x[i] + acc;
    }
}

/* The shared expert of B rows (their FFN inputs quantized in w->ash, w->ar): its SwiGLU, times
 * sigmoid(sh_gate · x) when gated, into w->shd — as the blocks' SharedExpertMoE (gated) or
 * ErnieMoE/DeepSeekMoE (not), whose product they add to the routed experts' sum. Every thread calls it. */
AVX2 static void shared_expert_rows(const LayerSpec *L, FfnWork *w, int B) {
    static const TypeInfo tf = {1, 4, A_F32};
    int n = L->n, m = L->sh_ff, one = 1;
    const uint8_t *Wgu[2] = {L->sh_g, L->sh_u}, *Wd[1] = {L->sh_d}, *Wl[1] = {(const uint8_t *)L->sh_gate};
    int Ngu[2] = {m, m};
    float *Ogu[2] = {w->shg, w->shu}, *Od[1] = {w->shd}, *Ol[1] = {w->shl};
    rows_dot(&w->ash, B, n, L->sh_gu_t, &w->tsh, 2, Wgu, Ngu, Ogu);
    if (L->sh_gate) rows_dot(&w->ar, B, n, T_F32, &tf, 1, Wl, &one, Ol);
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) { swiglu_row(w->shg + (size_t)b * m, w->shu + (size_t)b * m, m); act_row(&w->ashd, b, m); }
    rows_dot(&w->ashd, B, m, L->sh_d_t, &w->tshd, 1, Wd, &n, Od);
    if (!L->sh_gate) return;
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        float s = w->shl[b], *o = w->shd + (size_t)b * n;
        sigmoid_row(&s, 1);
        for (int i = 0; i < n; i++) o[i] = s * o[i];
    }
}

/* The FFN's buffers for B rows; ltmp/lrmax: the caller's room for the adapters' A x. */
void ffn_work_init(FfnWork *w, const LayerSpec *L, int B) {
    static const TypeInfo tf = {1, 4, A_F32};
    int n = L->n, n_ff = L->n_ff, moe = L->ffn == FFN_MOE;
    int fr = moe ? L->k : B;                  /* FFN rows held at once: a row's experts, or the batch */
    memset(w, 0, sizeof *w);
    w->tg = w->td = tf;
    for (int i = 0; L->lora && i < B * LORA_TARGETS; i++)
        if (L->lora[i].a && L->lora[i].r > w->lrmax) w->lrmax = L->lora[i].r;
    if (w->lrmax) w->ltmp = malloc((size_t)B * LORA_TARGETS * w->lrmax * sizeof(float));
    if (!L->ffn) return;
    type_info(L->gu_t, &w->tg); type_info(L->wd_t, &w->td);
    w->f = malloc((size_t)B * n * 4); w->g = malloc((size_t)n_ff * fr * 4); w->u = malloc((size_t)n_ff * fr * 4);
    w->dn = malloc((size_t)n * (moe ? L->k : B) * 4); w->logits = malloc((size_t)(moe ? L->E : 1) * 4);
    w->wsel = malloc((size_t)B * MAX_K * 4); w->sel = malloc((size_t)B * MAX_K * sizeof(int));
    act_alloc(&w->ag, &w->tg, w->f, B, n); act_alloc(&w->ad, &w->td, w->g, fr, n_ff); act_alloc(&w->ar, &tf, w->f, B, n);
    if (L->sh_g) {
        type_info(L->sh_gu_t, &w->tsh); type_info(L->sh_d_t, &w->tshd);
        w->shg = malloc((size_t)B * L->sh_ff * 4); w->shu = malloc((size_t)B * L->sh_ff * 4);
        w->shd = malloc((size_t)B * n * 4); w->shl = malloc((size_t)B * 4);
        act_alloc(&w->ash, &w->tsh, w->f, B, n); act_alloc(&w->ashd, &w->tshd, w->shg, B, L->sh_ff);
    }
}

void ffn_work_free(FfnWork *w) {
    if (w->f) { act_free(&w->ag); act_free(&w->ad); act_free(&w->ar); }
    if (w->shg) { act_free(&w->ash); act_free(&w->ashd); }
    free(w->shg); free(w->shu); free(w->shd); free(w->shl);
    free(w->f); free(w->g); free(w->u); free(w->dn); free(w->logits); free(w->wsel); free(w->sel); free(w->ltmp);
}

#ifdef KILN_X86
void residual_rows(float *x, const float *d, int B, int n) {
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        float *xb = x + (size_t)b * n;
        const float *db = d + (size_t)b * n;
        for (int i = 0; i < n; i++) xb[i] = xb[i] + db[i];
    }
}
#endif

/* x (B, n): the residual after the layer's mixer; through the FFN and added, in place. Every
 * thread of the region calls it. Streamed experts (L->xtab) of which a chosen one is not
 * resident: *missing set, the FFN left to the caller (x as it came). */
AVX2 void ffn_rows(const LayerSpec *L, FfnWork *w, float *x, int B, int *missing) {
    int n = L->n, n_ff = L->n_ff, moe = L->ffn == FFN_MOE;
    float *f = w->f, *g = w->g, *u = w->u, *dn = w->dn;
    if (!L->ffn) return;
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        rms_row(x + (size_t)b * n, L->ffn_norm, f + (size_t)b * n, n, L->eps); act_row(&w->ag, b, n);
        if (L->sh_g) { act_row(&w->ash, b, n); act_row(&w->ar, b, n); }
    }
    if (L->ffn == FFN_DENSE) {
        const uint8_t *Wgu[2] = {L->wg, L->wu}, *Wd[1] = {L->wd};
        int Ngu[2] = {n_ff, n_ff}, Nd[1] = {n};
        float *Ogu[2] = {g, u}, *Od[1] = {dn};
        static const int GU[2] = {LORA_GATE, LORA_UP}, D[1] = {LORA_DOWN};
        PfQueue *pf = L->lora ? pf_mine() : NULL;    /* the adapters' rows fetched during the products (layer.c) */
        if (L->lora) { lora_a(L, GU, 2, f, n, B, w->ltmp, w->lrmax); pf_due(pf, PF_GU); }
        rows_dot(&w->ag, B, n, L->gu_t, &w->tg, 2, Wgu, Ngu, Ogu);
        if (L->lora) lora_b(L, GU, 2, Ogu, Ngu, B, w->ltmp, w->lrmax);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *gb = g + (size_t)b * n_ff, *ub = u + (size_t)b * n_ff;
            if (L->gelu_table) {          /* ggml_geglu_split: gelu(g) * u */
                gelu_rows(gb, (size_t)n_ff, L->gelu_table);
                for (int i = 0; i < n_ff; i++) gb[i] = gb[i] * ub[i];
            } else swiglu_row(gb, ub, n_ff);
            act_row(&w->ad, b, n_ff);
        }
        if (L->lora) { lora_a(L, D, 1, g, n_ff, B, w->ltmp, w->lrmax); pf_due(pf, PF_D); }
        rows_dot(&w->ad, B, n_ff, L->wd_t, &w->td, 1, Wd, Nd, Od);
        if (L->lora) lora_b(L, D, 1, Od, Nd, B, w->ltmp, w->lrmax);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xb = x + (size_t)b * n, *db = dn + (size_t)b * n;
            if (L->post_ffn_norm) rms_row(db, L->post_ffn_norm, db, n, L->eps);
            for (int i = 0; i < n; i++) xb[i] = xb[i] + db[i];
        }
    } else if (moe && L->xtab) {
        /* streamed experts: route every row first; if a chosen expert is not resident, leave
           the FFN to the caller (x holds the mixer's residual, as FFN_NONE leaves it) */
        for (int b = 0; b < B; b++) {
            Act arb = act_view(&w->ar, b, n);
            route_one(L, &arb, w->logits, w->sel + (size_t)b * L->k, w->wsel + (size_t)b * L->k);
        }
        #pragma omp single
        for (int r = 0; r < B * L->k; r++) {
            if (L->chosen) L->chosen[r] = w->sel[r];
            if (L->chosen_w) L->chosen_w[r] = w->wsel[r];
            if (!L->xtab[3 * w->sel[r]]) *missing = 1;
        }
        if (!*missing)
            for (int b = 0; b < B; b++) {
                Act arb = act_view(&w->ar, b, n), agb = act_view(&w->ag, b, n);
                moe_row(L, x + (size_t)b * n, &arb, &agb, &w->ad, w->logits, g, u, dn, &w->tg, &w->td,
                        w->sel + (size_t)b * L->k, w->wsel + (size_t)b * L->k, 1, NULL);
            }
    } else {
        if (L->sh_g) shared_expert_rows(L, w, B);
        for (int b = 0; b < B; b++) {
            Act arb = act_view(&w->ar, b, n), agb = act_view(&w->ag, b, n);
            if (L->router_b) moe_oai_row(L, x + (size_t)b * n, &arb, &agb, &w->ad, w->logits, g, u, dn, &w->tg, &w->td);
            else moe_row(L, x + (size_t)b * n, &arb, &agb, &w->ad, w->logits, g, u, dn, &w->tg, &w->td, w->sel, w->wsel, 0,
                         L->sh_g ? w->shd + (size_t)b * n : NULL);
        }
    }
}
#endif
