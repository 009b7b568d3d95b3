/* The one-call bindings' shared arguments (py_layer_args.c): the buffers a call holds while it
 * runs, the FFN tuple, the LoRA table. */
#ifndef KILN_PY_LAYER_H
#define KILN_PY_LAYER_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kiln.h"

#define MAX_BATCH 64
typedef struct { Py_buffer b[2 * MAX_BATCH + 40]; int n; } Held;    /* each row's K and V (or states), and the layer's */

Py_buffer *hold(Held *h, PyObject *o, int writable);
/* A KV cache array as the kernels read it (KvView): shape (positions, Hkv, elements) whose Hkv rows
 * at a position are row_bytes each, any positive strides between positions and between heads, a
 * row's elements contiguous — kv_cache.py's head-major buffers seen position-first, or a plain C
 * array. Returns the positions it holds; -1: a Python error set, naming `who`. */
Py_ssize_t kv_view_arg(Held *h, PyObject *o, int writable, int Hkv, size_t row_bytes, KvView *v, const char *who);
/* ffn: None (the caller runs the FFN), a dense SwiGLU (ffn_norm, wg, wu, gu_type, wd, wd_type, n_ff),
 * or a routed one (ffn_norm, router F32 (E, n), wg_exps, wu_exps, gu_type, wd_exps, wd_type, n_ff,
 * E, k, normalize, route[, expert table, chosen, chosen weights]); L->n set. 0: a Python error set. */
int ffn_arg(Held *h, PyObject *ffn_obj, LayerSpec *L, int B);
/* route: None (the plain rule) or (selection bias F32 (E) or None, sigmoid, groups, groups_used, scale)
 * — layer.h's RouteRule, checked against E and k. 0: an error set, naming `who`. */
int route_rule_arg(Held *h, PyObject *o, int E, int k, RouteRule *rr, const char *who);
/* B x LORA_TARGETS LoraPair (native/runners.py lora_table); after ffn_arg. 0: an error set. */
int lora_arg(Held *h, PyObject *lorao, LayerSpec *L, int B);
/* the routed FFN's shared expert: (sh_gate F32 (n) or None: ungated, wg, wu, gu_type, wd, wd_type, sh_ff) or None; after
 * ffn_arg (and the gpt-oss biases). 0: an error set. */
int shared_arg(Held *h, PyObject *sho, LayerSpec *L);
/* [(kcache, vcache, pos), ...B] with cos/sin (B, R/2): each row's KV views (L->Hkv heads of L->D values of
 * types L->kt/L->vt) and position, checked; NULL: an error set, naming `who` (free the rows) */
DecodeRow *rows_arg(Held *h, PyObject *seqs, Py_buffer *cb, Py_buffer *sb, const LayerSpec *L, int B, const char *who);
/* The FFN, adapters and shared expert after a mixer with a call of its own (decode_layer's forms; lorao
 * None: no adapters): 0 with the error set, naming `who` and the mixer (`what`), when one is not what it
 * may be — streamed experts, or an adapter on an attention projection the mixer does not have */
/* 1 to MAX_BATCH rows and the AVX2 kernels: 0 with the error set, naming `who`, if not */
int batch_ok(const char *who, int B);
int mixer_ffn_args(Held *h, const char *who, const char *what, PyObject *ffn_obj, PyObject *lorao,
                   PyObject *sho, LayerSpec *L, int B);
#endif
