/* The extension's elementwise pieces: GELU, expf, SwiGLU, sigmoid over float32 buffers in place.
 * Registered by ../_kernels.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kiln.h"

/* gelu(x in place, table (65536 float32)): ggml's table GELU */
PyObject *py_gelu(PyObject *self, PyObject *args) {
    Py_buffer xb, tb;
    if (!PyArg_ParseTuple(args, "w*y*", &xb, &tb)) return NULL;
    PyObject *ret = NULL;
    if ((size_t)tb.len < 65536 * 4) { PyErr_SetString(PyExc_ValueError, "gelu: the table needs 65536 floats"); goto done; }
    Py_BEGIN_ALLOW_THREADS
    gelu_rows(xb.buf, (size_t)xb.len / 4, tb.buf);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&tb);
    return ret;
}

/* f over a writable float32 buffer, in place, the GIL released */
static PyObject *in_place(PyObject *args, void (*f)(float *, size_t)) {
    Py_buffer xb;
    if (!PyArg_ParseTuple(args, "w*", &xb)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    f(xb.buf, (size_t)xb.len / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    Py_RETURN_NONE;
}

static void expf_all(float *x, size_t n) { for (size_t i = 0; i < n; i++) x[i] = expf(x[i]); }

/* expf(x (n) in place): the C library's expf element by element — what ggml's scalar code calls
 * (sigmoid, swiglu-oai, the attention sinks) — without a Python call per element */
PyObject *py_expf(PyObject *self, PyObject *args) { return in_place(args, expf_all); }

/* sigmoid(x (n) in place): 1 / (1 + e^-x), e^-x by ggml's vector expf for every element
 * (layer_rows.c sigmoid_row) — the one-call decode's gates compute it so */
PyObject *py_sigmoid(PyObject *self, PyObject *args) { return in_place(args, sigmoid_row); }

/* swiglu(gate (n) in place, up (n)): gate = silu(gate) * up */
PyObject *py_swiglu(PyObject *self, PyObject *args) {
    Py_buffer gb, ub;
    if (!PyArg_ParseTuple(args, "w*y*", &gb, &ub)) return NULL;
    PyObject *ret = NULL;
    if (gb.len != ub.len) { PyErr_SetString(PyExc_ValueError, "swiglu: shapes differ"); goto done; }
    swiglu_row(gb.buf, ub.buf, (size_t)gb.len / 4);
    Py_INCREF(Py_None); ret = Py_None;
done:
    PyBuffer_Release(&gb); PyBuffer_Release(&ub);
    return ret;
}
