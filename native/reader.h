/* The expert cache's reader (native/_reader.c: the Python type; native/reader_threads.c: the
 * heap of chunks, the threads that read them, completions): what both halves share. */
#ifndef KILN_READER_H
#define KILN_READER_H
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { int64_t offset, size, need; char *dest; int read; int taken; } Chunk;
typedef struct { int prio, gen; uint64_t seq; int chunk; } Entry;
typedef struct { int active, gen, left, cancelled, err, prio, first, n; int64_t err_offset; } Read;
typedef struct { int slot, gen, err; int64_t err_offset; } Done;
typedef struct { int64_t start, end; int err, direct_only; double delay; } Fault;

#define MAX_FAULTS 16
/* A read's offset is a split model's part number above bit 44 and the offset in that file below
 * (16 TiB a file): the queue, the chunking and the faults work on the one number. */
#define PART_SHIFT 44
#define MAX_PARTS 64
#define PART_OFFSET(o) ((o) & (((int64_t)1 << PART_SHIFT) - 1))
#define DEPTHS 8

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work, done_cv, held;
    pthread_t *threads;
    int nthreads, stop, buffered;
    int fds[MAX_PARTS], nfds;   /* a split model's files; an offset's high bits say which (PART_SHIFT) */
    int slots, max_chunks;
    int64_t chunk_bytes;
    Read *reads;            /* one per slot */
    Chunk *chunks;          /* slots * max_chunks */
    Entry *heap;
    int heap_n, heap_cap;
    uint64_t seq;
    Done *done;             /* completions not yet collected: a ring */
    int done_head, done_n, done_cap;
    int64_t bytes;
    int inflight;
    double busy_s, busy_since;
    double depth_s[DEPTHS], depth_since;   /* seconds with 1, 2, ... chunks in flight (the last: or more) */
    Fault faults[MAX_FAULTS];
    int nfaults;
} Reader;

double now(void);
int heap_push(Reader *r, int prio, int gen, int chunk);       /* under mu */
void finished(Reader *r, int slot, int n);                    /* under mu: n chunks of a read are over */
int skip_untaken(Reader *r, int slot);                        /* under mu */
void *thread_main(void *arg);
#endif
