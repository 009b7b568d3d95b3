/* The one-call decode of a layer for B sequences (its pieces, row by row: layer_rows.c).
 *
 * decode_layer_rows runs the same operations, in the same order, as the step-by-step path
 * (rms_norm, matmul_many, rope, KV store, attention, matmul, swiglu; for a routed FFN: route and
 * each chosen expert's SwiGLU, summed in ascending expert order), so every row is bit-identical
 * to it — and so to that sequence run alone — but in one parallel region instead of dozens of
 * Python calls and regions per layer. */
#include "kiln.h"

/* positions from which a decode step whose heads do not divide among the threads splits each
 * head's attention between them (below, three more barriers cost more than the imbalance) */
#define SPLIT_ATTENTION_FROM 256

static void route_one(const LayerSpec *L, const Act *ar, float *logits, int *sel, float *wsel) {
    static const TypeInfo tr = {1, 4, A_F32};
    const uint8_t *Wr[1] = {(const uint8_t *)L->router};
    int Nr[1] = {L->E};
    float *Or[1] = {logits};
    rows_dot(ar, 1, L->n, T_F32, &tr, 1, Wr, Nr, Or);
    #pragma omp single
    route_row(logits, L->E, L->k, L->normalize, sel, wsel);
}

static void moe_row(const LayerSpec *L, float *x, const Act *ar, const Act *ag, Act *ad, float *logits,
                    float *g, float *u, float *dn, const TypeInfo *tg, const TypeInfo *td, int *sel, float *wsel,
                    int routed) {
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
        x[i] = x[i] + acc;
    }
}

/* B decode rows x (B, n), row b of sequence rows[b], through layer L, in place. The caller has
 * checked every size; needs the AVX2 attention (g_avx2). */
/* n dot products of rows w (n x K, rows K apart) with x, each dot_f32_avx2's arithmetic (its own
 * chain of FMAs over the row, its lanes summed alike, the tail in order), four chains at a time:
 * one chain waits on each FMA's latency, four keep the unit busy. */
AVX2 static void dots_f32(const float *w, const float *x, int K, int n, float *out) {
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *w0 = w + (size_t)j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int i = 0;
        for (; i + 8 <= K; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
        }
        float r0 = hsum_avx(a0), r1 = hsum_avx(a1), r2 = hsum_avx(a2), r3 = hsum_avx(a3);
        for (; i < K; i++) { r0 += w0[i] * x[i]; r1 += w1[i] * x[i]; r2 += w2[i] * x[i]; r3 += w3[i] * x[i]; }
        out[j] = r0; out[j + 1] = r1; out[j + 2] = r2; out[j + 3] = r3;
    }
    for (; j < n; j++) out[j] = dot_f32_avx2(w + (size_t)j * K, x, K);
}

/* Each row's adapter on projection t: out[b] (N) += scale * B (A in[b]) — A x and B (A x) as the
 * block path's F32 matmul computes each value (dot_f32_avx2's arithmetic: a row's bits do not
 * depend on the batch), then the scale, then the add. Every thread calls it (orphaned loops):
 * the rows' A x dealt between the threads four ranks at a time into `tmp` (B x rmax, shared),
 * then their B (A x) in blocks of 64 outputs. */
AVX2 static void lora_rows(const LayerSpec *L, int t, const float *in, int K, float *out, int N, int B,
                           float *tmp, int rmax) {
    const int per = (rmax + 3) / 4, blocks = (N + 63) / 64;
    #pragma omp for schedule(static)
    for (int c = 0; c < B * per; c++) {
        const LoraPair *p = &L->lora[(size_t)(c / per) * LORA_TARGETS + t];
        int j = 4 * (c % per);
        if (p->a && j < p->r)
            dots_f32(p->a + (size_t)j * K, in + (size_t)(c / per) * K, K, p->r - j < 4 ? p->r - j : 4,
                     tmp + (size_t)(c / per) * rmax + j);
    }
    #pragma omp for schedule(static)
    for (int c = 0; c < B * blocks; c++) {
        const int b = c / blocks, i0 = 64 * (c % blocks), m = N - i0 < 64 ? N - i0 : 64;
        const LoraPair *p = &L->lora[(size_t)b * LORA_TARGETS + t];
        if (!p->a) continue;
        float dl[64], *o = out + (size_t)b * N + i0;
        dots_f32(p->b + (size_t)i0 * p->r, tmp + (size_t)b * rmax, p->r, m, dl);
        for (int i = 0; i < m; i++) { float d = dl[i] * p->scale; o[i] = o[i] + d; }
    }
}

int decode_layer_rows(const LayerSpec *L, float *x, int B, const DecodeRow *rows, int nt) {
    int missing = 0;          /* streamed experts: a chosen one is not resident (the FFN skipped) */
#ifdef KILN_X86
    static const TypeInfo tf = {1, 4, A_F32};
    int n = L->n, H = L->H, Hkv = L->Hkv, D = L->D, qn = H * D, kvn = Hkv * D, n_ff = L->n_ff;
    int moe = L->ffn == FFN_MOE, S = 0;
    int fr = moe ? L->k : B;                  /* FFN rows held at once: a row's experts, or the batch */
    TypeInfo tq, tv, to, tg = tf, td = tf;
    type_info(L->qkv_t, &tq); type_info(L->v_t, &tv); type_info(L->wo_t, &to);
    /* v of another type (Q4_K_M files keep v in Q6_K on some layers): a product of its own, with
       its own activations only when its type quantizes them otherwise than q's (Q4_K, Q6_K: alike) */
    const int v_apart = L->v_t != L->qkv_t, v_own_act = v_apart && tv.act != tq.act;
    if (L->ffn) { type_info(L->gu_t, &tg); type_info(L->wd_t, &td); }
    for (int b = 0; b < B; b++) if (rows[b].pos + 1 > S) S = rows[b].pos + 1;
    size_t nf = L->ffn ? (size_t)n_ff * fr : 1;
    float *a = malloc((size_t)B * n * 4), *q = malloc((size_t)B * qn * 4), *kt = malloc((size_t)B * kvn * 4),
          *vt = malloc((size_t)B * kvn * 4), *att = malloc((size_t)B * qn * 4), *o = malloc((size_t)B * n * 4),
          *f = malloc((size_t)B * n * 4), *g = malloc(nf * 4), *u = malloc(nf * 4),
          *dn = malloc((size_t)n * (moe ? L->k : B) * 4), *logits = malloc((size_t)(moe ? L->E : 1) * 4),
          *wsel_all = malloc((size_t)B * MAX_K * 4);
    int *sel_all = malloc((size_t)B * MAX_K * sizeof(int));
    int lrmax = 0;                            /* the largest LoRA rank in the batch: A x's room per row */
    for (int i = 0; L->lora && i < B * LORA_TARGETS; i++) if (L->lora[i].a && L->lora[i].r > lrmax) lrmax = L->lora[i].r;
    float *ltmp = lrmax ? malloc((size_t)B * lrmax * sizeof(float)) : NULL;
    const uint8_t *Wqkv[3] = {L->wq, L->wk, L->wv}, *Wo[1] = {L->wo}, *Wgu[2] = {L->wg, L->wu}, *Wd[1] = {L->wd};
    int Nqkv[3] = {qn, kvn, kvn}, No[1] = {n}, Ngu[2] = {n_ff, n_ff}, Nd[1] = {n}, sel[MAX_K];
    float *Oqkv[3] = {q, kt, vt}, *Oo[1] = {o}, *Ogu[2] = {g, u}, *Od[1] = {dn}, wsel[MAX_K];
    Act aq, av = {0}, ao, ag = {0}, ad = {0}, ar = {0};
    act_alloc(&aq, &tq, a, B, n); act_alloc(&ao, &to, att, B, qn);
    if (v_own_act) act_alloc(&av, &tv, a, B, n);
    if (L->ffn) { act_alloc(&ag, &tg, f, B, n); act_alloc(&ad, &td, g, fr, n_ff); act_alloc(&ar, &tf, f, B, n); }
    float scale = L->kq_scale > 0.f ? L->kq_scale : 1.0f / sqrtf((float)D);
    int plain = L->kt == L->vt && (L->kt == T_F32 || L->kt == T_F16), kv_f16 = L->kt == T_F16;
    int G = H / Hkv;
    /* plain caches: a KV head's query heads (and a sequence's consecutive rows) at once */
    int grouped = plain && D % 64 == 0 && D <= 512 && G <= 64;
    int split = nt > 1 && (B * (grouped ? Hkv : H)) % nt != 0 && D % 64 == 0 && S >= SPLIT_ATTENTION_FROM;
    int fa = L->vt == T_Q8_0 || L->vt == T_Q4_0;  /* flash attention's pass after the scores (kv_quant.c) */
    float *rowbuf = split || grouped ? malloc((size_t)B * H * (S + 8) * sizeof(float)) : NULL;
    float *accbuf = split || grouped ? aligned_alloc(32, (size_t)B * H * 8 * D * sizeof(float)) : NULL;
    AttnGroupPlan *gp = grouped ? attn_group_plan(rows, B, H, D, S, q, rowbuf, accbuf, att, L->sinks) : NULL;
    #pragma omp parallel num_threads(nt)
    {
        float *sc = malloc(((size_t)S + 8) * sizeof(float));     /* + the softmax padding */
        /* per-row work (norms, quantizing, RoPE) dealt between the threads: rows are independent */
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rms_row(x + (size_t)b * n, L->attn_norm, a + (size_t)b * n, n, L->eps); act_row(&aq, b, n);
            if (v_own_act) act_row(&av, b, n);
        }
        rows_dot(&aq, B, n, L->qkv_t, &tq, v_apart ? 2 : 3, Wqkv, Nqkv, Oqkv);
        if (v_apart) rows_dot(v_own_act ? &av : &aq, B, n, L->v_t, &tv, 1, Wqkv + 2, Nqkv + 2, Oqkv + 2);
        if (L->lora) {
            lora_rows(L, LORA_Q, a, n, q, qn, B, ltmp, lrmax);
            lora_rows(L, LORA_K, a, n, kt, kvn, B, ltmp, lrmax);
            lora_rows(L, LORA_V, a, n, vt, kvn, B, ltmp, lrmax);
        }
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *kb = kt + (size_t)b * kvn, *vb = vt + (size_t)b * kvn;
            if (L->bq) {                      /* qwen2: the biases, after the products (and any adapter) */
                float *qb = q + (size_t)b * qn;
                for (int i = 0; i < qn; i++) qb[i] = qb[i] + L->bq[i];
                for (int i = 0; i < kvn; i++) { kb[i] = kb[i] + L->bk[i]; vb[i] = vb[i] + L->bv[i]; }
            }
            if (L->q_norm && L->qk_norm_full) {        /* olmoe: the whole projection RMS-normed */
                rms_row(q + (size_t)b * qn, L->q_norm, q + (size_t)b * qn, qn, L->eps);
                rms_row(kb, L->k_norm, kb, kvn, L->eps);
            } else if (L->q_norm) {           /* qwen3: each head RMS-normed before RoPE */
                for (int h = 0; h < H; h++) rms_row(q + (size_t)b * qn + h * D, L->q_norm, q + (size_t)b * qn + h * D, D, L->eps);
                for (int h = 0; h < Hkv; h++) rms_row(kb + h * D, L->k_norm, kb + h * D, D, L->eps);
            }
            rope_row(q + (size_t)b * qn, rows[b].cos, rows[b].sin, H, D, L->R, L->neox);
            rope_row(kb, rows[b].cos, rows[b].sin, Hkv, D, L->R, L->neox);
            if (L->q_scale > 0.f)             /* ggml_scale of the roped q (phi3, gemma3) */
                for (int i = 0; i < qn; i++) q[(size_t)b * qn + i] *= L->q_scale;
            /* fp16 rounded to nearest even, as numpy's astype; Q8_0/Q4_0 as ggml's set_rows */
            size_t kr = (size_t)kv_row_bytes(L->kt, D), vr = (size_t)kv_row_bytes(L->vt, D);
            for (int j = 0; j < Hkv; j++) {
                kv_store_row(L->kt, kb + (size_t)j * D, (uint8_t *)rows[b].k + ((size_t)rows[b].pos * Hkv + j) * kr, D,
                             kv_rot(L->kt, D, 1));
                kv_store_row(L->vt, vb + (size_t)j * D, (uint8_t *)rows[b].v + ((size_t)rows[b].pos * Hkv + j) * vr, D,
                             kv_rot(L->vt, D, 0));
            }
        }
        if (grouped) {
            attn_group_rows(gp, rows, B, H, Hkv, D, kv_f16, scale, split, nt, L->win);
        } else if (split) {
            /* a long decode with heads that do not divide among the threads (9 on 2): each
               (row, head) dealt in phases — scores by positions, the softmax whole, the value
               sums by lanes — every piece the arithmetic of the whole task (same bits) */
            #pragma omp for schedule(static)
            for (int c = 0; c < B * H * nt; c++) {
                int task = c / nt, part = c % nt, b = task / H, m = rows[b].pos + 1;
                int s0 = (int)((long)m * part / nt) & ~3, s1 = part == nt - 1 ? m : (int)((long)m * (part + 1) / nt) & ~3;
                float *row = rowbuf + (size_t)task * (S + 8);
                attn_kv_scores(q, rows[b].k, L->kt, b, task % H, H, Hkv, D, s0, s1, scale, row);
            }
            if (fa) {                 /* a quantized value cache: one sequential pass per task */
                #pragma omp for schedule(static)
                for (int task = 0; task < B * H; task++)
                    attn_kv_fa_pass(rowbuf + (size_t)task * (S + 8), rows[task / H].v, L->vt, task % H, H, Hkv, D,
                                    rows[task / H].pos + 1, L->win, L->sinks, att + (size_t)task * D);
            } else {
                #pragma omp for schedule(static)
                for (int task = 0; task < B * H; task++) {
                    float *row = rowbuf + (size_t)task * (S + 8);
                    attn_kv_softmax(row, rows[task / H].pos + 1, L->win, L->sinks ? L->sinks + task % H : NULL, L->vt);
                }
                #pragma omp for schedule(static)
                for (int c = 0; c < B * H * 2; c++) {
                    int task = c / 2, b = task / H, i0 = 4 * (c % 2);
                    const float *row = rowbuf + (size_t)task * (S + 8);
                    float *acc = accbuf + (size_t)task * 8 * D;
                    attn_kv_vlanes(row, rows[b].v, L->vt, task % H, H, Hkv, D, rows[b].pos + 1, i0, i0 + 4, acc);
                }
                #pragma omp for schedule(static)
                for (int task = 0; task < B * H; task++)
                    attn_kv_reduce(accbuf + (size_t)task * 8 * D, att + (size_t)task * D, D, L->vt);
            }
        } else {
            #pragma omp for schedule(static)
            for (int task = 0; task < B * H; task++) {
                int b = task / H;
                if (!plain) attn_task_kv(q, rows[b].k, rows[b].v, L->kt, L->vt, att, b, task % H, H, Hkv, D, rows[b].pos + 1, scale, sc, L->win, L->sinks);
                else if (kv_f16) attn_task_avx2_h(q, rows[b].k, rows[b].v, att, b, task % H, H, Hkv, D, rows[b].pos + 1, scale, sc, L->win, L->sinks);
                else attn_task_avx2(q, rows[b].k, rows[b].v, att, b, task % H, H, Hkv, D, rows[b].pos + 1, scale, sc, L->win, L->sinks);
            }
        }
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) act_row(&ao, b, qn);
        rows_dot(&ao, B, qn, L->wo_t, &to, 1, Wo, No, Oo);
        if (L->lora) lora_rows(L, LORA_O, att, qn, o, n, B, ltmp, lrmax);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xb = x + (size_t)b * n, *ob = o + (size_t)b * n;
            if (L->bo) for (int i = 0; i < n; i++) ob[i] = ob[i] + L->bo[i];
            if (L->post_attn_norm) rms_row(ob, L->post_attn_norm, ob, n, L->eps);
            for (int i = 0; i < n; i++) xb[i] = xb[i] + ob[i];
            if (L->ffn) { rms_row(xb, L->ffn_norm, f + (size_t)b * n, n, L->eps); act_row(&ag, b, n); }
        }
        if (L->ffn == FFN_DENSE) {
            rows_dot(&ag, B, n, L->gu_t, &tg, 2, Wgu, Ngu, Ogu);
            if (L->lora) {
                lora_rows(L, LORA_GATE, f, n, g, n_ff, B, ltmp, lrmax);
                lora_rows(L, LORA_UP, f, n, u, n_ff, B, ltmp, lrmax);
            }
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *gb = g + (size_t)b * n_ff, *ub = u + (size_t)b * n_ff;
                if (L->gelu_table) {          /* ggml_geglu_split: gelu(g) * u */
                    gelu_rows(gb, (size_t)n_ff, L->gelu_table);
                    for (int i = 0; i < n_ff; i++) gb[i] = gb[i] * ub[i];
                } else swiglu_row(gb, ub, n_ff);
                act_row(&ad, b, n_ff);
            }
            rows_dot(&ad, B, n_ff, L->wd_t, &td, 1, Wd, Nd, Od);
            if (L->lora) lora_rows(L, LORA_DOWN, g, n_ff, dn, n, B, ltmp, lrmax);
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *xb = x + (size_t)b * n, *db = dn + (size_t)b * n;
                if (L->post_ffn_norm) rms_row(db, L->post_ffn_norm, db, n, L->eps);
                for (int i = 0; i < n; i++) xb[i] = xb[i] + db[i];
            }
        } else if (moe && L->xtab) {
            /* streamed experts: route every row first; if a chosen expert is not resident, leave
               the FFN to the caller (x holds the attention's residual, as FFN_NONE leaves it) */
            for (int b = 0; b < B; b++) {
                Act arb = act_view(&ar, b, n);
                route_one(L, &arb, logits, sel_all + (size_t)b * L->k, wsel_all + (size_t)b * L->k);
            }
            #pragma omp single
            for (int r = 0; r < B * L->k; r++) {
                if (L->chosen) L->chosen[r] = sel_all[r];
                if (L->chosen_w) L->chosen_w[r] = wsel_all[r];
                if (!L->xtab[3 * sel_all[r]]) missing = 1;
            }
            if (!missing)
                for (int b = 0; b < B; b++) {
                    Act arb = act_view(&ar, b, n), agb = act_view(&ag, b, n);
                    moe_row(L, x + (size_t)b * n, &arb, &agb, &ad, logits, g, u, dn, &tg, &td,
                            sel_all + (size_t)b * L->k, wsel_all + (size_t)b * L->k, 1);
                }
        } else if (moe) {
            for (int b = 0; b < B; b++) {
                Act arb = act_view(&ar, b, n), agb = act_view(&ag, b, n);
                if (L->router_b) moe_oai_row(L, x + (size_t)b * n, &arb, &agb, &ad, logits, g, u, dn, &tg, &td);
                else moe_row(L, x + (size_t)b * n, &arb, &agb, &ad, logits, g, u, dn, &tg, &td, sel, wsel, 0);
            }
        }
        free(sc);
    }
    act_free(&aq); act_free(&ao); if (v_own_act) act_free(&av);
    if (L->ffn) { act_free(&ag); act_free(&ad); act_free(&ar); }
    free(a); free(q); free(kt); free(vt); free(att); free(o); free(f); free(g); free(u); free(dn); free(logits);
    free(wsel_all); free(sel_all); free(ltmp); free(rowbuf); free(accbuf); attn_group_free(gp);
#endif
    return missing;
}

/* The routed FFN of B decode rows whose chosen experts are being streamed into cache slots, in
 * steps: x (B, n) holds the attention's residual (decode_layer_rows stopped there), sel/wsel each
 * row's k chosen experts (ascending) and weights. Each call computes every (row, j) whose address
 * triple in ptrs (B, k, 3) is set and which is not yet done into dn (B, k, n) — the same
 * operations as moe_row — and marks it done; a row whose k are all done gets its weighted sum
 * added to x in ascending order, as moe_row adds it. Returns how many (row, j) are left, so the
 * caller can call again as the remaining reads arrive. */
int moe_stream_rows(const LayerSpec *L, float *x, int B, const int32_t *sel, const float *wsel,
                    const uint64_t *ptrs, uint8_t *done, float *dn, int nt) {
    int n = L->n, n_ff = L->n_ff, k = L->k, left = 0;
    TypeInfo tg, td;
    type_info(L->gu_t, &tg); type_info(L->wd_t, &td);
    size_t d_row = (size_t)(n_ff / td.block) * td.bytes;
    float *f = malloc((size_t)n * 4), *g = malloc((size_t)k * n_ff * 4), *u = malloc((size_t)k * n_ff * 4);
    Act ag, ad;
    act_alloc(&ag, &tg, f, 1, n); act_alloc(&ad, &td, g, k, n_ff);
    #pragma omp parallel num_threads(nt)
    for (int b = 0; b < B; b++) {
        int todo[MAX_K], m = 0;                   /* every thread builds the same list */
        for (int j = 0; j < k; j++)
            if (!done[(size_t)b * k + j] && ptrs[((size_t)b * k + j) * 3]) todo[m++] = j;
        if (!m) continue;
        const uint8_t *Wgu[2 * MAX_K];
        int Ngu[2 * MAX_K];
        float *Ogu[2 * MAX_K];
        for (int i = 0; i < m; i++) {
            const uint64_t *p = ptrs + ((size_t)b * k + todo[i]) * 3;
            Wgu[2 * i] = (const uint8_t *)(uintptr_t)p[0]; Wgu[2 * i + 1] = (const uint8_t *)(uintptr_t)p[1];
            Ngu[2 * i] = Ngu[2 * i + 1] = n_ff;
            Ogu[2 * i] = g + (size_t)i * n_ff; Ogu[2 * i + 1] = u + (size_t)i * n_ff;
        }
        #pragma omp single
        { rms_row(x + (size_t)b * n, L->ffn_norm, f, n, L->eps); act_row(&ag, 0, n); }
        rows_dot(&ag, 1, n, L->gu_t, &tg, 2 * m, Wgu, Ngu, Ogu);
        #pragma omp single
        for (int i = 0; i < m; i++) {
            swiglu_row(g + (size_t)i * n_ff, u + (size_t)i * n_ff, n_ff);
            act_row(&ad, i, n_ff);
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < m * n; r++) {
            int i = r / n, row = r % n;
            const uint64_t *p = ptrs + ((size_t)b * k + todo[i]) * 3;
            dn[((size_t)b * k + todo[i]) * n + row] = dot_row(L->wd_t, &td, (const uint8_t *)(uintptr_t)p[2] + (size_t)row * d_row, &ad, i, n_ff);
        }
        #pragma omp single
        {
            for (int i = 0; i < m; i++) done[(size_t)b * k + todo[i]] = 1;
            int all = 1;
            for (int j = 0; j < k; j++) all &= done[(size_t)b * k + j];
            if (all) {
                float *xb = x + (size_t)b * n;
                const float *wb = wsel + (size_t)b * k, *db = dn + (size_t)b * k * n;
                for (int i = 0; i < n; i++) {
                    float acc = 0.f;          /* the step path's zeros, += weight * expert out, in order */
                    for (int j = 0; j < k; j++) acc = acc + wb[j] * db[(size_t)j * n + i];
                    xb[i] = xb[i] + acc;
                }
            }
        }
    }
    for (int r = 0; r < B * k; r++) left += !done[r];
    act_free(&ag); act_free(&ad);
    free(f); free(g); free(u);
    return left;
}
