/* Stored blocks to float32, as gguf-py's dequantize computes them (the same products and sums,
 * each rounded alone), for the types whose blocks are a scale and codes: Q4_0, Q4_1, Q8_0. A
 * training job's dense copy of the 135M model took ~1 s in gguf-py's grouped numpy passes; an
 * embedding row looked up each step went through them too. Registered by ../_kernels.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kiln.h"

static void dequantize_block(int type, const uint8_t *b, float *y) {
    const float d = fp16_to_fp32((uint16_t)(b[0] | b[1] << 8));
    switch (type) {
    case T_Q4_0:                              /* d * (q - 8): low nibbles, then high */
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((int)(b[2 + j] & 0x0f) - 8);
            y[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
        }
        break;
    case T_Q4_1: {                            /* d * q + m, the product rounded before the sum */
        const float m = fp16_to_fp32((uint16_t)(b[2] | b[3] << 8));
        for (int j = 0; j < 16; j++) {
            float lo = d * (float)(b[4 + j] & 0x0f), hi = d * (float)(b[4 + j] >> 4);
            y[j] = lo + m;
            y[j + 16] = hi + m;
        }
        break;
    }
    case T_Q8_0:
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
}

/* dequantize(blocks (uint8, rows x row bytes), type, out float32 (rows x n)) -> bool: False when
 * the type is not one of these (the caller uses gguf-py). */
PyObject *py_dequantize(PyObject *self, PyObject *args) {
    Py_buffer bb, ob;
    int type;
    if (!PyArg_ParseTuple(args, "y*iw*", &bb, &type, &ob)) return NULL;
    PyObject *ret = NULL;
    const int bytes = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : 0;
    if (!bytes) { ret = Py_False; Py_INCREF(ret); goto done; }
    const Py_ssize_t blocks = bb.len / bytes;
    if (bb.len % bytes || ob.len != blocks * 32 * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "dequantize: the output is not 32 floats per block of the input");
        goto done;
    }
    const uint8_t *src = bb.buf;
    float *dst = ob.buf;
    Py_BEGIN_ALLOW_THREADS
    #pragma omp parallel for schedule(static) if(blocks > 4096)
    for (Py_ssize_t i = 0; i < blocks; i++) dequantize_block(type, src + i * bytes, dst + i * 32);
    Py_END_ALLOW_THREADS
    ret = Py_True; Py_INCREF(ret);
done:
    PyBuffer_Release(&bb); PyBuffer_Release(&ob);
    return ret;
}
