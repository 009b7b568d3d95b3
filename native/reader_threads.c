/* The expert cache's reader, its working half: the priority heap of chunks, the threads that
 * `pread` them without the GIL, and completions (the Python type: native/_reader.c). */
#include "reader.h"

double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void depth_changes(Reader *r, int by) {          /* under mu: the time at the old depth is over */
    double t = now();
    if (r->inflight) r->depth_s[(r->inflight < DEPTHS ? r->inflight : DEPTHS) - 1] += t - r->depth_since;
    else r->busy_since = t;
    r->depth_since = t;
    r->inflight += by;
    if (!r->inflight) r->busy_s += t - r->busy_since;
}

/* -- the heap (lowest priority, then oldest, on top); all under mu -------------------------- */

static int before(const Entry *a, const Entry *b) {
    return a->prio < b->prio || (a->prio == b->prio && a->seq < b->seq);
}

int heap_push(Reader *r, int prio, int gen, int chunk) {
    if (r->heap_n == r->heap_cap) {
        int cap = r->heap_cap * 2;
        Entry *h = realloc(r->heap, sizeof(Entry) * cap);
        if (!h) return -1;
        r->heap = h; r->heap_cap = cap;
    }
    int i = r->heap_n++;
    r->heap[i] = (Entry){prio, gen, r->seq++, chunk};
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!before(&r->heap[i], &r->heap[p])) break;
        Entry t = r->heap[i]; r->heap[i] = r->heap[p]; r->heap[p] = t;
        i = p;
    }
    return 0;
}

static Entry heap_pop(Reader *r) {
    Entry top = r->heap[0];
    r->heap[0] = r->heap[--r->heap_n];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < r->heap_n && before(&r->heap[l], &r->heap[m])) m = l;
        if (l + 1 < r->heap_n && before(&r->heap[l + 1], &r->heap[m])) m = l + 1;
        if (m == i) break;
        Entry t = r->heap[i]; r->heap[i] = r->heap[m]; r->heap[m] = t;
        i = m;
    }
    return top;
}

/* -- completion --------------------------------------------------------------------------- */

void finished(Reader *r, int slot, int n) {      /* n chunks of the read are over */
    Read *rd = &r->reads[slot];
    rd->left -= n;
    if (rd->left > 0) return;
    int err = rd->err ? rd->err : rd->cancelled ? ECANCELED : 0;
    if (r->done_n == r->done_cap) {                    /* a slot read again before its completion was
                                                          collected: keep both, in order */
        Done *d = malloc(sizeof(Done) * r->done_cap * 2);
        if (d) {
            for (int i = 0; i < r->done_n; i++) d[i] = r->done[(r->done_head + i) % r->done_cap];
            free(r->done);
            r->done = d; r->done_head = 0; r->done_cap *= 2;
        } else {
            r->done_head = (r->done_head + 1) % r->done_cap;   /* out of memory: the oldest goes */
            r->done_n--;
        }
    }
    r->done[(r->done_head + r->done_n) % r->done_cap] = (Done){slot, rd->gen, err, rd->err_offset};
    r->done_n++;
    rd->active = 0;
    pthread_cond_broadcast(&r->done_cv);
}

int skip_untaken(Reader *r, int slot) {          /* chunks no thread has taken: counted over */
    Read *rd = &r->reads[slot];
    int skipped = 0;
    for (int c = rd->first; c < rd->first + rd->n; c++)
        if (!r->chunks[c].taken) { r->chunks[c].taken = 1; skipped++; }
    return skipped;
}

/* -- the threads ---------------------------------------------------------------------------- */

/* A fault covering the chunk (a simulated disk): its error, its delay; delay < 0 holds the chunk
 * until the faults are cleared (a gate for tests). Called with mu held. */
static int fault_at(Reader *r, const Chunk *c, int buffered, double *delay, int *hold) {
    int err = 0;
    *delay = 0; *hold = 0;
    for (int i = 0; i < r->nfaults; i++)
        if (c->offset < r->faults[i].end && r->faults[i].start < c->offset + c->size) {
            if (r->faults[i].direct_only && buffered) continue;
            if (r->faults[i].err && !err) err = r->faults[i].err;
            if (r->faults[i].delay < 0) *hold = 1;
            else if (r->faults[i].delay > *delay) *delay = r->faults[i].delay;
        }
    return err;
}

static int read_chunk(Reader *r, const Chunk *c, int fd, int buffered, int64_t *got_out, int64_t *err_at) {
    double delay;
    int hold;
    pthread_mutex_lock(&r->mu);
    int err = fault_at(r, c, buffered, &delay, &hold);
    while (hold) {
        pthread_cond_wait(&r->held, &r->mu);
        err = fault_at(r, c, buffered, &delay, &hold);
    }
    pthread_mutex_unlock(&r->mu);
    if (delay > 0) {
        struct timespec t = {(time_t)delay, (long)((delay - (time_t)delay) * 1e9)};
        while (nanosleep(&t, &t) && errno == EINTR) {}
    }
    if (err) *err_at = c->offset;
    if (err) return err;
    int64_t got = 0;
    while (got < c->size) {
        ssize_t n = fd < 0 ? (errno = EBADF, -1) : pread(fd, c->dest + got, (size_t)(c->size - got), PART_OFFSET(c->offset) + got);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err_at = c->offset + got;
            return errno;
        }
        if (n == 0) break;                                /* the end of the file */
        got += n;
    }
    *got_out = got;
    if (got < c->need) { *err_at = c->offset + got; return EIO; }
    if (buffered) posix_fadvise(fd, PART_OFFSET(c->offset), c->size, POSIX_FADV_DONTNEED);
    return 0;
}

void *thread_main(void *arg) {
    Reader *r = arg;
    pthread_setname_np(pthread_self(), "kiln-expert-io");   /* for ps, top, py-spy */
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && r->heap_n == 0) pthread_cond_wait(&r->work, &r->mu);
        if (r->stop) break;
        Entry e = heap_pop(r);
        Chunk *c = &r->chunks[e.chunk];
        /* skipped (cancelled, failed), taken through a hurried copy, or left by an earlier read of the slot */
        if (c->taken || r->reads[c->read].gen != e.gen) continue;
        c->taken = 1;
        depth_changes(r, 1);
        int64_t part = c->offset >> PART_SHIFT;
        int fd = part < r->nfds ? r->fds[part] : -1, buffered = r->buffered;
        pthread_mutex_unlock(&r->mu);
        int64_t got = 0, err_at = -1;
        int err = read_chunk(r, c, fd, buffered, &got, &err_at);
        pthread_mutex_lock(&r->mu);
        r->bytes += got;
        depth_changes(r, -1);
        Read *rd = &r->reads[c->read];
        int n = 1;
        if (err && !rd->err) {                            /* the rest of this read is not worth reading */
            rd->err = err; rd->err_offset = err_at;
            n += skip_untaken(r, c->read);
        }
        finished(r, c->read, n);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

