/* kiln.native._reader: the expert cache's disk reads, on threads that never take the GIL.
 *
 * Why C: reads ran on Python threads, and each had to take the GIL back between two reads — so
 * while the forward ran Python glue, a finished read waited up to the interpreter's switch
 * interval before the next one started (measured: a 0.5 ms interval instead of 5 ms made a 25 %
 * streamed decode 4-8 % faster), and the threads' own Python cost ~6 ms of CPU per token that
 * the two vCPUs' compute needed. Here the threads take chunks from a priority heap under one
 * mutex and `pread` them; the forward's thread submits, hurries and cancels reads and collects
 * their completions (`poll`, which waits without the GIL).
 *
 * A read fills one cache slot: its parts (aligned file spans, each with the bytes that must be
 * there) are cut into chunks of `chunk_bytes`, so a read the forward waits for overtakes a guess
 * within a chunk, not after a whole expert. A read completes once no chunk of it runs any more:
 * with 0, the first error (and the file offset it happened at), or ECANCELED — never while a
 * chunk may still write into the slot. Ordering: lowest priority first, then submission order.
 *
 * `fault(start, end, errno, delay, direct_only)` simulates the disk's failures (an error, a slow
 * range, O_DIRECT refused; a negative delay holds the read until the faults are cleared) for
 * tests: a healthy disk cannot be made to fail, or stall, on purpose. */
#include "reader.h"

/* -- the Python type ------------------------------------------------------------------------ */

static int check_slot(Reader *r, int slot) {
    if (slot < 0 || slot >= r->slots) { PyErr_Format(PyExc_IndexError, "slot %d out of 0..%d", slot, r->slots - 1); return 0; }
    if (!r->threads) { PyErr_SetString(PyExc_RuntimeError, "the reader is closed"); return 0; }
    return 1;
}

/* fd: one file descriptor, or a sequence of them (a split model's parts, in order) */
static int set_fds(Reader *r, PyObject *fd) {
    int fds[MAX_PARTS], n = 0;
    if (PyLong_Check(fd)) {
        fds[n++] = (int)PyLong_AsLong(fd);
    } else {
        PyObject *seq = PySequence_Fast(fd, "fd must be an int or a sequence of ints");
        if (!seq) return 0;
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
        if (len < 1 || len > MAX_PARTS) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "%zd files: a reader reads 1 to %d", len, MAX_PARTS);
            return 0;
        }
        for (Py_ssize_t i = 0; i < len; i++) fds[n++] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        Py_DECREF(seq);
    }
    if (PyErr_Occurred()) return 0;
    memcpy(r->fds, fds, sizeof(int) * n);
    r->nfds = n;
    return 1;
}

static int Reader_init(Reader *r, PyObject *args, PyObject *kw) {
    static char *names[] = {"threads", "fd", "buffered", "slots", "max_chunks", "chunk_bytes", NULL};
    int threads, buffered, slots, max_chunks;
    PyObject *fd;
    long long chunk_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOpiiL", names, &threads, &fd, &buffered, &slots, &max_chunks, &chunk_bytes))
        return -1;
    if (!set_fds(r, fd)) return -1;
    if (threads < 1 || slots < 1 || max_chunks < 1 || chunk_bytes < 512) {
        PyErr_SetString(PyExc_ValueError, "threads, slots and max_chunks must be >= 1, chunk_bytes >= 512");
        return -1;
    }
    r->buffered = buffered; r->slots = slots; r->max_chunks = max_chunks; r->chunk_bytes = chunk_bytes;
    r->reads = calloc(slots, sizeof(Read));
    r->chunks = calloc((size_t)slots * max_chunks, sizeof(Chunk));
    r->heap_cap = 64;
    r->heap = malloc(sizeof(Entry) * r->heap_cap);
    r->done_cap = slots;                                  /* one per slot, grown if ever needed */
    r->done = malloc(sizeof(Done) * r->done_cap);
    r->threads = calloc(threads, sizeof(pthread_t));
    if (!r->reads || !r->chunks || !r->heap || !r->done || !r->threads) { PyErr_NoMemory(); return -1; }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->done_cv, NULL);
    pthread_cond_init(&r->held, NULL);
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&r->threads[i], NULL, thread_main, r)) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        r->nthreads++;
    }
    return 0;
}

static void stop_threads(Reader *r) {
    if (!r->threads) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    r->nfaults = 0;                                       /* nothing stays held */
    pthread_cond_broadcast(&r->work);
    pthread_cond_broadcast(&r->held);
    pthread_mutex_unlock(&r->mu);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < r->nthreads; i++) pthread_join(r->threads[i], NULL);
    Py_END_ALLOW_THREADS
    free(r->threads);
    r->threads = NULL;
}

static void Reader_dealloc(Reader *r) {
    stop_threads(r);
    free(r->reads); free(r->chunks); free(r->heap); free(r->done);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Reader_submit(Reader *r, PyObject *args) {
    int slot, prio;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "iiO!", &slot, &prio, &PyList_Type, &parts) || !check_slot(r, slot)) return NULL;
    int first = slot * r->max_chunks, n = 0;
    Chunk staged[r->max_chunks];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parts); i++) {
        long long off, size, need;
        unsigned long long dest;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(parts, i), "LLLK", &off, &size, &need, &dest)) return NULL;
        for (int64_t at = 0; at < size; at += r->chunk_bytes) {
            if (n == r->max_chunks) { PyErr_Format(PyExc_ValueError, "a read of more than %d chunks", r->max_chunks); return NULL; }
            int64_t len = size - at < r->chunk_bytes ? size - at : r->chunk_bytes;
            int64_t nd = need - at < 0 ? 0 : need - at > len ? len : need - at;
            staged[n++] = (Chunk){off + at, len, nd, (char *)(uintptr_t)dest + at, slot, 0};
        }
    }
    pthread_mutex_lock(&r->mu);
    Read *rd = &r->reads[slot];
    if (rd->active) {
        pthread_mutex_unlock(&r->mu);
        return PyErr_Format(PyExc_RuntimeError, "slot %d has a read in flight", slot);
    }
    int gen = rd->gen + 1;
    *rd = (Read){1, gen, n, 0, 0, prio, first, n, -1};
    int failed = 0;
    for (int i = 0; i < n; i++) {
        r->chunks[first + i] = staged[i];
        failed |= heap_push(r, prio, gen, first + i);
    }
    if (failed) {                                         /* out of memory: the read fails as a read */
        rd->err = ENOMEM;
        finished(r, slot, skip_untaken(r, slot));
    } else if (n == 0) {
        rd->left = 1;
        finished(r, slot, 1);
    }
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLong(gen);
}

static PyObject *Reader_hurry(Reader *r, PyObject *args) {
    int slot, prio, moved = 0;
    if (!PyArg_ParseTuple(args, "ii", &slot, &prio) || !check_slot(r, slot)) return NULL;
    pthread_mutex_lock(&r->mu);
    Read *rd = &r->reads[slot];
    if (rd->active && !rd->cancelled && prio < rd->prio) {
        rd->prio = prio;
        for (int c = rd->first; c < rd->first + rd->n; c++)
            if (!r->chunks[c].taken) { heap_push(r, prio, rd->gen, c); moved++; }   /* the old entry is skipped */
        pthread_cond_broadcast(&r->work);
    }
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLong(moved);
}

static PyObject *Reader_cancel(Reader *r, PyObject *args) {
    int slot, started = 0;
    if (!PyArg_ParseTuple(args, "i", &slot) || !check_slot(r, slot)) return NULL;
    pthread_mutex_lock(&r->mu);
    Read *rd = &r->reads[slot];
    if (rd->active && !rd->cancelled) {
        rd->cancelled = 1;
        int skipped = skip_untaken(r, slot);
        started = rd->n - skipped;
        if (skipped) finished(r, slot, skipped);
    }
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLong(started);
}

static PyObject *Reader_poll(Reader *r, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    pthread_mutex_lock(&r->mu);
    if (r->done_n == 0 && timeout > 0) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        double t = until.tv_sec + until.tv_nsec * 1e-9 + timeout;
        until.tv_sec = (time_t)t; until.tv_nsec = (long)((t - (time_t)t) * 1e9);
        Py_BEGIN_ALLOW_THREADS
        while (r->done_n == 0 && pthread_cond_timedwait(&r->done_cv, &r->mu, &until) != ETIMEDOUT) {}
        Py_END_ALLOW_THREADS
    }
    int n = r->done_n;
    Done *got = malloc(sizeof(Done) * (n > 0 ? n : 1));
    if (!got) { pthread_mutex_unlock(&r->mu); return PyErr_NoMemory(); }
    for (int i = 0; i < n; i++) got[i] = r->done[(r->done_head + i) % r->done_cap];
    r->done_head = (r->done_head + n) % r->done_cap;
    r->done_n = 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *out = PyList_New(n);
    for (int i = 0; out && i < n; i++)
        PyList_SET_ITEM(out, i, Py_BuildValue("(iiiL)", got[i].slot, got[i].gen, got[i].err, (long long)got[i].err_offset));
    free(got);
    return out;
}

static PyObject *Reader_stats(Reader *r, PyObject *noargs) {
    pthread_mutex_lock(&r->mu);
    double t = now(), busy = r->busy_s + (r->inflight ? t - r->busy_since : 0);
    PyObject *depth = PyList_New(DEPTHS);
    for (int i = 0; depth && i < DEPTHS; i++)
        PyList_SET_ITEM(depth, i, PyFloat_FromDouble(r->depth_s[i] + (r->inflight && i == (r->inflight < DEPTHS ? r->inflight : DEPTHS) - 1 ? t - r->depth_since : 0)));
    PyObject *out = depth ? Py_BuildValue("{s:L,s:d,s:i,s:i,s:N}", "bytes", (long long)r->bytes, "busy_seconds", busy,
                                          "chunks_in_flight", r->inflight, "chunks_queued", r->heap_n, "depth_seconds", depth) : NULL;
    pthread_mutex_unlock(&r->mu);
    return out;
}

static PyObject *Reader_set_fd(Reader *r, PyObject *args) {
    PyObject *fd;
    int buffered;
    if (!PyArg_ParseTuple(args, "Op", &fd, &buffered)) return NULL;
    pthread_mutex_lock(&r->mu);
    int ok = set_fds(r, fd);
    if (ok) r->buffered = buffered;
    pthread_mutex_unlock(&r->mu);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reader_fault(Reader *r, PyObject *args) {
    long long start = 0, end = 0;
    int err = 0, direct_only = 0;
    double delay = 0;
    if (!PyArg_ParseTuple(args, "|LLidp", &start, &end, &err, &delay, &direct_only)) return NULL;
    pthread_mutex_lock(&r->mu);
    if (PyTuple_GET_SIZE(args) == 0) r->nfaults = 0;      /* no arguments: the disk is well again */
    else if (r->nfaults < MAX_FAULTS) r->faults[r->nfaults++] = (Fault){start, end, err, direct_only, delay};
    pthread_cond_broadcast(&r->held);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *Reader_close(Reader *r, PyObject *noargs) {
    stop_threads(r);
    Py_RETURN_NONE;
}

static PyMethodDef Reader_methods[] = {
    {"submit", (PyCFunction)Reader_submit, METH_VARARGS, "submit(slot, priority, [(offset, size, need, dest), ...]) -> generation"},
    {"hurry", (PyCFunction)Reader_hurry, METH_VARARGS, "hurry(slot, priority): the chunks not yet taken move ahead"},
    {"cancel", (PyCFunction)Reader_cancel, METH_VARARGS, "cancel(slot) -> chunks already started (they run to the end)"},
    {"poll", (PyCFunction)Reader_poll, METH_VARARGS, "poll(timeout) -> [(slot, generation, errno, error offset)], waiting up to timeout s"},
    {"stats", (PyCFunction)Reader_stats, METH_NOARGS, "bytes read, seconds with a read in flight, chunks running and queued"},
    {"set_fd", (PyCFunction)Reader_set_fd, METH_VARARGS, "set_fd(fd or fds, buffered): reads from now on use these files"},
    {"fault", (PyCFunction)Reader_fault, METH_VARARGS, "fault(start, end, errno, delay, direct_only): simulate a failing or slow range (delay < 0: held until fault()); fault(): none"},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "stop the threads (after their current chunk)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kiln.native._reader.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(threads, fd, buffered, slots, max_chunks, chunk_bytes): prioritised chunked preads into cache slots",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_reader", "The expert cache's disk reads", -1, NULL};

PyMODINIT_FUNC PyInit__reader(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) { Py_DECREF(&ReaderType); Py_DECREF(m); return NULL; }
    return m;
}
