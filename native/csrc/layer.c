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

/* B decode rows x (B, n), row b of sequence rows[b], through layer L, in place. The caller has
 * checked every size; needs the AVX2 attention (g_avx2). */
int decode_layer_rows(const LayerSpec *L, float *x, int B, const DecodeRow *rows, int nt) {
    int missing = 0;          /* streamed experts: a chosen one is not resident (the FFN skipped) */
#ifdef KILN_X86
    int n = L->n, H = L->H, Hkv = L->Hkv, D = L->D, qn = H * D, kvn = Hkv * D, S = 0;
    TypeInfo tq, tv, to;
    type_info(L->qkv_t, &tq); type_info(L->v_t, &tv); type_info(L->wo_t, &to);
    /* v of another type (Q4_K_M files keep v in Q6_K on some layers): a product of its own, with
       its own activations only when its type quantizes them otherwise than q's (Q4_K, Q6_K: alike) */
    const int v_apart = L->v_t != L->qkv_t, v_own_act = v_apart && tv.act != tq.act;
    for (int b = 0; b < B; b++) if (rows[b].pos + 1 > S) S = rows[b].pos + 1;
    /* a gated q (qwen35): the projection gives per head D query rows, then D gate rows */
    int qw = L->q_gate ? 2 * qn : qn;
    float *a = malloc((size_t)B * n * 4), *q = malloc((size_t)B * qn * 4), *kt = malloc((size_t)B * kvn * 4),
          *vt = malloc((size_t)B * kvn * 4), *att = malloc((size_t)B * qn * 4), *o = malloc((size_t)B * n * 4),
          *qg = L->q_gate ? malloc((size_t)B * qw * 4) : q, *gate = L->q_gate ? malloc((size_t)B * qn * 4) : NULL;
    FfnWork fw;                               /* the FFN's work, the adapters' room (fw.ltmp) */
    ffn_work_init(&fw, L, B);
    float *ltmp = fw.ltmp;
    const int lrmax = fw.lrmax;
    const uint8_t *Wqkv[3] = {L->wq, L->wk, L->wv}, *Wo[1] = {L->wo};
    int Nqkv[3] = {qw, kvn, kvn}, No[1] = {n};
    float *Oqkv[3] = {qg, kt, vt}, *Oo[1] = {o};
    Act aq, av = {0}, ao;
    act_alloc(&aq, &tq, a, B, n); act_alloc(&ao, &to, att, B, qn);
    if (v_own_act) act_alloc(&av, &tv, a, B, n);
    float scale = L->kq_scale > 0.f ? L->kq_scale : 1.0f / sqrtf((float)D);
    int plain = L->kt == L->vt && (L->kt == T_F32 || L->kt == T_F16), kv_f16 = L->kt == T_F16;
    int G = H / Hkv;
    /* plain caches: a KV head's query heads (and a sequence's consecutive rows) at once */
    int grouped = plain && D % 64 == 0 && D <= MAX_HEAD_DIM && G <= 64;
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
        static const int QKV[3] = {LORA_Q, LORA_K, LORA_V}, O[1] = {LORA_O};
        /* the adapters' rows this thread reads next fetched during the base products (kiln.h
           PfQueue); A x of q, k, v before them, its rows cold (fetching them during the q, k, v
           products as well, with A x after them and one more barrier, measured slower: those
           products are short and their share of the memory already spent) */
        PfQueue *pf = L->lora ? pf_mine() : NULL;
        if (pf) {
            int nth = 1;
#ifdef _OPENMP
            nth = omp_get_num_threads();
#endif
            size_t base = (size_t)(qw + kvn) * (n / tq.block) * tq.bytes + (size_t)kvn * (n / tv.block) * tv.bytes +
                          (size_t)n * (qn / to.block) * to.bytes;
            if (L->ffn == FFN_DENSE)
                base += (size_t)2 * L->n_ff * (n / fw.tg.block) * fw.tg.bytes + (size_t)n * (L->n_ff / fw.td.block) * fw.td.bytes;
            lora_a(L, QKV, 3, a, n, B, ltmp, lrmax);
            lora_plan(pf, L, B, lrmax, qw, kvn, qn, base / nth);
            pf_due(pf, PF_QKV);
        }
        rows_dot(&aq, B, n, L->qkv_t, &tq, v_apart ? 2 : 3, Wqkv, Nqkv, Oqkv);
        if (v_apart) rows_dot(v_own_act ? &av : &aq, B, n, L->v_t, &tv, 1, Wqkv + 2, Nqkv + 2, Oqkv + 2);
        if (L->lora) lora_b(L, QKV, 3, Oqkv, Nqkv, B, ltmp, lrmax);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *kb = kt + (size_t)b * kvn, *vb = vt + (size_t)b * kvn;
            if (L->q_gate)                    /* the query and gate rows of each head apart */
                for (int h = 0; h < H; h++) {
                    memcpy(q + (size_t)b * qn + h * D, qg + (size_t)b * qw + 2 * h * D, (size_t)D * 4);
                    memcpy(gate + (size_t)b * qn + h * D, qg + (size_t)b * qw + (2 * h + 1) * D, (size_t)D * 4);
                }
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
            const DecodeRow *r = rows + b;
            for (int j = 0; j < Hkv; j++) {
                kv_store_row(L->kt, kb + (size_t)j * D, r->k + j * r->khs + (size_t)r->pos * r->kps, D, kv_rot(L->kt, D, 1));
                kv_store_row(L->vt, vb + (size_t)j * D, r->v + j * r->vhs + (size_t)r->pos * r->vps, D, kv_rot(L->vt, D, 0));
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
                attn_kv_scores(q, rows[b].k + (task % H / G) * rows[b].khs, rows[b].kps, L->kt, b, task % H, H, D, s0, s1,
                               scale, row);
            }
            if (fa) {                 /* a quantized value cache: one sequential pass per task */
                #pragma omp for schedule(static)
                for (int task = 0; task < B * H; task++) {
                    const DecodeRow *r = rows + task / H;
                    attn_kv_fa_pass(rowbuf + (size_t)task * (S + 8), r->v + (task % H / G) * r->vhs, r->vps, L->vt, D,
                                    r->pos + 1, L->win, L->sinks ? L->sinks + task % H : NULL, att + (size_t)task * D);
                }
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
                    attn_kv_vlanes(row, rows[b].v + (task % H / G) * rows[b].vhs, rows[b].vps, L->vt, D, rows[b].pos + 1,
                                   i0, i0 + 4, acc);
                }
                #pragma omp for schedule(static)
                for (int task = 0; task < B * H; task++)
                    attn_kv_reduce(accbuf + (size_t)task * 8 * D, att + (size_t)task * D, D, L->vt);
            }
        } else {
            #pragma omp for schedule(static)
            for (int task = 0; task < B * H; task++) {
                int b = task / H, h = task % H;
                const DecodeRow *r = rows + b;
                const uint8_t *K0 = r->k + (h / G) * r->khs, *V0 = r->v + (h / G) * r->vhs;
                if (!plain) attn_task_kv(q, K0, r->kps, V0, r->vps, L->kt, L->vt, att, b, h, H, D, r->pos + 1, scale, sc,
                                         L->win, L->sinks);
                else if (kv_f16) attn_task_avx2_h(q, (const uint16_t *)K0, r->kps / 2, (const uint16_t *)V0, r->vps / 2,
                                                  att, b, h, H, D, r->pos + 1, scale, sc, L->win, L->sinks);
                else attn_task_avx2(q, (const float *)K0, r->kps / 4, (const float *)V0, r->vps / 4, att, b, h, H, D,
                                    r->pos + 1, scale, sc, L->win, L->sinks);
            }
        }
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            if (L->q_gate) sigmoid_mul_row(att + (size_t)b * qn, gate + (size_t)b * qn, qn);   /* × sigmoid(gate) */
            act_row(&ao, b, qn);
        }
        if (L->lora) { lora_a(L, O, 1, att, qn, B, ltmp, lrmax); pf_due(pf, PF_O); }
        rows_dot(&ao, B, qn, L->wo_t, &to, 1, Wo, No, Oo);
        if (L->lora) lora_b(L, O, 1, Oo, No, B, ltmp, lrmax);
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *xb = x + (size_t)b * n, *ob = o + (size_t)b * n;
            if (L->bo) for (int i = 0; i < n; i++) ob[i] = ob[i] + L->bo[i];
            if (L->post_attn_norm) rms_row(ob, L->post_attn_norm, ob, n, L->eps);
            for (int i = 0; i < n; i++) xb[i] = xb[i] + ob[i];
        }
        ffn_rows(L, &fw, x, B, &missing);
        if (pf) pf_clear(pf);
        free(sc);
    }
    act_free(&aq); act_free(&ao); if (v_own_act) act_free(&av);
    ffn_work_free(&fw);
    if (L->q_gate) { free(qg); free(gate); }
    free(a); free(q); free(kt); free(vt); free(att); free(o); free(rowbuf); free(accbuf); attn_group_free(gp);
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
