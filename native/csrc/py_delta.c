/* The Python side of qwen35's gated delta net for decode rows (csrc/delta_net.c): the step the
 * block path calls, and the whole layer in one call. Registered by ../_kernels.c. */
#include "py_layer.h"

/* (conv_w, dt, a, norm), (Hk, Hv, dk, dv, K), eps and B (conv_state, S) pairs: into d and st,
 * every size checked against the dimensions. 0: a Python error set. */
static int delta_args(Held *h, PyObject *spec, PyObject *dims, double eps, PyObject *states, int B,
                      DeltaSpec *d, DeltaState *st) {
    PyObject *cwo, *dto, *ao, *no;
    Py_buffer *cw, *dt, *a, *nb;
    if (!PyArg_ParseTuple(spec, "OOOO", &cwo, &dto, &ao, &no) ||
        !PyArg_ParseTuple(dims, "iiiii", &d->Hk, &d->Hv, &d->dk, &d->dv, &d->K)) return 0;
    if (d->Hk < 1 || d->Hv < 1 || d->dk < 1 || d->dv < 1 || d->K < 1 || d->Hk > 4096 || d->Hv > 4096 ||
        d->dk > DELTA_MAX_DV || d->dv > DELTA_MAX_DV || d->K > 64) {
        PyErr_Format(PyExc_ValueError, "delta net: %d key heads, %d value heads of %d x %d, a conv of %d: outside "
                     "1..4096 heads, 1..%d wide, a kernel of 1..64", d->Hk, d->Hv, d->dk, d->dv, d->K, DELTA_MAX_DV);
        return 0;
    }
    size_t C = (size_t)2 * d->Hk * d->dk + (size_t)d->Hv * d->dv;
    if (!(cw = hold(h, cwo, 0)) || !(dt = hold(h, dto, 0)) || !(a = hold(h, ao, 0)) || !(nb = hold(h, no, 0))) return 0;
    if ((size_t)cw->len != C * d->K * 4 || (size_t)dt->len != (size_t)d->Hv * 4 || (size_t)a->len != (size_t)d->Hv * 4 ||
        (size_t)nb->len != (size_t)d->dv * 4) {
        PyErr_SetString(PyExc_ValueError, "delta net: the conv weights, dt, a or the norm is not its shape"); return 0;
    }
    d->conv_w = cw->buf; d->dt = dt->buf; d->a = a->buf; d->norm = nb->buf; d->eps = (float)eps;
    if (!PyList_Check(states) || PyList_GET_SIZE(states) != B) {
        PyErr_SetString(PyExc_ValueError, "delta net: a list of one (conv, state) pair per row"); return 0;
    }
    for (int b = 0; b < B; b++) {
        PyObject *co, *so;
        Py_buffer *cb, *sb;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(states, b), "OO", &co, &so) || !(cb = hold(h, co, 1)) || !(sb = hold(h, so, 1)))
            return 0;
        if ((size_t)cb->len != (size_t)(d->K - 1) * C * 4 || (size_t)sb->len != (size_t)d->Hv * d->dk * d->dv * 4) {
            PyErr_Format(PyExc_ValueError, "delta net: row %d's conv inputs or state is not its shape", b); return 0;
        }
        st[b].conv = cb->buf; st[b].S = sb->buf;
    }
    return 1;
}

/* delta_step(spec, dims, eps, mixed (B, C), z (B, Hv dv), beta (B, Hv), alpha (B, Hv), states, out (B, Hv dv),
 *            threads): B decode rows' delta-net step from their projections, states updated */
PyObject *py_delta_step(PyObject *self, PyObject *args) {
    PyObject *spec, *dims, *mo, *zo, *blo, *alo, *states, *oo, *ret = NULL;
    double eps;
    int threads;
    if (!PyArg_ParseTuple(args, "OOdOOOOO!Oi", &spec, &dims, &eps, &mo, &zo, &blo, &alo, &PyList_Type, &states, &oo, &threads))
        return NULL;
    int B = (int)PyList_GET_SIZE(states);
    Held *h = calloc(1, sizeof(Held));
    DeltaState *st = calloc(B > 0 ? B : 1, sizeof(DeltaState));
    DeltaSpec d = {0};
    Py_buffer *mb, *zb, *bb, *ab, *ob;
    if (!h || !st) { PyErr_NoMemory(); goto done; }
    if (B < 1 || B > MAX_BATCH) { PyErr_Format(PyExc_ValueError, "delta_step: 1 to %d rows, not %d", MAX_BATCH, B); goto done; }
    if (!delta_args(h, spec, dims, eps, states, B, &d, st)) goto done;
    size_t C = (size_t)2 * d.Hk * d.dk + (size_t)d.Hv * d.dv, inner = (size_t)d.Hv * d.dv;
    if (!(mb = hold(h, mo, 0)) || !(zb = hold(h, zo, 0)) || !(bb = hold(h, blo, 0)) || !(ab = hold(h, alo, 0)) || !(ob = hold(h, oo, 1)))
        goto done;
    if ((size_t)mb->len != B * C * 4 || (size_t)zb->len != B * inner * 4 || (size_t)bb->len != (size_t)B * d.Hv * 4 ||
        (size_t)ab->len != (size_t)B * d.Hv * 4 || (size_t)ob->len != B * inner * 4) {
        PyErr_SetString(PyExc_ValueError, "delta_step: a row buffer is not its shape"); goto done;
    }
    float *conv = malloc(B * C * 4);
    if (!conv) { PyErr_NoMemory(); goto done; }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel num_threads(nt)
    delta_step_rows(&d, B, mb->buf, zb->buf, bb->buf, ab->buf, st, conv, ob->buf);
    Py_END_ALLOW_THREADS
    free(conv);
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h && h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(st);
    return ret;
}

/* decode_delta_layer(x (B, n) in place, attn_norm, eps, (wqkv, wgate, wbeta, walpha, wout),
 *                    (their five types), spec, dims, states, ffn, threads, lora, shared): B decode
 * rows through a delta-net layer and its FFN (ffn and shared as decode_layer's) in one call */
PyObject *py_decode_delta_layer(PyObject *self, PyObject *args) {
    PyObject *xo, *ano, *wo[5], *spec, *dims, *states, *ffn_obj, *lorao = Py_None, *sho = Py_None, *ret = NULL;
    double eps;
    int threads, types[5];
    if (!PyArg_ParseTuple(args, "OOd(OOOOO)(iiiii)OOO!Oi|OO", &xo, &ano, &eps, &wo[0], &wo[1], &wo[2], &wo[3], &wo[4],
                          &types[0], &types[1], &types[2], &types[3], &types[4], &spec, &dims, &PyList_Type, &states,
                          &ffn_obj, &threads, &lorao, &sho))
        return NULL;
    int B = (int)PyList_GET_SIZE(states), missing;
    Held *h = calloc(1, sizeof(Held));
    DeltaState *st = calloc(B > 0 ? B : 1, sizeof(DeltaState));
    DeltaSpec d = {0};
    LayerSpec L = {0};
    Py_buffer *xb, *anb, *wb[5];
    if (!h || !st) { PyErr_NoMemory(); goto done; }
    if (B < 1 || B > MAX_BATCH) { PyErr_Format(PyExc_ValueError, "decode_delta_layer: 1 to %d rows, not %d", MAX_BATCH, B); goto done; }
    if (!g_avx2) { PyErr_SetString(PyExc_RuntimeError, "decode_delta_layer needs the AVX2 kernels"); goto done; }
    if (!delta_args(h, spec, dims, eps, states, B, &d, st)) goto done;
    if (!(xb = hold(h, xo, 1)) || !(anb = hold(h, ano, 0))) goto done;
    for (int p = 0; p < 5; p++) if (!(wb[p] = hold(h, wo[p], 0))) goto done;
    int n = L.n = (int)(xb->len / 4 / B), C = 2 * d.Hk * d.dk + d.Hv * d.dv, inner = d.Hv * d.dv;
    const int rows[5] = {C, inner, d.Hv, d.Hv, n}, width[5] = {n, n, n, n, inner};
    for (int p = 0; p < 5; p++) {
        TypeInfo ti;
        if (!type_info(types[p], &ti) || width[p] % ti.block ||
            (size_t)wb[p]->len < (size_t)rows[p] * (width[p] / ti.block) * ti.bytes) {
            PyErr_Format(PyExc_ValueError, "decode_delta_layer: projection %d has no compiled kernel for type %d or is "
                         "smaller than %d x %d", p, types[p], rows[p], width[p]);
            goto done;
        }
    }
    if ((size_t)xb->len != (size_t)B * n * 4 || (size_t)anb->len != (size_t)n * 4) {
        PyErr_SetString(PyExc_ValueError, "decode_delta_layer: x is not B rows of n_embd, or attn_norm not n_embd floats"); goto done;
    }
    d.wqkv = wb[0]->buf; d.wgate = wb[1]->buf; d.wbeta = wb[2]->buf; d.walpha = wb[3]->buf; d.wout = wb[4]->buf;
    d.qkv_t = types[0]; d.gate_t = types[1]; d.beta_t = types[2]; d.alpha_t = types[3]; d.out_t = types[4];
    L.eps = (float)eps; L.attn_norm = anb->buf;
    if (!ffn_arg(h, ffn_obj, &L, B)) goto done;
    if (L.xtab) { PyErr_SetString(PyExc_ValueError, "decode_delta_layer: streamed experts are not taken here"); goto done; }
    if (lorao != Py_None) {
        if (!lora_arg(h, lorao, &L, B)) goto done;
        for (int i = 0; i < B * LORA_TARGETS; i++)
            if (L.lora[i].a && i % LORA_TARGETS < LORA_GATE) {
                PyErr_SetString(PyExc_ValueError, "decode_delta_layer: a delta-net layer has no attention projection to adapt");
                goto done;
            }
    }
    if (!shared_arg(h, sho, &L)) goto done;
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    missing = delta_layer_rows(&d, &L, xb->buf, B, st, nt);
    Py_END_ALLOW_THREADS
    (void)missing;
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h && h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(st);
    return ret;
}
