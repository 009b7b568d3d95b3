/* The Python side of the recurrent mixers for decode rows: qwen35's gated delta net
 * (csrc/delta_net.c) — the step the block path calls, and the whole layer in one call — and
 * lfm2's gated short convolution (csrc/short_conv.c), the whole layer in one call. Registered
 * by ../_kernels.c. */
#include "py_layer.h"

/* (conv_w, dt, a, norm), (Hk, Hv, dk, dv, K), eps and the runs: into d and sg, every size checked
 * against the dimensions. R > 0: (start, len, conv_state, S) runs within R rows, in order and
 * apart; R == 0: a (conv_state, S) pair per row, each a run of one. 0: a Python error set. */
static int delta_args(Held *h, PyObject *spec, PyObject *dims, double eps, PyObject *states, int R,
                      DeltaSpec *d, DeltaSeg *sg) {
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
    int B = (int)PyList_GET_SIZE(states), end = 0;
    for (int b = 0; b < B; b++) {
        PyObject *co, *so;
        Py_buffer *cb, *sb;
        int ok = R ? PyArg_ParseTuple(PyList_GET_ITEM(states, b), "iiOO", &sg[b].start, &sg[b].len, &co, &so)
                   : PyArg_ParseTuple(PyList_GET_ITEM(states, b), "OO", &co, &so);
        if (!R) { sg[b].start = b; sg[b].len = 1; }
        if (!ok || !(cb = hold(h, co, 1)) || !(sb = hold(h, so, 1))) return 0;
        if ((size_t)cb->len != (size_t)(d->K - 1) * C * 4 || (size_t)sb->len != (size_t)d->Hv * d->dk * d->dv * 4) {
            PyErr_Format(PyExc_ValueError, "delta net: run %d's conv inputs or state is not its shape", b); return 0;
        }
        if (R && (sg[b].start < end || sg[b].len < 1 || sg[b].len > R - sg[b].start)) {
            PyErr_Format(PyExc_ValueError, "delta net: run %d (rows %d..+%d) is not within the %d rows after the "
                         "runs before it", b, sg[b].start, sg[b].len, R); return 0;
        }
        end = sg[b].start + sg[b].len;
        sg[b].conv = cb->buf; sg[b].S = sb->buf;
    }
    return 1;
}

/* delta_rows(spec, dims, eps, mixed (R, C), z (R, Hv dv), beta (R, Hv), alpha (R, Hv),
 *            [(start, len, conv_state, S), ...], out (R, Hv dv), threads): runs of sequences' rows
 * through the delta net from their projections, their states updated */
PyObject *py_delta_rows(PyObject *self, PyObject *args) {
    PyObject *spec, *dims, *mo, *zo, *blo, *alo, *states, *oo, *ret = NULL;
    double eps;
    int threads;
    if (!PyArg_ParseTuple(args, "OOdOOOOO!Oi", &spec, &dims, &eps, &mo, &zo, &blo, &alo, &PyList_Type, &states, &oo, &threads))
        return NULL;
    int nseg = (int)PyList_GET_SIZE(states);
    Held *h = calloc(1, sizeof(Held));
    DeltaSeg *sg = calloc(nseg > 0 ? nseg : 1, sizeof(DeltaSeg));
    DeltaSpec d = {0};
    Py_buffer *mb, *zb, *bb, *ab, *ob;
    float *conv = NULL;
    if (!h || !sg) { PyErr_NoMemory(); goto done; }
    if (nseg < 1 || nseg > MAX_BATCH) { PyErr_Format(PyExc_ValueError, "delta_rows: 1 to %d runs, not %d", MAX_BATCH, nseg); goto done; }
    int Hk, Hv, dk, dv, K;                   /* the channels C from the dims, the rows R from mixed */
    if (!PyArg_ParseTuple(dims, "iiiii", &Hk, &Hv, &dk, &dv, &K)) goto done;
    if (!(mb = hold(h, mo, 0)) || !(zb = hold(h, zo, 0)) || !(bb = hold(h, blo, 0)) || !(ab = hold(h, alo, 0)) || !(ob = hold(h, oo, 1)))
        goto done;
    size_t C = (size_t)2 * Hk * dk + (size_t)Hv * dv, inner = (size_t)Hv * dv;
    int R = Hk > 0 && dk > 0 && Hv > 0 && dv > 0 ? (int)((size_t)mb->len / 4 / C) : 0;
    if (R < 1 || (size_t)mb->len != R * C * 4 || (size_t)zb->len != R * inner * 4 || (size_t)bb->len != (size_t)R * Hv * 4 ||
        (size_t)ab->len != (size_t)R * Hv * 4 || (size_t)ob->len != R * inner * 4) {
        PyErr_SetString(PyExc_ValueError, "delta_rows: a row buffer is not its shape"); goto done;
    }
    if (!delta_args(h, spec, dims, eps, states, R, &d, sg)) goto done;
    if (!(conv = malloc(R * C * 4))) { PyErr_NoMemory(); goto done; }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel num_threads(nt)
    delta_rows(&d, nseg, sg, R, mb->buf, zb->buf, bb->buf, ab->buf, conv, ob->buf);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h && h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(sg); free(conv);
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
    DeltaSeg *sg = calloc(B > 0 ? B : 1, sizeof(DeltaSeg));
    DeltaSpec d = {0};
    LayerSpec L = {0};
    Py_buffer *xb, *anb, *wb[5];
    if (!h || !sg) { PyErr_NoMemory(); goto done; }
    if (!batch_ok("decode_delta_layer", B)) goto done;
    if (!delta_args(h, spec, dims, eps, states, 0, &d, sg)) goto done;
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
    if (!mixer_ffn_args(h, "decode_delta_layer", "delta-net", ffn_obj, lorao, sho, &L, B)) goto done;
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    missing = delta_layer_rows(&d, &L, xb->buf, B, sg, nt);
    Py_END_ALLOW_THREADS
    (void)missing;
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h && h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(sg);
    return ret;
}

/* decode_conv_layer(x (B, n) in place, attn_norm, eps, (in_proj, out_proj), (in_type, out_type),
 *                   conv (n, K) float32, [state (K-1, n) float32, ...B], ffn, threads, lora, shared):
 * B decode rows through an LFM2 conv layer and its FFN (ffn and shared as decode_layer's) */
PyObject *py_decode_conv_layer(PyObject *self, PyObject *args) {
    PyObject *xo, *ano, *wio, *woo, *cwo, *states, *ffn_obj, *lorao = Py_None, *sho = Py_None, *ret = NULL;
    double eps;
    int threads;
    ConvSpec s = {0};
    LayerSpec L = {0};
    if (!PyArg_ParseTuple(args, "OOd(OO)(ii)OO!Oi|OO", &xo, &ano, &eps, &wio, &woo, &s.in_t, &s.out_t, &cwo,
                          &PyList_Type, &states, &ffn_obj, &threads, &lorao, &sho))
        return NULL;
    int B = (int)PyList_GET_SIZE(states), missing;
    Held *h = calloc(1, sizeof(Held));
    float **st = calloc(B > 0 ? B : 1, sizeof(float *));
    Py_buffer *xb, *anb, *wib, *wob, *cwb;
    TypeInfo ti, to;
    if (!h || !st) { PyErr_NoMemory(); goto done; }
    if (!batch_ok("decode_conv_layer", B)) goto done;
    if (!(xb = hold(h, xo, 1)) || !(anb = hold(h, ano, 0)) || !(wib = hold(h, wio, 0)) || !(wob = hold(h, woo, 0)) ||
        !(cwb = hold(h, cwo, 0))) goto done;
    int n = L.n = (int)(xb->len / 4 / B);
    s.K = n > 0 ? (int)((size_t)cwb->len / 4 / n) : 0;
    if (!type_info(s.in_t, &ti) || !type_info(s.out_t, &to)) {
        PyErr_SetString(PyExc_ValueError, "decode_conv_layer: a projection's type has no compiled kernel"); goto done;
    }
    if (n < 1 || (size_t)xb->len != (size_t)B * n * 4 || (size_t)anb->len != (size_t)n * 4 || n % ti.block || n % to.block ||
        s.K < 2 || s.K > 64 || (size_t)cwb->len != (size_t)n * s.K * 4 ||
        (size_t)wib->len < (size_t)3 * n * (n / ti.block) * ti.bytes || (size_t)wob->len < (size_t)n * (n / to.block) * to.bytes) {
        PyErr_SetString(PyExc_ValueError, "decode_conv_layer: x, attn_norm, the conv kernel (n x 2..64) or a projection "
                        "is not its shape"); goto done;
    }
    for (int b = 0; b < B; b++) {
        Py_buffer *sb = hold(h, PyList_GET_ITEM(states, b), 1);
        if (!sb) goto done;
        if ((size_t)sb->len != (size_t)(s.K - 1) * n * 4) {
            PyErr_Format(PyExc_ValueError, "decode_conv_layer: row %d's state is not (%d, %d) float32", b, s.K - 1, n); goto done;
        }
        st[b] = sb->buf;
    }
    s.w_in = wib->buf; s.w_out = wob->buf; s.conv_w = cwb->buf;
    L.eps = (float)eps; L.attn_norm = anb->buf;
    if (!mixer_ffn_args(h, "decode_conv_layer", "conv", ffn_obj, lorao, sho, &L, B)) goto done;
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    missing = conv_layer_rows(&s, &L, xb->buf, B, st, nt);
    Py_END_ALLOW_THREADS
    (void)missing;
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h && h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(st);
    return ret;
}
