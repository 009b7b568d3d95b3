/* The one-call bindings' shared arguments (py_layer.h). */
#include "py_layer.h"

Py_buffer *hold(Held *h, PyObject *o, int writable) {
    if (h->n >= (int)(sizeof h->b / sizeof h->b[0])) { PyErr_SetString(PyExc_ValueError, "decode_layer: too many buffers"); return NULL; }
    Py_buffer *b = &h->b[h->n];
    if (PyObject_GetBuffer(o, b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    h->n++;
    return b;
}

Py_ssize_t kv_view_arg(Held *h, PyObject *o, int writable, int Hkv, size_t row_bytes, KvView *v, const char *who) {
    if (h->n >= (int)(sizeof h->b / sizeof h->b[0])) { PyErr_Format(PyExc_ValueError, "%s: too many buffers", who); return -1; }
    Py_buffer *b = &h->b[h->n];
    if (PyObject_GetBuffer(o, b, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    h->n++;
    /* numpy vouches that every index within the shape lies in the memory; strides only > 0 */
    if (b->ndim != 3 || b->shape[1] != Hkv || b->itemsize <= 0 || b->strides[2] != b->itemsize ||
        (size_t)b->shape[2] * (size_t)b->itemsize != row_bytes || b->strides[0] <= 0 || b->strides[1] <= 0 ||
        b->strides[0] % b->itemsize || b->strides[1] % b->itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: a KV cache must be (positions, %d heads, a row of %zu bytes) with "
                     "positive strides and contiguous rows", who, Hkv, row_bytes);
        return -1;
    }
    *v = (KvView){(const uint8_t *)b->buf, (size_t)b->strides[0], (size_t)b->strides[1]};
    return b->shape[0];
}

int ffn_arg(Held *h, PyObject *ffn_obj, LayerSpec *L, int B) {
    Py_buffer *fnb = NULL, *rtb = NULL, *gb = NULL, *ub = NULL, *db = NULL;
    TypeInfo tg, td;
    int n = L->n;
    L->E = 1; L->k = 1;
    if (ffn_obj == Py_None) return 1;
    PyObject *fno, *rto = NULL, *go, *uo, *dwo, *xto = Py_None, *cho = Py_None, *cwo = Py_None;
    int ok;
    Py_ssize_t nf = PyTuple_Check(ffn_obj) ? PyTuple_GET_SIZE(ffn_obj) : 0;
    if (nf >= 12 && nf <= 15) {
        PyObject *rro;
        L->ffn = FFN_MOE;
        ok = PyArg_ParseTuple(ffn_obj, "OOOOiOiiiipO|OOO", &fno, &rto, &go, &uo, &L->gu_t, &dwo, &L->wd_t,
                              &L->n_ff, &L->E, &L->k, &L->normalize, &rro, &xto, &cho, &cwo);
        if (ok && (L->E < 1 || L->E > MAX_EXPERTS || L->k < 1 || L->k > L->E)) {
            PyErr_Format(PyExc_ValueError, "decode_layer: %d of %d experts (the one-call path takes 1 <= k <= %d, "
                         "k <= E <= %d)", L->k, L->E, MAX_K, MAX_EXPERTS);
            return 0;
        }
        if (ok && !route_rule_arg(h, rro, L->E, L->k, &L->route, "decode_layer")) return 0;
        /* streamed experts: a table of E (gate, up, down) addresses the caller keeps valid
           for the call, and where to write each row's chosen experts */
        if (ok && xto != Py_None) {
            Py_buffer *xtb = hold(h, xto, 0);
            if (!xtb) return 0;
            if ((size_t)xtb->len < (size_t)L->E * 3 * 8) {
                PyErr_SetString(PyExc_ValueError, "decode_layer: the expert table holds fewer than E x 3 addresses");
                return 0;
            }
            L->xtab = xtb->buf;
        }
        if (ok && cho != Py_None) {
            Py_buffer *chb = hold(h, cho, 1);
            if (!chb) return 0;
            if ((size_t)chb->len < (size_t)B * L->k * 4) {
                PyErr_SetString(PyExc_ValueError, "decode_layer: the chosen-experts output is smaller than B x k");
                return 0;
            }
            L->chosen = chb->buf;
        }
        if (ok && cwo != Py_None) {
            Py_buffer *cwb = hold(h, cwo, 1);
            if (!cwb) return 0;
            if ((size_t)cwb->len < (size_t)B * L->k * 4) {
                PyErr_SetString(PyExc_ValueError, "decode_layer: the chosen-weights output is smaller than B x k");
                return 0;
            }
            L->chosen_w = cwb->buf;
        }
    } else {
        L->ffn = FFN_DENSE;
        ok = PyArg_ParseTuple(ffn_obj, "OOOiOii", &fno, &go, &uo, &L->gu_t, &dwo, &L->wd_t, &L->n_ff);
    }
    if (!ok || !(fnb = hold(h, fno, 0)) || (rto && !(rtb = hold(h, rto, 0))) || !(gb = hold(h, go, 0)) ||
        !(ub = hold(h, uo, 0)) || !(db = hold(h, dwo, 0)))
        return 0;
    if (!type_info(L->gu_t, &tg) || !type_info(L->wd_t, &td)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: an FFN weight type has no compiled kernel"); return 0;
    }
    if (L->ffn == FFN_MOE && (L->E < 1 || L->E > MAX_EXPERTS || L->k < 1 || L->k > L->E || L->k > MAX_K || (size_t)rtb->len < (size_t)L->E * n * 4)) {
        PyErr_Format(PyExc_ValueError, "decode_layer: %d of %d experts, or a router smaller than its shape "
                     "(the one-call path takes 1 <= k <= %d, k <= E <= %d)", L->k, L->E, MAX_K, MAX_EXPERTS);
        return 0;
    }
    if (L->ffn) {
        size_t gu_row = (size_t)(n / tg.block) * tg.bytes, d_row = (size_t)(L->n_ff / td.block) * td.bytes;
        if (n % tg.block || L->n_ff % td.block || (size_t)fnb->len < (size_t)n * 4 ||
            (size_t)gb->len < (size_t)L->E * L->n_ff * gu_row || (size_t)ub->len < (size_t)L->E * L->n_ff * gu_row ||
            (size_t)db->len < (size_t)L->E * n * d_row) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: an FFN buffer is smaller than its shape"); return 0;
        }
        L->ffn_norm = fnb->buf; L->router = rtb ? rtb->buf : NULL; L->wg = gb->buf; L->wu = ub->buf; L->wd = db->buf;
    }
    return 1;
}

int route_rule_arg(Held *h, PyObject *o, int E, int k, RouteRule *rr, const char *who) {
    PyObject *bo;
    memset(rr, 0, sizeof *rr);
    if (o == Py_None) return 1;
    if (!PyArg_ParseTuple(o, "Opiif", &bo, &rr->sigmoid, &rr->groups, &rr->groups_used, &rr->scale)) return 0;
    if (bo != Py_None) {
        Py_buffer *bb = hold(h, bo, 0);
        if (!bb) return 0;
        if ((size_t)bb->len != (size_t)E * 4) {
            PyErr_Format(PyExc_ValueError, "%s: the experts' selection bias is %zd bytes, not %d float32", who, bb->len, E);
            return 0;
        }
        rr->bias = bb->buf;
    }
    /* a group needs two experts (its score is its two best); the groups kept must hold k experts */
    if (rr->groups < 0 || (rr->groups > 1 && (E % rr->groups || E / rr->groups < 2 || rr->groups_used < 1 ||
                                             rr->groups_used > rr->groups || k > rr->groups_used * (E / rr->groups))) ||
        !isfinite(rr->scale)) {
        PyErr_Format(PyExc_ValueError, "%s: expert groups %d (%d used) of %d experts choosing %d, or a scale of %g: "
                     "the groups must divide the experts, two or more each, and hold the k chosen", who, rr->groups,
                     rr->groups_used, E, k, (double)rr->scale);
        return 0;
    }
    return 1;
}

int lora_arg(Held *h, PyObject *lorao, LayerSpec *L, int B) {
    /* B x LORA_TARGETS LoraPair: addresses of float32 or fp16 A (r, n_in) and B (n_out, r) that the
       caller keeps alive for the call and has checked against the layer's shapes
       (native/runners.py lora_table) */
    Py_buffer *lb = hold(h, lorao, 0);
    if (!lb) return 0;
    if ((size_t)lb->len != (size_t)B * LORA_TARGETS * sizeof(LoraPair)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: the LoRA table is not B x 7 entries"); return 0;
    }
    L->lora = lb->buf;
    for (int i = 0; i < B * LORA_TARGETS; i++) {
        const LoraPair *p = &L->lora[i];
        if (p->a && (!p->b || p->r < 1 || p->r > 4096 || (p->f16 != 0 && p->f16 != 1))) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: a LoRA entry without B, of rank outside 1..4096 "
                            "or of an element type neither float32 (0) nor fp16 (1)"); return 0;
        }
        if (p->a && i % LORA_TARGETS >= LORA_GATE && L->ffn != FFN_DENSE) {
            PyErr_SetString(PyExc_ValueError, "decode_layer: a LoRA on an FFN this call does not run densely"); return 0;
        }
    }
    return 1;
}

int shared_arg(Held *h, PyObject *sho, LayerSpec *L) {
    PyObject *lo, *go, *uo, *dwo;
    Py_buffer *lb = NULL, *gb, *ub, *db;
    TypeInfo tg, td;
    if (sho == Py_None) return 1;
    if (!PyArg_ParseTuple(sho, "OOOiOii", &lo, &go, &uo, &L->sh_gu_t, &dwo, &L->sh_d_t, &L->sh_ff) ||
        (lo != Py_None && !(lb = hold(h, lo, 0))) || !(gb = hold(h, go, 0)) || !(ub = hold(h, uo, 0)) || !(db = hold(h, dwo, 0)))
        return 0;
    if (L->ffn != FFN_MOE || L->xtab || L->router_b) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: a shared expert goes with routed experts in RAM"); return 0;
    }
    if (!type_info(L->sh_gu_t, &tg) || !type_info(L->sh_d_t, &td) || L->sh_ff < 1 || L->n % tg.block ||
        L->sh_ff % td.block) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: the shared expert's types have no compiled kernel or do not "
                        "divide its shapes"); return 0;
    }
    size_t gu_row = (size_t)(L->n / tg.block) * tg.bytes, d_row = (size_t)(L->sh_ff / td.block) * td.bytes;
    if ((lb && (size_t)lb->len != (size_t)L->n * 4) || (size_t)gb->len < L->sh_ff * gu_row || (size_t)ub->len < L->sh_ff * gu_row ||
        (size_t)db->len < (size_t)L->n * d_row) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: a shared-expert buffer is smaller than its shape"); return 0;
    }
    L->sh_gate = lb ? lb->buf : NULL; L->sh_g = gb->buf; L->sh_u = ub->buf; L->sh_d = db->buf;
    return 1;
}

DecodeRow *rows_arg(Held *h, PyObject *seqs, Py_buffer *cb, Py_buffer *sb, const LayerSpec *L, int B, const char *who) {
    DecodeRow *rows = calloc(B, sizeof(DecodeRow));
    if (!rows) { PyErr_NoMemory(); return NULL; }
    const size_t kr = (size_t)kv_row_bytes(L->kt, L->D), vr = (size_t)kv_row_bytes(L->vt, L->D);
    if (!kr || !vr) { PyErr_Format(PyExc_ValueError, "%s: no KV cache of types %d/%d with head_dim %d", who, L->kt, L->vt, L->D); goto bad; }
    for (int b = 0; b < B; b++) {
        PyObject *ko, *vo;
        KvView kv, vv;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(seqs, b), "OOi", &ko, &vo, &rows[b].pos)) goto bad;
        Py_ssize_t kn = kv_view_arg(h, ko, 1, L->Hkv, kr, &kv, who), vn = kn < 0 ? -1 : kv_view_arg(h, vo, 1, L->Hkv, vr, &vv, who);
        if (kn < 0 || vn < 0) goto bad;
        if (rows[b].pos < 0 || rows[b].pos >= kn || rows[b].pos >= vn) {
            PyErr_Format(PyExc_ValueError, "%s: sequence %d's KV cache holds no position %d", who, b, rows[b].pos); goto bad;
        }
        rows[b].k = (uint8_t *)kv.p; rows[b].v = (uint8_t *)vv.p;
        rows[b].kps = kv.ps; rows[b].khs = kv.hs; rows[b].vps = vv.ps; rows[b].vhs = vv.hs;
        rows[b].cos = (const float *)cb->buf + (size_t)b * (L->R / 2); rows[b].sin = (const float *)sb->buf + (size_t)b * (L->R / 2);
    }
    return rows;
bad:
    free(rows);
    return NULL;
}

int mixer_ffn_args(Held *h, const char *who, const char *what, PyObject *ffn_obj, PyObject *lorao,
                          PyObject *sho, LayerSpec *L, int B) {
    if (!ffn_arg(h, ffn_obj, L, B)) return 0;
    if (L->xtab) { PyErr_Format(PyExc_ValueError, "%s: streamed experts are not taken here", who); return 0; }
    if (lorao != Py_None) {
        if (!lora_arg(h, lorao, L, B)) return 0;
        for (int i = 0; i < B * LORA_TARGETS; i++)
            if (L->lora[i].a && i % LORA_TARGETS < LORA_GATE) {
                PyErr_Format(PyExc_ValueError, "%s: a %s layer has no attention projection to adapt", who, what);
                return 0;
            }
    }
    return shared_arg(h, sho, L);
}

/* The rows' count: 0 with the error set, naming `who`, when the call cannot take it */
int batch_ok(const char *who, int B) {
    if (B < 1 || B > MAX_BATCH) { PyErr_Format(PyExc_ValueError, "%s: 1 to %d rows, not %d", who, MAX_BATCH, B); return 0; }
    if (!g_avx2) { PyErr_Format(PyExc_RuntimeError, "%s needs the AVX2 kernels", who); return 0; }
    return 1;
}
