/* Kiln's compiled kernels, the Python side of a layer in one call: decode_layer and moe_stream
 * (csrc/layer.c) — their many buffers held, sized and checked, the GIL released while they run.
 * Registered by ../_kernels.c, which holds the rest of the module. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kiln.h"
#include "py_layer.h"

/* decode_layer(x (B, n) in place, attn_norm, eps, (wq, wk, wv), (qk_type, v_type), wo, wo_type,
 *              [(kcache, vcache, pos), ...B], cos (B, R/2), sin (B, R/2), H, Hkv, D, R, neox, ffn, threads,
 *              (kt, vt), q_scale, kq_scale, lora, (q_norm, k_norm), (bq, bk, bv), window,
 *              (post_attn_norm, post_ffn_norm), gelu_table, bo, sinks, (router_b, gate_b, up_b, down_b), q_gate, shared)
 *   ffn: None (the caller runs the FFN), a dense SwiGLU (ffn_norm, wg, wu, gu_type, wd, wd_type, n_ff),
 *        or a routed one (ffn_norm, router F32 (E, n), wg_exps, wu_exps, gu_type, wd_exps, wd_type,
 *        n_ff, E, k, normalize) with the experts stacked (E, n_ff, n) / (E, n, n_ff); q_gate: wq gives per
 *        head D query rows then D gate rows, the attention times sigmoid(gate) (qwen35); shared: a routed
 *        FFN's shared expert (py_layer.h shared_arg).
 * One decode step of B sequences through one layer (csrc/layer.c). Each sequence's K/V caches
 * (capacity x Hkv rows of D values of ggml types kt and vt: F32, F16, Q8_0, Q4_0) get its position written; attention reads
 * positions 0..pos (pos - window + 1..pos with a window: a sliding-window layer's own buffer). */
PyObject *py_decode_layer(PyObject *self, PyObject *args) {
    PyObject *xo, *ano, *wqo, *wko, *wvo, *woo, *seqs, *co, *so, *ffn_obj, *lorao = Py_None, *qkno = Py_None, *biaso = Py_None,
             *posto = Py_None, *geluo = Py_None, *boo = Py_None, *sinko = Py_None, *oaio = Py_None, *sho = Py_None;
    LayerSpec L = {0};
    double eps;
    int threads, neox;
    if (!PyArg_ParseTuple(args, "OOd(OOO)(ii)OiO!OOiiiipOi(ii)|ffOOOiOOOOOpO", &xo, &ano, &eps, &wqo, &wko, &wvo, &L.qkv_t, &L.v_t, &woo, &L.wo_t,
                          &PyList_Type, &seqs, &co, &so, &L.H, &L.Hkv, &L.D, &L.R, &neox, &ffn_obj, &threads, &L.kt, &L.vt,
                          &L.q_scale, &L.kq_scale, &lorao, &qkno, &biaso, &L.win, &posto, &geluo, &boo, &sinko, &oaio, &L.q_gate, &sho))
        return NULL;
    Held *h = calloc(1, sizeof(Held));
    DecodeRow *rows = NULL;
    PyObject *ret = NULL;
    Py_buffer *xb, *anb, *wb[4], *cb, *sb;
    int B = (int)PyList_GET_SIZE(seqs);
    if (!h) { PyErr_NoMemory(); return NULL; }
    if (B < 1 || B > MAX_BATCH) { PyErr_Format(PyExc_ValueError, "decode_layer: 1 to %d sequences, not %d", MAX_BATCH, B); goto done; }
    if (!(xb = hold(h, xo, 1)) || !(anb = hold(h, ano, 0)) || !(wb[0] = hold(h, wqo, 0)) || !(wb[1] = hold(h, wko, 0)) ||
        !(wb[2] = hold(h, wvo, 0)) || !(wb[3] = hold(h, woo, 0)) || !(cb = hold(h, co, 0)) || !(sb = hold(h, so, 0)))
        goto done;
    L.neox = neox; L.eps = (float)eps; L.E = 1; L.k = 1;
    int n = L.n = (int)(xb->len / 4 / B), qn = L.H * L.D, kvn = L.Hkv * L.D;
    TypeInfo tq, tv, to;
    if (!g_avx2) { PyErr_SetString(PyExc_RuntimeError, "decode_layer needs the AVX2 kernels"); goto done; }
    if (!type_info(L.qkv_t, &tq) || !type_info(L.v_t, &tv) || !type_info(L.wo_t, &to)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: a weight type has no compiled kernel"); goto done;
    }
    if ((size_t)xb->len != (size_t)B * n * 4 || n % tq.block || n % tv.block || qn % to.block || L.Hkv < 1 || L.H % L.Hkv ||
        L.R > L.D || L.D > MAX_HEAD_DIM ||
        (size_t)wb[0]->len < (size_t)(L.q_gate ? 2 : 1) * qn * (n / tq.block) * tq.bytes || (size_t)wb[1]->len < (size_t)kvn * (n / tq.block) * tq.bytes ||
        (size_t)wb[2]->len < (size_t)kvn * (n / tv.block) * tv.bytes || (size_t)wb[3]->len < (size_t)n * (qn / to.block) * to.bytes ||
        (size_t)cb->len < (size_t)B * (L.R / 2) * 4 || (size_t)sb->len < (size_t)B * (L.R / 2) * 4 || (size_t)anb->len < (size_t)n * 4) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: a buffer is smaller than its shape"); goto done;
    }
    if (!ffn_arg(h, ffn_obj, &L, B)) goto done;
    if (qkno != Py_None) {                    /* (q_norm, k_norm): float32 (D) each, or (H*D), (Hkv*D) with full */
        PyObject *qno, *kno;
        Py_buffer *qnb, *knb;
        if (!PyArg_ParseTuple(qkno, "OO|p", &qno, &kno, &L.qk_norm_full) || !(qnb = hold(h, qno, 0)) ||
            !(knb = hold(h, kno, 0))) goto done;
        size_t qw = L.qk_norm_full ? (size_t)qn : (size_t)L.D, kw = L.qk_norm_full ? (size_t)kvn : (size_t)L.D;
        if ((size_t)qnb->len != qw * 4 || (size_t)knb->len != kw * 4) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: a q/k norm is not head_dim (or its projection's) floats"); goto done;
        }
        L.q_norm = qnb->buf; L.k_norm = knb->buf;
    }
    if (biaso != Py_None) {                   /* (bq, bk, bv): float32 (H*D), (Hkv*D), (Hkv*D) */
        PyObject *bqo, *bko, *bvo;
        Py_buffer *bqb, *bkb, *bvb;
        if (!PyArg_ParseTuple(biaso, "OOO", &bqo, &bko, &bvo) || !(bqb = hold(h, bqo, 0)) || !(bkb = hold(h, bko, 0)) ||
            !(bvb = hold(h, bvo, 0))) goto done;
        if ((size_t)bqb->len != (size_t)L.H * L.D * 4 || (size_t)bkb->len != (size_t)L.Hkv * L.D * 4 ||
            (size_t)bvb->len != (size_t)L.Hkv * L.D * 4) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: a bias is not its projection's size"); goto done;
        }
        L.bq = bqb->buf; L.bk = bkb->buf; L.bv = bvb->buf;
    }
    if (L.win < 0) { PyErr_Format(PyExc_ValueError, "decode_layer: a sliding window of %d positions", L.win); goto done; }
    if (posto != Py_None) {                   /* (post_attn_norm, post_ffn_norm): float32 (n) each (gemma3) */
        PyObject *pao, *pfo;
        Py_buffer *pab, *pfb;
        if (L.ffn != FFN_DENSE) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: post-block norms need the dense FFN in the call"); goto done;
        }
        if (!PyArg_ParseTuple(posto, "OO", &pao, &pfo) || !(pab = hold(h, pao, 0)) || !(pfb = hold(h, pfo, 0))) goto done;
        if ((size_t)pab->len != (size_t)n * 4 || (size_t)pfb->len != (size_t)n * 4) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: a post-block norm is not n_embd floats"); goto done;
        }
        L.post_attn_norm = pab->buf; L.post_ffn_norm = pfb->buf;
    }
    if (geluo != Py_None) {                   /* ggml's GELU table: 65,536 float32 */
        Py_buffer *gtb = hold(h, geluo, 0);
        if (!gtb) goto done;
        if ((size_t)gtb->len != 65536 * 4 || L.ffn != FFN_DENSE) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: the GELU table is 65,536 floats, for a dense FFN"); goto done;
        }
        L.gelu_table = gtb->buf;
    }
    if (boo != Py_None || sinko != Py_None) {   /* gpt-oss: the output bias (n), a sink per head (H) */
        Py_buffer *bob = boo != Py_None ? hold(h, boo, 0) : NULL, *skb = sinko != Py_None ? hold(h, sinko, 0) : NULL;
        if ((boo != Py_None && !bob) || (sinko != Py_None && !skb)) goto done;
        if ((bob && (size_t)bob->len != (size_t)n * 4) || (skb && (size_t)skb->len != (size_t)L.H * 4)) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: the output bias is not n_embd floats or the sinks not one per head");
            goto done;
        }
        L.bo = bob ? bob->buf : NULL; L.sinks = skb ? skb->buf : NULL;
    }
    if (oaio != Py_None) {                    /* gpt-oss's routed FFN: (router_b (E), gate_b, up_b (E, n_ff), down_b (E, n)) */
        PyObject *rbo, *gbo, *ubo, *dbo;
        Py_buffer *rbb, *gbb, *ubb, *dbb;
        if (L.ffn != FFN_MOE || L.xtab || L.route.bias || L.route.sigmoid || L.route.groups > 1 ||
            (L.route.scale != 0.0f && L.route.scale != 1.0f)) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: gpt-oss's biases need its routed FFN in the call, in RAM, "
                            "routed by its own rule"); goto done;
        }
        if (!PyArg_ParseTuple(oaio, "OOOO", &rbo, &gbo, &ubo, &dbo) || !(rbb = hold(h, rbo, 0)) || !(gbb = hold(h, gbo, 0)) ||
            !(ubb = hold(h, ubo, 0)) || !(dbb = hold(h, dbo, 0))) goto done;
        if ((size_t)rbb->len != (size_t)L.E * 4 || (size_t)gbb->len != (size_t)L.E * L.n_ff * 4 ||
            (size_t)ubb->len != (size_t)L.E * L.n_ff * 4 || (size_t)dbb->len != (size_t)L.E * n * 4) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: an expert bias is not its shape"); goto done;
        }
        L.router_b = rbb->buf; L.gate_b = gbb->buf; L.up_b = ubb->buf; L.down_b = dbb->buf;
    }
    if (lorao != Py_None && !lora_arg(h, lorao, &L, B)) goto done;
    if (!shared_arg(h, sho, &L)) goto done;
    L.attn_norm = anb->buf; L.wq = wb[0]->buf; L.wk = wb[1]->buf; L.wv = wb[2]->buf; L.wo = wb[3]->buf;
    if (!(rows = rows_arg(h, seqs, cb, sb, &L, B, "decode_layer"))) goto done;
    int nt = pick_threads(threads);
    int missing;
    Py_BEGIN_ALLOW_THREADS
    missing = decode_layer_rows(&L, xb->buf, B, rows, nt);
    Py_END_ALLOW_THREADS
    ret = PyBool_FromLong(!missing);          /* False: a streamed expert was missing, FFN not run */
done:
    while (h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(rows);
    return ret;
}

/* moe_stream(x, ffn_norm, eps, gu_type, wd_type, n_ff, sel, wsel, ptrs, done, dn, threads): a routed
 * FFN over streamed experts in steps (csrc/layer.c moe_stream_rows); returns how many are left. */
PyObject *py_moe_stream(PyObject *self, PyObject *args) {
    PyObject *xo, *fno, *selo, *wso, *po, *dno, *dneo;
    LayerSpec L = {0};
    double eps;
    int threads;
    if (!PyArg_ParseTuple(args, "OOdiiiOOOOOi", &xo, &fno, &eps, &L.gu_t, &L.wd_t, &L.n_ff, &selo, &wso, &po,
                          &dno, &dneo, &threads))
        return NULL;
    Held *h = calloc(1, sizeof(Held));
    PyObject *ret = NULL;
    Py_buffer *xb, *fnb, *sb, *wb, *pb, *db, *dnb;
    if (!h) { PyErr_NoMemory(); return NULL; }
    if (!(xb = hold(h, xo, 1)) || !(fnb = hold(h, fno, 0)) || !(sb = hold(h, selo, 0)) || !(wb = hold(h, wso, 0)) ||
        !(pb = hold(h, po, 0)) || !(db = hold(h, dno, 1)) || !(dnb = hold(h, dneo, 1)))
        goto done;
    TypeInfo tg, td;
    if (!g_avx2) { PyErr_SetString(PyExc_RuntimeError, "moe_stream needs the AVX2 kernels"); goto done; }
    if (!type_info(L.gu_t, &tg) || !type_info(L.wd_t, &td)) {
        PyErr_SetString(PyExc_ValueError, "moe_stream: a weight type has no compiled kernel"); goto done;
    }
    int n = L.n = (int)(fnb->len / 4);              /* x (B, n), done (B, k): the shapes from the buffers */
    int B = n ? (int)(xb->len / 4 / n) : 0, k = L.k = B ? (int)(db->len / B) : 0;
    if (n < 1 || B < 1 || B > MAX_BATCH || k < 1 || k > MAX_K || (size_t)xb->len != (size_t)B * n * 4 ||
        (size_t)db->len != (size_t)B * k || (size_t)sb->len < (size_t)B * k * 4 || (size_t)wb->len < (size_t)B * k * 4 ||
        (size_t)pb->len < (size_t)B * k * 3 * 8 || (size_t)dnb->len < (size_t)B * k * n * 4 ||
        n % tg.block || L.n_ff % td.block || L.n_ff < 1) {
        PyErr_SetString(PyExc_ValueError, "moe_stream: a buffer is smaller than its shape"); goto done;
    }
    L.ffn = FFN_MOE; L.eps = (float)eps; L.ffn_norm = fnb->buf;
    int nt = pick_threads(threads), left;
    Py_BEGIN_ALLOW_THREADS
    left = moe_stream_rows(&L, xb->buf, B, sb->buf, wb->buf, pb->buf, db->buf, dnb->buf, nt);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromLong(left);
done:
    while (h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h);
    return ret;
}

/* moe_ffn(x (T, n), experts int32 (T, k), weights float32 (T, k), wg_exps, wu_exps, gu_type, wd_exps,
 *         wd_type, n_ff, E, out (T, n), threads): the routed SwiGLU FFN of T rows, each row's weighted
 * sum of its experts added to out (csrc/moe_rows.c). */
PyObject *py_moe_ffn(PyObject *self, PyObject *args) {
    PyObject *xo, *eo, *wo, *go, *uo, *dwo, *oo;
    int gu_t, wd_t, n_ff, E, threads;
    if (!PyArg_ParseTuple(args, "OOOOOiOiiiOi", &xo, &eo, &wo, &go, &uo, &gu_t, &dwo, &wd_t, &n_ff, &E, &oo, &threads))
        return NULL;
    Held *h = calloc(1, sizeof(Held));
    PyObject *ret = NULL;
    Py_buffer *xb, *eb, *wb, *gb, *ub, *db, *ob;
    if (!h) { PyErr_NoMemory(); return NULL; }
    if (!(xb = hold(h, xo, 0)) || !(eb = hold(h, eo, 0)) || !(wb = hold(h, wo, 0)) || !(gb = hold(h, go, 0)) ||
        !(ub = hold(h, uo, 0)) || !(db = hold(h, dwo, 0)) || !(ob = hold(h, oo, 1)))
        goto done;
    TypeInfo tg, td;
    if (!g_avx2) { PyErr_SetString(PyExc_RuntimeError, "moe_ffn needs the AVX2 kernels"); goto done; }
    if (!type_info(gu_t, &tg) || !type_info(wd_t, &td)) {
        PyErr_SetString(PyExc_ValueError, "moe_ffn: a weight type has no compiled kernel"); goto done;
    }
    /* the shapes from the buffers: out and x (T, n), experts (T, k) */
    Py_ssize_t T = 0, n = 0, k = 0;
    if (E >= 1 && n_ff >= 1 && ob->len == xb->len && ob->len > 0) {
        size_t row_bytes = (size_t)(n_ff / td.block) * td.bytes;      /* wd (E, n, n_ff): n from its size */
        n = row_bytes && n_ff % td.block == 0 ? (Py_ssize_t)((size_t)db->len / ((size_t)E * row_bytes)) : 0;
        T = n ? (Py_ssize_t)((size_t)xb->len / 4 / (size_t)n) : 0;
        k = T ? (Py_ssize_t)((size_t)eb->len / 4 / (size_t)T) : 0;
    }
    size_t gu_row = n && n % tg.block == 0 ? (size_t)(n / tg.block) * tg.bytes : 0;
    if (!T || !n || !k || k > E || !gu_row || (size_t)xb->len != (size_t)T * n * 4 ||
        (size_t)eb->len != (size_t)T * k * 4 || (size_t)wb->len != (size_t)T * k * 4 ||
        (size_t)gb->len < (size_t)E * n_ff * gu_row || (size_t)ub->len < (size_t)E * n_ff * gu_row ||
        T > INT_MAX / (int)k) {
        PyErr_SetString(PyExc_ValueError, "moe_ffn: a buffer is smaller than its shape"); goto done;
    }
    const int32_t *ex = eb->buf;
    for (Py_ssize_t i = 0; i < T * k; i++)
        if (ex[i] < 0 || ex[i] >= E) { PyErr_Format(PyExc_ValueError, "moe_ffn: expert %d of %d", ex[i], E); goto done; }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    moe_ffn_rows(xb->buf, (int)T, (int)n, ex, wb->buf, (int)k, gb->buf, ub->buf, gu_t, db->buf, wd_t, n_ff, E,
                 ob->buf, nt);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h);
    return ret;
}
