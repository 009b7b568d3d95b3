/* Kiln's compiled kernels, the Python side: argument parsing, size checks, the GIL released
 * around the work. The work itself is in csrc/ (see csrc/kiln.h); every entry point checks that
 * each buffer holds its shape before any C reads it, and says which one does not. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "csrc/kiln.h"
#include "csrc/py_layer.h"

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    Py_buffer xb, wb, ob;
    int type, T, K, N, threads;
    if (!PyArg_ParseTuple(args, "y*y*iiiiw*i", &xb, &wb, &type, &T, &K, &N, &ob, &threads)) return NULL;
    TypeInfo ti;
    PyObject *ret = NULL;
    if (!type_info(type, &ti)) { PyErr_Format(PyExc_ValueError, "ggml type %d has no compiled kernel", type); goto done; }
    if (K % ti.block) { PyErr_Format(PyExc_ValueError, "row length %d is not a multiple of block %d", K, ti.block); goto done; }
    size_t row_bytes = (size_t)(K / ti.block) * ti.bytes;
    if ((size_t)xb.len < (size_t)T * K * 4 || (size_t)wb.len < row_bytes * N || (size_t)ob.len < (size_t)T * N * 4) {
        PyErr_SetString(PyExc_ValueError, "matmul: a buffer is smaller than its shape"); goto done;
    }
    const uint8_t *W = (const uint8_t *)wb.buf;
    float *out = (float *)ob.buf;
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    matmul_core((const float *)xb.buf, T, K, type, &ti, 1, &W, &N, &out, nt);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&ob);
    return ret;
}

/* matmul_many(x, type, T, K, [(w, N, out), ...], threads): several weights of one type, one x. */
static PyObject *py_matmul_many(PyObject *self, PyObject *args) {
    Py_buffer xb;
    int type, T, K, threads;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "y*iiiO!i", &xb, &type, &T, &K, &PyList_Type, &list, &threads)) return NULL;
    PyObject *ret = NULL;
    int nw = (int)PyList_GET_SIZE(list), got = 0;
    Py_buffer wb[8], ob[8];
    const uint8_t *W[8]; float *O[8]; int N[8];
    TypeInfo ti;
    if (nw < 1 || nw > 8) { PyErr_SetString(PyExc_ValueError, "matmul_many: 1 to 8 weights"); goto done; }
    if (!type_info(type, &ti)) { PyErr_Format(PyExc_ValueError, "ggml type %d has no compiled kernel", type); goto done; }
    if (K % ti.block) { PyErr_Format(PyExc_ValueError, "row length %d is not a multiple of block %d", K, ti.block); goto done; }
    if ((size_t)xb.len < (size_t)T * K * 4) { PyErr_SetString(PyExc_ValueError, "matmul_many: x is smaller than its shape"); goto done; }
    size_t row_bytes = (size_t)(K / ti.block) * ti.bytes;
    for (; got < nw; got++) {
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, got), "y*iw*", &wb[got], &N[got], &ob[got])) goto done;
        if ((size_t)wb[got].len < row_bytes * N[got] || (size_t)ob[got].len < (size_t)T * N[got] * 4) {
            PyBuffer_Release(&wb[got]); PyBuffer_Release(&ob[got]);
            PyErr_SetString(PyExc_ValueError, "matmul_many: a buffer is smaller than its shape"); goto done;
        }
        W[got] = (const uint8_t *)wb[got].buf; O[got] = (float *)ob[got].buf;
    }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    matmul_core((const float *)xb.buf, T, K, type, &ti, nw, W, N, O, nt);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    for (int i = 0; i < got; i++) { PyBuffer_Release(&wb[i]); PyBuffer_Release(&ob[i]); }
    PyBuffer_Release(&xb);
    return ret;
}
/* attention(q (T,H,d), k, v, out (T,H*d), T, H, Hkv, d, S, start, threads[, kt, vt, scale, window, sinks]):
 * causal over caches of S positions x Hkv rows of d values of ggml types kt and vt (F32 0, F16 1,
 * Q4_0 2, Q8_0 8), each (positions, Hkv, elements) with any positive strides (kv_view_arg); query t
 * sits at position start+t; head h reads KV head h / (H/Hkv). */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    Py_buffer qb, ob;
    PyObject *ko, *vo;
    int T, H, Hkv, D, S, start, threads, kt = 0, vt = 0, win = 0; float kq_scale = 0.f;
    Py_buffer sb = {0};                        /* optional: one sink logit per head (gpt-oss) */
    if (!PyArg_ParseTuple(args, "y*OOw*iiiiiii|iifiy*", &qb, &ko, &vo, &ob, &T, &H, &Hkv, &D, &S, &start, &threads, &kt,
                          &vt, &kq_scale, &win, &sb))
        return NULL;
    PyObject *ret = NULL;
    const float *sinks = NULL;
    Held *h = calloc(1, sizeof(Held));
    if (!h) { PyErr_NoMemory(); goto done; }
    if (sb.buf) {
        if ((size_t)sb.len < (size_t)H * 4) { PyErr_SetString(PyExc_ValueError, "attention: sinks has fewer than H values"); goto done; }
        sinks = (const float *)sb.buf;
    }
    if (D < 1 || D > MAX_HEAD_DIM) { PyErr_Format(PyExc_ValueError, "attention: head_dim %d is outside 1..%d", D, MAX_HEAD_DIM); goto done; }
    size_t kr = (size_t)kv_row_bytes(kt, D), vr = (size_t)kv_row_bytes(vt, D);
    if (!kr || !vr) { PyErr_Format(PyExc_ValueError, "attention: no KV cache of types %d/%d with head_dim %d", kt, vt, D); goto done; }
    if (Hkv < 1 || H % Hkv) { PyErr_Format(PyExc_ValueError, "attention: %d heads do not share %d KV heads", H, Hkv); goto done; }
    KvView K, V;
    Py_ssize_t kn = kv_view_arg(h, ko, 0, Hkv, kr, &K, "attention"), vn = kn < 0 ? -1 : kv_view_arg(h, vo, 0, Hkv, vr, &V, "attention");
    if (kn < 0 || vn < 0) goto done;
    if ((size_t)qb.len < (size_t)T * H * D * 4 || kn < S || vn < S || (size_t)ob.len < (size_t)T * H * D * 4 ||
        start < 0 || T < 0 || start + T > S) {
        PyErr_SetString(PyExc_ValueError, "attention: a buffer is smaller than its shape"); goto done;
    }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    attention_rows(qb.buf, K, V, ob.buf, T, H, Hkv, D, start, kt, vt, nt, S, kq_scale, win, sinks);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    if (h) { while (h->n) PyBuffer_Release(&h->b[--h->n]); free(h); }
    PyBuffer_Release(&qb); PyBuffer_Release(&ob);
    if (sb.buf) PyBuffer_Release(&sb);
    return ret;
}

/* kv_store(x float32 (R, D), out, type, R, D, rot): R rows written as a KV cache of ggml type
 * `type` stores them (F32, F16, Q8_0, Q4_0 — as llama.cpp's set_rows), rotated first by the
 * Walsh-Hadamard matrix of size rot (0: none; kv_quant.c); kv_load(x, out float32, type, R, D, rot)
 * widens them back (and undoes the rotation). */
static PyObject *kv_convert(PyObject *args, int store) {
    Py_buffer xb, ob; int type, R, D, rot = 0;
    if (!PyArg_ParseTuple(args, "y*w*iii|i", &xb, &ob, &type, &R, &D, &rot)) return NULL;
    PyObject *ret = NULL;
    size_t rb = (size_t)kv_row_bytes(type, D);
    if (rot && (rot < 2 || rot & (rot - 1) || D % rot || D > MAX_HEAD_DIM)) {
        PyErr_Format(PyExc_ValueError, "kv: a rotation of %d does not divide rows of %d values", rot, D); goto done;
    }
    if (!rb || R < 0) { PyErr_Format(PyExc_ValueError, "kv: no KV cache of type %d with rows of %d values", type, D); goto done; }
    size_t fb = (size_t)R * D * 4, qb = (size_t)R * rb;
    if ((size_t)xb.len < (store ? fb : qb) || (size_t)ob.len < (store ? qb : fb)) {
        PyErr_SetString(PyExc_ValueError, "kv: a buffer is smaller than its rows"); goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int r = 0; r < R; r++) {
        if (store) kv_store_row(type, (const float *)xb.buf + (size_t)r * D, (uint8_t *)ob.buf + r * rb, D, rot);
        else kv_load_row(type, (const uint8_t *)xb.buf + r * rb, (float *)ob.buf + (size_t)r * D, D, rot);
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&ob);
    return ret;
}
static PyObject *py_kv_store(PyObject *self, PyObject *args) { return kv_convert(args, 1); }
static PyObject *py_kv_load(PyObject *self, PyObject *args) { return kv_convert(args, 0); }

/* rms_norm(x (T,n), w (n), out (T,n), T, n, eps): per row, double accumulation as ggml. */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    Py_buffer xb, wb, ob; int T, n; double eps;
    if (!PyArg_ParseTuple(args, "y*y*w*iid", &xb, &wb, &ob, &T, &n, &eps)) return NULL;
    PyObject *ret = NULL;
    if ((size_t)xb.len < (size_t)T * n * 4 || (size_t)wb.len < (size_t)n * 4 || (size_t)ob.len < (size_t)T * n * 4) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: a buffer is smaller than its shape"); goto done;
    }
    for (int t = 0; t < T; t++)
        rms_row((const float *)xb.buf + (size_t)t * n, wb.buf, (float *)ob.buf + (size_t)t * n, n, (float)eps);
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&ob);
    return ret;
}

/* rope(x (T,H,D) in place, cos (T,R/2), sin (T,R/2), T, H, D, R, neox) */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    Py_buffer xb, cb, sb; int T, H, D, R, neox;
    if (!PyArg_ParseTuple(args, "w*y*y*iiiip", &xb, &cb, &sb, &T, &H, &D, &R, &neox)) return NULL;
    PyObject *ret = NULL;
    int half = R / 2;
    if ((size_t)xb.len < (size_t)T * H * D * 4 || (size_t)cb.len < (size_t)T * half * 4 || (size_t)sb.len < (size_t)T * half * 4 || R > D) {
        PyErr_SetString(PyExc_ValueError, "rope: a buffer is smaller than its shape"); goto done;
    }
    for (int t = 0; t < T; t++)
        rope_row((float *)xb.buf + (size_t)t * H * D, (const float *)cb.buf + (size_t)t * half,
                 (const float *)sb.buf + (size_t)t * half, H, D, R, neox);
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&cb); PyBuffer_Release(&sb);
    return ret;
}

/* rope_table(n, half, base, freq_scale, factors (half), cos (n, half), sin (n, half)
 *            [, ext_factor, corr0, corr1, mscale [, p0]]): positions p0 .. p0 + n - 1 */
static PyObject *py_rope_table(PyObject *self, PyObject *args) {
    Py_buffer fb, cb, sb; int n, half, p0 = 0; float base, fs, ext = 0.f, c0 = 0.f, c1 = 0.f, ms = 1.f;
    if (!PyArg_ParseTuple(args, "iiffy*w*w*|ffffi", &n, &half, &base, &fs, &fb, &cb, &sb, &ext, &c0, &c1, &ms, &p0)) return NULL;
    PyObject *ret = NULL;
    if (n < 0 || half < 0 || (size_t)fb.len < (size_t)half * 4 || (size_t)cb.len < (size_t)n * half * 4
            || (size_t)sb.len < (size_t)n * half * 4) {
        PyErr_SetString(PyExc_ValueError, "rope_table: a buffer is smaller than its shape"); goto done;
    }
    rope_table(p0, n, half, base, fs, (const float *)fb.buf, ext, c0, c1, ms, (float *)cb.buf, (float *)sb.buf);
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&fb); PyBuffer_Release(&cb); PyBuffer_Release(&sb);
    return ret;
}

/* encoder_attention(q, k, v, out (n, H*D) float32, n, H, D, scale, threads, window[, slopes (H)[,
 * blocks (n int32)]]) -> whether it ran (False without AVX2: the caller computes it itself);
 * window > 0: a symmetric sliding window; slopes: ALiBi's, one per head (b"": none); blocks: a
 * row sees only the rows of its own block (Qwen2.5-VL's attention windows) */
static PyObject *py_encoder_attention(PyObject *self, PyObject *args) {
    Py_buffer qb, kb, vb, ob, sb = {0}, bb = {0}; int n, H, D, nt, win; float scale;
    if (!PyArg_ParseTuple(args, "y*y*y*w*iiifii|y*y*", &qb, &kb, &vb, &ob, &n, &H, &D, &scale, &nt, &win, &sb, &bb))
        return NULL;
    PyObject *ret = NULL;
    size_t need = (size_t)n * H * D * 4;
    const float *slopes = sb.buf && sb.len ? sb.buf : NULL;
    const int *blocks = bb.buf && bb.len ? bb.buf : NULL;
    if (n < 1 || H < 1 || D < 1 || (size_t)qb.len < need || (size_t)kb.len < need || (size_t)vb.len < need
            || (size_t)ob.len < need || (slopes && (size_t)sb.len < (size_t)H * 4)
            || (blocks && (size_t)bb.len < (size_t)n * 4)) {
        PyErr_SetString(PyExc_ValueError, "encoder_attention: a buffer is smaller than its shape"); goto done;
    }
    int ran;
    Py_BEGIN_ALLOW_THREADS
    ran = encoder_attention(qb.buf, kb.buf, vb.buf, ob.buf, n, H, D, scale, nt > 0 ? nt : 1, slopes, win, blocks);
    Py_END_ALLOW_THREADS
    ret = PyBool_FromLong(ran);
done:
    PyBuffer_Release(&qb); PyBuffer_Release(&kb); PyBuffer_Release(&vb); PyBuffer_Release(&ob);
    if (sb.buf) PyBuffer_Release(&sb);
    if (bb.buf) PyBuffer_Release(&bb);
    return ret;
}

/* layer_norm(x (T,n), w (n), b (n), out (T,n), T, n, eps): ggml_norm's arithmetic, times w plus b */
static PyObject *py_layer_norm(PyObject *self, PyObject *args) {
    Py_buffer xb, wb, bb, ob; int T, n; float eps;
    if (!PyArg_ParseTuple(args, "y*y*y*w*iif", &xb, &wb, &bb, &ob, &T, &n, &eps)) return NULL;
    PyObject *ret = NULL;
    if (T < 0 || n < 1 || (size_t)xb.len < (size_t)T * n * 4 || (size_t)wb.len < (size_t)n * 4
            || (size_t)bb.len < (size_t)n * 4 || (size_t)ob.len < (size_t)T * n * 4) {
        PyErr_SetString(PyExc_ValueError, "layer_norm: a buffer is smaller than its shape"); goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    layer_norm_rows(xb.buf, wb.buf, bb.buf, ob.buf, T, n, eps);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&bb); PyBuffer_Release(&ob);
    return ret;
}

/* elementwise pieces (csrc/py_rows.c) */
PyObject *py_gelu(PyObject *self, PyObject *args);
PyObject *py_expf(PyObject *self, PyObject *args);
PyObject *py_swiglu(PyObject *self, PyObject *args);
PyObject *py_sigmoid(PyObject *self, PyObject *args);

/* route(logits (T,E), T, E, k, normalize, experts int32 (T,k) out, weights (T,k) out[, rule]):
 * rule as decode_layer's (py_layer.h route_rule_arg) */
static PyObject *py_route(PyObject *self, PyObject *args) {
    Py_buffer lb, eb, wb; int T, E, k, norm;
    PyObject *rro = Py_None;
    RouteRule rr;
    if (!PyArg_ParseTuple(args, "y*iiipw*w*|O", &lb, &T, &E, &k, &norm, &eb, &wb, &rro)) return NULL;
    PyObject *ret = NULL;
    Held *h = calloc(1, sizeof(Held));
    if (!h) { PyErr_NoMemory(); goto done; }
    if (E < 1 || E > MAX_EXPERTS || k < 1 || k > E) {
        PyErr_Format(PyExc_ValueError, "route: %d of %d experts (1 <= k <= E <= %d)", k, E, MAX_EXPERTS); goto done;
    }
    if ((size_t)lb.len < (size_t)T * E * 4 || (size_t)eb.len < (size_t)T * k * 4 || (size_t)wb.len < (size_t)T * k * 4) {
        PyErr_SetString(PyExc_ValueError, "route: a buffer is smaller than its shape"); goto done;
    }
    if (!route_rule_arg(h, rro, E, k, &rr, "route")) goto done;
    for (int t = 0; t < T; t++)
        route_row((const float *)lb.buf + (size_t)t * E, E, k, norm, &rr, (int *)eb.buf + (size_t)t * k,
                  (float *)wb.buf + (size_t)t * k);
    Py_INCREF(Py_None); ret = Py_None;
done:
    while (h && h->n) PyBuffer_Release(&h->b[--h->n]);
    free(h);
    PyBuffer_Release(&lb); PyBuffer_Release(&eb); PyBuffer_Release(&wb);
    return ret;
}

/* the layer in one call (csrc/py_layer.c) */
PyObject *py_decode_layer(PyObject *self, PyObject *args);
PyObject *py_moe_stream(PyObject *self, PyObject *args);
PyObject *py_delta_rows(PyObject *self, PyObject *args);          /* csrc/py_delta.c */
PyObject *py_decode_delta_layer(PyObject *self, PyObject *args);
PyObject *py_decode_conv_layer(PyObject *self, PyObject *args);
PyObject *py_decode_mla_layer(PyObject *self, PyObject *args);
PyObject *py_moe_ffn(PyObject *self, PyObject *args);
PyObject *py_dequantize(PyObject *self, PyObject *args);

static PyObject *py_features(PyObject *self, PyObject *noargs) {
    int omp = 0, maxt = 1;
#ifdef _OPENMP
    omp = 1; maxt = omp_get_max_threads();
#endif
    return Py_BuildValue("{s:O,s:O,s:O,s:i,s:i}", "avx2_fma", g_avx2 ? Py_True : Py_False,
                         "avx512_vnni", g_avx512 ? Py_True : Py_False,
                         "openmp", omp ? Py_True : Py_False, "max_threads", maxt, "threads", default_threads);
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    default_threads = n;
    Py_RETURN_NONE;
}

#ifdef KILN_X86
/* AVX-512 VNNI for the K-quant prefill kernels: when the CPU (and the OS, which libgcc's check
 * asks) has it, unless KILN_SIMD=avx2 asks for the AVX2 kernels (the same bits either way) */
static int avx512_wanted(void) {
    const char *want = getenv("KILN_SIMD");
    if (want && strcmp(want, "avx2") == 0) return 0;
    return g_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

static PyObject *py_set_simd(PyObject *self, PyObject *args) {  /* for tests: force the portable path */
    int on, wide = 1;          /* wide: the AVX-512 kernels too, where the CPU has them */
    if (!PyArg_ParseTuple(args, "p|p", &on, &wide)) return NULL;
#ifdef KILN_X86
    g_avx2 = on && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    g_avx512 = on && wide && avx512_wanted();
#endif
    return PyBool_FromLong(g_avx2);
}

/* quantize(x float32 (rows, n), out, type, rows, n, threads): rows as llama.cpp's quantizer writes
 * them without an importance matrix (csrc/quantize.c). */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
    Py_buffer xb, ob; int type, threads; long long rows, n;
    if (!PyArg_ParseTuple(args, "y*w*iLLi", &xb, &ob, &type, &rows, &n, &threads)) return NULL;
    PyObject *ret = NULL;
    int64_t rb = n > 0 ? quantized_row_bytes(type, n) : 0;
    if (!rb || rows < 0) { PyErr_Format(PyExc_ValueError, "quantize: type %d cannot hold rows of %lld values", type, n); goto done; }
    if ((size_t)xb.len < (size_t)rows * n * 4 || (size_t)ob.len < (size_t)rows * rb) {
        PyErr_SetString(PyExc_ValueError, "quantize: a buffer is smaller than its rows"); goto done;
    }
    int nt = pick_threads(threads);
    Py_BEGIN_ALLOW_THREADS
    quantize_rows(type, (const float *)xb.buf, rows, n, (uint8_t *)ob.buf, nt);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&ob);
    return ret;
}

static PyMethodDef methods[] = {
    {"quantize", py_quantize, METH_VARARGS, "quantize(x, out, type, rows, n, threads): rows as llama.cpp's quantizer writes them"},
    {"matmul", py_matmul, METH_VARARGS, "matmul(x, w, type, T, K, N, out, threads)"},
    {"matmul_many", py_matmul_many, METH_VARARGS, "matmul_many(x, type, T, K, [(w, N, out), ...], threads)"},
    {"decode_layer", py_decode_layer, METH_VARARGS, "one decode step of B sequences through a plain llama layer, in place"},
    {"decode_conv_layer", py_decode_conv_layer, METH_VARARGS, "one decode step of B sequences through an LFM2 short-conv layer and its FFN, in place"},
    {"decode_mla_layer", py_decode_mla_layer, METH_VARARGS, "one decode step of B sequences through a deepseek2 latent-attention layer and its FFN, in place"},
    {"decode_delta_layer", py_decode_delta_layer, METH_VARARGS, "one decode step of B sequences through a gated delta-net layer and its FFN, in place"},
    {"delta_rows", py_delta_rows, METH_VARARGS, "delta_rows(spec, dims, eps, mixed, z, beta, alpha, runs, out, threads): sequences' rows through a delta net"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(blocks, type, out): Q4_0/Q4_1/Q8_0 to float32 as gguf-py; False: another type"},
    {"moe_ffn", py_moe_ffn, METH_VARARGS, "moe_ffn(x, experts, weights, wg, wu, gu_type, wd, wd_type, n_ff, E, out, threads): a prompt's routed FFN"},
    {"moe_stream", py_moe_stream, METH_VARARGS, "moe_stream(x, ffn_norm, eps, gu_type, wd_type, n_ff, sel, wsel, ptrs, done, dn, threads) -> left"},
    {"route", py_route, METH_VARARGS, "route(logits, T, E, k, normalize, experts_out, weights_out[, rule])"},
    {"kv_store", py_kv_store, METH_VARARGS, "kv_store(x, out, type, R, D): rows as a KV cache of that type stores them"},
    {"kv_load", py_kv_load, METH_VARARGS, "kv_load(x, out, type, R, D): KV cache rows widened to float32"},
    {"attention", py_attention, METH_VARARGS, "attention(q, k, v, out, T, H, Hkv, d, S, start, threads)"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, w, out, T, n, eps)"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cos, sin, T, H, D, R, neox) in place"},
    {"rope_table", py_rope_table, METH_VARARGS, "rope_table(n, half, base, freq_scale, factors, cos, sin[, ext, corr0, corr1, mscale[, p0]])"},
    {"encoder_attention", py_encoder_attention, METH_VARARGS, "encoder_attention(q, k, v, out, n, H, D, scale, threads)"},
    {"layer_norm", py_layer_norm, METH_VARARGS, "layer_norm(x, w, b, out, T, n, eps): ggml_norm times w plus b"},
    {"gelu", py_gelu, METH_VARARGS, "gelu(x, table): ggml's fp16-table GELU, in place"},
    {"expf", py_expf, METH_VARARGS, "expf(x) in place, the C library's"},
    {"swiglu", py_swiglu, METH_VARARGS, "swiglu(gate, up): gate = silu(gate) * up, in place"},
    {"sigmoid", py_sigmoid, METH_VARARGS, "sigmoid(x): 1 / (1 + exp(-x)) in place, exp as ggml's vector expf"},
    {"features", py_features, METH_NOARGS, "CPU features and threading of this build"},
    {"set_threads", py_set_threads, METH_VARARGS, "default thread count (0: OpenMP's)"},
    {"set_simd", py_set_simd, METH_VARARGS, "enable/disable the AVX2 paths; returns whether they are on"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Kiln's compiled kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef KILN_X86
    __builtin_cpu_init();
    g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    g_avx512 = avx512_wanted();
#endif
    return PyModule_Create(&module);
}
