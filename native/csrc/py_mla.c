/* Kiln's compiled kernels, the Python side of deepseek2's latent-attention layer in one call
 * (csrc/mla.c): its buffers held, sized and checked, the GIL released while it runs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kiln.h"
#include "py_layer.h"

/* a weight of `rows` rows of K values of type t: its TypeInfo, checked against its buffer; 0: an error set */
static int weight_ok(Py_buffer *w, int t, int rows, int K, TypeInfo *ti, const char *name) {
    if (!type_info(t, ti) || K < 1 || K % ti->block) {
        PyErr_Format(PyExc_ValueError, "decode_mla_layer: %s of type %d has no compiled kernel for rows of %d", name, t, K);
        return 0;
    }
    if ((size_t)w->len < (size_t)rows * (K / ti->block) * ti->bytes) {
        PyErr_Format(PyExc_ValueError, "decode_mla_layer: %s is smaller than %d x %d", name, rows, K);
        return 0;
    }
    return 1;
}

/* decode_mla_layer(x (B, n) in place, attn_norm, eps, (wq, wq_a, wq_b, wkv_a, wk_b, wv_b, wo),
 *                  (q_t, qa_t, qb_t, kva_t, kb_t, vb_t, wo_t), (q_a_norm, kv_a_norm), (H, C, R, nope, vd),
 *                  [(kcache, vcache, pos), ...B], cos (B, R/2), sin (B, R/2), neox, (kt, vt), kq_scale,
 *                  ffn, threads, shared)
 *   wq None: the low-rank query (wq_a, q_a_norm, wq_b), else wq_a, wq_b and q_a_norm None; the caches
 *   one KV head of C + R values; ffn and shared as decode_layer's. */
PyObject *py_decode_mla_layer(PyObject *self, PyObject *args) {
    PyObject *xo, *ano, *wo[7], *qano, *kvano, *seqs, *co, *so, *ffn_obj, *sho = Py_None, *ret = NULL;
    double eps;
    int threads, neox, types[7];
    MlaSpec m = {0};
    LayerSpec L = {0};
    if (!PyArg_ParseTuple(args, "OOd(OOOOOOO)(iiiiiii)(OO)(iiiii)O!OOp(ii)fOi|O", &xo, &ano, &eps, &wo[0], &wo[1], &wo[2],
                          &wo[3], &wo[4], &wo[5], &wo[6], &types[0], &types[1], &types[2], &types[3], &types[4], &types[5],
                          &types[6], &qano, &kvano, &m.H, &m.C, &m.R, &m.nope, &m.vd, &PyList_Type, &seqs, &co, &so,
                          &neox, &L.kt, &L.vt, &L.kq_scale, &ffn_obj, &threads, &sho))
        return NULL;
    int B = (int)PyList_GET_SIZE(seqs), missing;
    Held *h = calloc(1, sizeof(Held));
    DecodeRow *rows = NULL;
    Py_buffer *xb, *anb, *wb[7] = {0}, *kvanb, *qanb = NULL, *cb, *sb;
    TypeInfo ti;
    if (!h) { PyErr_NoMemory(); return NULL; }
    if (!batch_ok("decode_mla_layer", B)) goto done;
    const int lowrank = wo[0] == Py_None;
    for (int p = 0; p < 7; p++) {
        if (wo[p] == Py_None && (p == 0 ? 0 : p <= 2 ? lowrank : 1)) {
            PyErr_Format(PyExc_ValueError, "decode_mla_layer: weight %d is missing", p); goto done;
        }
        if (wo[p] != Py_None && (p == 1 || p == 2) && !lowrank) {
            PyErr_SetString(PyExc_ValueError, "decode_mla_layer: wq with wq_a/wq_b: one query form, not both"); goto done;
        }
        if (wo[p] != Py_None && !(wb[p] = hold(h, wo[p], 0))) goto done;
    }
    if (!(xb = hold(h, xo, 1)) || !(anb = hold(h, ano, 0)) || !(kvanb = hold(h, kvano, 0)) || !(cb = hold(h, co, 0)) ||
        !(sb = hold(h, so, 0)) || (lowrank && !(qanb = hold(h, qano, 0))))
        goto done;
    const int n = L.n = (int)(xb->len / 4 / B), H = m.H, C = m.C, R = m.R, nope = m.nope, vd = m.vd;
    const int qw = H * (nope + R);
    m.qr = lowrank ? (int)(qanb->len / 4) : 0;
    if (n < 1 || (size_t)xb->len != (size_t)B * n * 4 || (size_t)anb->len != (size_t)n * 4 || H < 1 || H > 1024 || C < 1 ||
        R < 2 || R % 2 || nope < 1 || vd < 1 || vd > 65536 || C + R > MAX_HEAD_DIM || (size_t)kvanb->len != (size_t)C * 4 ||
        (lowrank && m.qr < 1) || (size_t)cb->len < (size_t)B * (R / 2) * 4 || (size_t)sb->len < (size_t)B * (R / 2) * 4) {
        PyErr_Format(PyExc_ValueError, "decode_mla_layer: x, the norms, the rope tables or the dimensions (%d heads, "
                     "kv_lora_rank %d, rope %d, no-rope %d, values %d; key rows at most %d) are not a layer's",
                     H, C, R, nope, vd, MAX_HEAD_DIM);
        goto done;
    }
    if (lowrank ? !weight_ok(wb[1], types[1], m.qr, n, &ti, "wq_a") || !weight_ok(wb[2], types[2], qw, m.qr, &ti, "wq_b")
                : !weight_ok(wb[0], types[0], qw, n, &ti, "wq"))
        goto done;
    if (!weight_ok(wb[3], types[3], C + R, n, &ti, "wkv_a") || !weight_ok(wb[4], types[4], H * C, nope, &ti, "attn_k_b") ||
        !weight_ok(wb[5], types[5], H * vd, C, &ti, "attn_v_b") || !weight_ok(wb[6], types[6], n, H * vd, &ti, "wo"))
        goto done;
    m.wq = lowrank ? NULL : wb[0]->buf; m.q_t = types[0];
    if (lowrank) { m.wq_a = wb[1]->buf; m.wq_b = wb[2]->buf; m.qa_t = types[1]; m.qb_t = types[2]; m.q_a_norm = qanb->buf; }
    m.wkv_a = wb[3]->buf; m.kva_t = types[3]; m.kv_a_norm = kvanb->buf;
    m.wk_b = wb[4]->buf; m.kb_t = types[4]; m.wv_b = wb[5]->buf; m.vb_t = types[5];
    L.wo = wb[6]->buf; L.wo_t = types[6];
    L.H = H; L.Hkv = 1; L.D = C + R; L.R = R; L.neox = neox; L.eps = (float)eps; L.attn_norm = anb->buf; L.E = 1; L.k = 1;
    if (!mixer_ffn_args(h, "decode_mla_layer", "latent-attention", ffn_obj, Py_None, sho, &L, B)) goto done;
    if (!(rows = rows_arg(h, seqs, cb, sb, &L, B, "decode_mla_layer"))) goto done;
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    missing = mla_layer_rows(&m, &L, xb->buf, B, rows, nt);
    Py_END_ALLOW_THREADS
    (void)missing;
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h); free(rows);
    return ret;
}
