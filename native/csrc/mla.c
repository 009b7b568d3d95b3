/* deepseek2's multi-head latent attention (arch/deepseek2.py LatentAttention) for B decode rows in
 * one call, then the layer's FFN (ffn_rows.c). The blocks' operations, each as they compute it:
 * the norm; q (or q_a, its norm, q_b) and the compressed kv as products; the rope part of the key
 * roped, the compressed rows normed; each head's query — its no-rope part absorbed through
 * attn_k_b (ggml_vec_dot_f32's order for F32, as ggml runs that permuted product; the usual product
 * otherwise) beside its roped part; one key row [ckv | k_pe] and one value row [ckv | 0] a position;
 * attention over them with the family's scale; each head's output through attn_v_b; the output
 * projection and the residual. Every value the same operation on the same operands: the same bits. */
#include "kiln.h"

#define ROW_BYTES(K, ti) ((size_t)((K) / (ti).block) * (ti).bytes)

int mla_layer_rows(const MlaSpec *m, const LayerSpec *L, float *x, int B, const DecodeRow *rows, int nt) {
    int missing = 0;
#ifdef KILN_X86
    const int n = L->n, H = m->H, C = m->C, R = m->R, nope = m->nope, vd = m->vd, D = C + R;
    const int qh = nope + R, qw = H * qh, kva = C + R, qr = m->qr, lowrank = m->wq == NULL;
    int S = 0;
    for (int b = 0; b < B; b++) if (rows[b].pos + 1 > S) S = rows[b].pos + 1;
    float *a = malloc((size_t)B * n * 4), *q = malloc((size_t)B * qw * 4), *kv = malloc((size_t)B * kva * 4),
          *qa = lowrank ? malloc((size_t)B * qr * 4) : NULL, *qn = malloc((size_t)H * B * nope * 4),
          *qabs = malloc((size_t)H * B * C * 4), *query = malloc((size_t)B * H * D * 4), *att = malloc((size_t)B * H * D * 4),
          *vrow = malloc((size_t)B * D * 4), *oc = malloc((size_t)H * B * C * 4), *voh = malloc((size_t)H * B * vd * 4),
          *vo = malloc((size_t)B * H * vd * 4), *y = malloc((size_t)B * n * 4);
    TypeInfo tq, tkv, tqb = {0}, tkb, tvb, to;
    type_info(lowrank ? m->qa_t : m->q_t, &tq); type_info(m->kva_t, &tkv); type_info(m->kb_t, &tkb);
    type_info(m->vb_t, &tvb); type_info(L->wo_t, &to);
    if (lowrank) type_info(m->qb_t, &tqb);
    const int kb_f32 = m->kb_t == T_F32;       /* the absorption as ggml_vec_dot_f32 (see above) */
    Act aq, akv, aqb = {0}, ao, *akb = calloc(H, sizeof(Act)), *avb = calloc(H, sizeof(Act));
    act_alloc(&aq, &tq, a, B, n); act_alloc(&akv, &tkv, a, B, n); act_alloc(&ao, &to, vo, B, H * vd);
    if (lowrank) act_alloc(&aqb, &tqb, qa, B, qr);
    for (int h = 0; h < H; h++) {
        if (!kb_f32) act_alloc(&akb[h], &tkb, qn + (size_t)h * B * nope, B, nope);
        act_alloc(&avb[h], &tvb, oc + (size_t)h * B * C, B, C);
    }
    const float scale = L->kq_scale > 0.f ? L->kq_scale : 1.0f / sqrtf((float)D);
    const int plain = L->kt == L->vt && (L->kt == T_F32 || L->kt == T_F16), kv_f16 = L->kt == T_F16;
    const uint8_t *Wq[1] = {lowrank ? m->wq_a : m->wq}, *Wkv[1] = {m->wkv_a}, *Wqb[1] = {m->wq_b}, *Wo[1] = {L->wo};
    int Nq[1] = {lowrank ? qr : qw}, Nkv[1] = {kva}, Nqb[1] = {qw}, Nkb[1] = {C}, Nvb[1] = {vd}, No[1] = {n};
    float *Oq[1] = {lowrank ? qa : q}, *Okv[1] = {kv}, *Oqb[1] = {q}, *Oo[1] = {y};
    FfnWork fw;
    ffn_work_init(&fw, L, B);
    #pragma omp parallel num_threads(nt)
    {
        float *sc = malloc(((size_t)S + 8) * sizeof(float));     /* + the softmax padding */
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            rms_row(x + (size_t)b * n, L->attn_norm, a + (size_t)b * n, n, L->eps);
            act_row(&aq, b, n); act_row(&akv, b, n);
        }
        rows_dot(&aq, B, n, lowrank ? m->qa_t : m->q_t, &tq, 1, Wq, Nq, Oq);
        rows_dot(&akv, B, n, m->kva_t, &tkv, 1, Wkv, Nkv, Okv);
        if (lowrank) {
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                rms_row(qa + (size_t)b * qr, m->q_a_norm, qa + (size_t)b * qr, qr, L->eps);
                act_row(&aqb, b, qr);
            }
            rows_dot(&aqb, B, qr, m->qb_t, &tqb, 1, Wqb, Nqb, Oqb);
        }
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            const DecodeRow *r = rows + b;
            float *kb = kv + (size_t)b * kva, *qb = q + (size_t)b * qw, *vb = vrow + (size_t)b * D;
            rope_row(kb + C, r->cos, r->sin, 1, R, R, L->neox);               /* k_pe */
            rms_row(kb, m->kv_a_norm, kb, C, L->eps);                         /* the compressed rows */
            for (int h = 0; h < H; h++) {
                float *qd = query + ((size_t)b * H + h) * D;
                memcpy(qn + ((size_t)h * B + b) * nope, qb + (size_t)h * qh, (size_t)nope * 4);
                memcpy(qd + C, qb + (size_t)h * qh + nope, (size_t)R * 4);
                rope_row(qd + C, r->cos, r->sin, 1, R, R, L->neox);           /* q_pe */
                if (!kb_f32) act_row(&akb[h], b, nope);
            }
            memcpy(vb, kb, (size_t)C * 4);
            memset(vb + C, 0, (size_t)R * 4);
            kv_store_row(L->kt, kb, r->k + (size_t)r->pos * r->kps, D, kv_rot(L->kt, D, 1));
            kv_store_row(L->vt, vb, r->v + (size_t)r->pos * r->vps, D, kv_rot(L->vt, D, 0));
        }
        if (kb_f32) {                         /* head h's row c of attn_k_b against its no-rope query */
            #pragma omp for schedule(static)
            for (int task = 0; task < H * B; task++) {
                const int h = task / B, b = task % B;
                const float *w = (const float *)m->wk_b + (size_t)h * C * nope, *v = qn + ((size_t)h * B + b) * nope;
                float *qd = query + ((size_t)b * H + h) * D;
                for (int c = 0; c < C; c++) qd[c] = vdot_ggml(w + (size_t)c * nope, v, nope);
            }
        } else {
            for (int h = 0; h < H; h++) {
                const uint8_t *W[1] = {m->wk_b + (size_t)h * C * ROW_BYTES(nope, tkb)};
                float *O[1] = {qabs + (size_t)h * B * C};
                rows_dot(&akb[h], B, nope, m->kb_t, &tkb, 1, W, Nkb, O);
            }
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < H; h++)
                    memcpy(query + ((size_t)b * H + h) * D, qabs + ((size_t)h * B + b) * C, (size_t)C * 4);
        }
        #pragma omp for schedule(static)
        for (int task = 0; task < B * H; task++) {          /* one KV head: every query head reads it */
            const int b = task / H, h = task % H;
            const DecodeRow *r = rows + b;
            if (!plain) attn_task_kv(query, r->k, r->kps, r->v, r->vps, L->kt, L->vt, att, b, h, H, D, r->pos + 1, scale, sc,
                                     0, NULL);
            else if (kv_f16) attn_task_avx2_h(query, (const uint16_t *)r->k, r->kps / 2, (const uint16_t *)r->v, r->vps / 2,
                                              att, b, h, H, D, r->pos + 1, scale, sc, 0, NULL);
            else attn_task_avx2(query, (const float *)r->k, r->kps / 4, (const float *)r->v, r->vps / 4, att, b, h, H, D,
                                r->pos + 1, scale, sc, 0, NULL);
        }
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++)           /* each head's compressed output, then through attn_v_b */
            for (int h = 0; h < H; h++) {
                memcpy(oc + ((size_t)h * B + b) * C, att + ((size_t)b * H + h) * D, (size_t)C * 4);
                act_row(&avb[h], b, C);
            }
        for (int h = 0; h < H; h++) {
            const uint8_t *W[1] = {m->wv_b + (size_t)h * vd * ROW_BYTES(C, tvb)};
            float *O[1] = {voh + (size_t)h * B * vd};
            rows_dot(&avb[h], B, C, m->vb_t, &tvb, 1, W, Nvb, O);
        }
        #pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            for (int h = 0; h < H; h++)
                memcpy(vo + (size_t)b * H * vd + (size_t)h * vd, voh + ((size_t)h * B + b) * vd, (size_t)vd * 4);
            act_row(&ao, b, H * vd);
        }
        rows_dot(&ao, B, H * vd, L->wo_t, &to, 1, Wo, No, Oo);
        residual_rows(x, y, B, n);
        ffn_rows(L, &fw, x, B, &missing);
        free(sc);
    }
    for (int h = 0; h < H; h++) { if (!kb_f32) act_free(&akb[h]); act_free(&avb[h]); }
    act_free(&aq); act_free(&akv); act_free(&ao);
    if (lowrank) act_free(&aqb);
    ffn_work_free(&fw);
    free(akb); free(avb); free(a); free(q); free(kv); free(qa); free(qn); free(qabs); free(query); free(att); free(vrow);
    free(oc); free(voh); free(vo); free(y);
#endif
    return missing;
}
