/* The lazy daemon's fast path for warm reads (shoal.lazy.fastread).
 *
 * Worker threads of the Python FUSE server call lazy_fast_serve() (through ctypes, so without the
 * GIL). It reads requests from /dev/fuse and answers a READ itself when every chunk the read spans
 * has a descriptor in the table (chunks the Python side has verified and registered): one pread
 * per chunk into a per-thread buffer, one writev to /dev/fuse. Any other request (a READ of a chunk
 * not registered, LOOKUP, INIT, ...) is copied to the caller's buffer and returned to Python.
 *
 * The table only grows: a descriptor, once set, stays open and valid for the daemon's life (chunk
 * files are immutable and content-addressed: an evicted chunk's open file still holds its verified
 * bytes), so a reader never sees a descriptor closed or reused under it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define FUSE_READ 15
#define MAX_NODES 65536
#define IN_HDR 40
#define OUT_HDR 16

struct node {
    uint64_t size;
    uint64_t chunk_size;
    uint32_t nchunks;
    int32_t *fds; /* -1: not registered */
};

/* One per FUSE server; never freed (its worker threads may hold it until the process exits). */
struct table {
    struct node *nodes[MAX_NODES];
    size_t reply_cap;
    uint64_t fast_reads; /* answered here (statistics) */
    int hints;           /* posix_fadvise(WILLNEED) of a READ's chunk files and the next span's */
};

static __thread char *reply_buf;
static __thread size_t reply_buf_cap;

struct table *lazy_fast_new(size_t max_read) {
    struct table *t = calloc(1, sizeof *t);
    if (t) {
        t->reply_cap = max_read;
        t->hints = 1;
    }
    return t;
}

void lazy_fast_hints(struct table *t, int on) { t->hints = on; }

/* Register node `ino` (a file of `size` bytes in chunks of `chunk_size`). Idempotent. */
int lazy_fast_node(struct table *t, uint64_t ino, uint64_t size, uint64_t chunk_size) {
    if (ino >= MAX_NODES || chunk_size == 0) return -EINVAL;
    if (__atomic_load_n(&t->nodes[ino], __ATOMIC_ACQUIRE)) return 0;
    struct node *n = calloc(1, sizeof *n);
    if (!n) return -ENOMEM;
    n->size = size;
    n->chunk_size = chunk_size;
    n->nchunks = (uint32_t)((size + chunk_size - 1) / chunk_size);
    n->fds = malloc(sizeof(int32_t) * (n->nchunks ? n->nchunks : 1));
    if (!n->fds) { free(n); return -ENOMEM; }
    for (uint32_t i = 0; i < n->nchunks; i++) n->fds[i] = -1;
    struct node *expected = NULL;
    if (!__atomic_compare_exchange_n(&t->nodes[ino], &expected, n, 0, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
        free(n->fds);
        free(n);
    }
    return 0;
}

/* Chunk `idx` of node `ino` is readable (verified) through `fd`, which stays open from now on.
 * Returns 1 when set now, 0 when it was set already (the caller may close its fd), <0 on error. */
int lazy_fast_chunk(struct table *t, uint64_t ino, uint32_t idx, int fd) {
    if (ino >= MAX_NODES) return -EINVAL;
    struct node *n = __atomic_load_n(&t->nodes[ino], __ATOMIC_ACQUIRE);
    if (!n || idx >= n->nchunks) return -EINVAL;
    int32_t expected = -1;
    return __atomic_compare_exchange_n(&n->fds[idx], &expected, fd, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED) ? 1 : 0;
}

uint64_t lazy_fast_reads(struct table *t) { return __atomic_load_n(&t->fast_reads, __ATOMIC_RELAXED); }

static void reply_error(int dev, uint64_t unique, int err) {
    char hdr[OUT_HDR];
    uint32_t len = OUT_HDR;
    int32_t e = -err;
    memcpy(hdr, &len, 4);
    memcpy(hdr + 4, &e, 4);
    memcpy(hdr + 8, &unique, 8);
    ssize_t r = write(dev, hdr, OUT_HDR);
    (void)r;
}

/* 1: answered; 0: not here (Python answers). */
static int try_read(struct table *t, int dev, const char *req, size_t len) {
    if (len < IN_HDR + 24) return 0;
    uint64_t unique, ino, offset;
    uint32_t size;
    memcpy(&unique, req + 8, 8);
    memcpy(&ino, req + 16, 8);
    memcpy(&offset, req + IN_HDR + 8, 8);
    memcpy(&size, req + IN_HDR + 16, 4);
    if (ino >= MAX_NODES) return 0;
    struct node *n = __atomic_load_n(&t->nodes[ino], __ATOMIC_ACQUIRE);
    if (!n || size > t->reply_cap) return 0;
    if (offset >= n->size) size = 0;
    else if (offset + size > n->size) size = (uint32_t)(n->size - offset);
    uint64_t first = size ? offset / n->chunk_size : 0, last = size ? (offset + size - 1) / n->chunk_size : 0;
    if (size) {
        for (uint64_t c = first; c <= last; c++)
            if (__atomic_load_n(&n->fds[c], __ATOMIC_ACQUIRE) < 0) return 0;
    }
    if (reply_buf_cap < t->reply_cap) {
        free(reply_buf);
        reply_buf_cap = 0;
        if (!(reply_buf = malloc(t->reply_cap + OUT_HDR))) return 0;
        reply_buf_cap = t->reply_cap;
    }
    char *data = reply_buf + OUT_HDR;
    size_t got = 0;
    if (size && last > first && t->hints) {
        /* the chunk files of one READ are separate files: start all their disk reads now, so the
         * preads below wait for one round of I/O instead of one per chunk (a cold page cache) */
        for (uint64_t c = first; c <= last; c++) {
            uint64_t cs = c * n->chunk_size;
            uint64_t lo = c == first ? offset - cs : 0;
            uint64_t hi = c == last ? offset + size - cs : n->chunk_size;
            (void)posix_fadvise(__atomic_load_n(&n->fds[c], __ATOMIC_ACQUIRE), (off_t)lo, (off_t)(hi - lo),
                                POSIX_FADV_WILLNEED);
        }
        /* a streaming read (the kernel's read-ahead sends spans of several chunks): the chunks of the
         * next span too, so their I/O overlaps this reply and the reader's next request */
        uint64_t span = last - first + 1;
        for (uint64_t c = last + 1; c <= last + span && c < n->nchunks; c++) {
            int fd = __atomic_load_n(&n->fds[c], __ATOMIC_ACQUIRE);
            if (fd >= 0) (void)posix_fadvise(fd, 0, (off_t)n->chunk_size, POSIX_FADV_WILLNEED);
        }
    }
    for (uint64_t c = first; size && c <= last; c++) {
        uint64_t cstart = c * n->chunk_size;
        uint64_t lo = offset + got - cstart;
        uint64_t want = n->chunk_size - lo;
        if (want > size - got) want = size - got;
        int fd = __atomic_load_n(&n->fds[c], __ATOMIC_ACQUIRE);
        size_t done = 0;
        while (done < want) {
            ssize_t r = pread(fd, data + got + done, want - done, (off_t)(lo + done));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) { reply_error(dev, unique, EIO); return 1; } /* a short chunk file: never zeros */
            done += (size_t)r;
        }
        got += want;
    }
    uint32_t olen = (uint32_t)(OUT_HDR + got);
    int32_t zero = 0;
    memcpy(reply_buf, &olen, 4);
    memcpy(reply_buf + 4, &zero, 4);
    memcpy(reply_buf + 8, &unique, 8);
    /* counted before the reply: the reader wakes on the write and may look at the count at once
     * (a count after it raced tests/lazy/test_fastread.py on a loaded host) */
    __atomic_add_fetch(&t->fast_reads, 1, __ATOMIC_RELAXED);
    ssize_t w = write(dev, reply_buf, olen);
    (void)w; /* ENOENT: the reader was interrupted and went away */
    return 1;
}

/* Serve READs of registered chunks; return the length of the first request Python must answer
 * (copied into buf), or -errno (ENODEV: unmounted). */
ssize_t lazy_fast_serve(struct table *t, int dev, char *buf, size_t buflen) {
    for (;;) {
        ssize_t n = read(dev, buf, buflen);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT) continue;
            return -errno;
        }
        if ((size_t)n >= IN_HDR) {
            uint32_t opcode;
            memcpy(&opcode, buf + 4, 4);
            if (opcode == FUSE_READ && try_read(t, dev, buf, (size_t)n)) continue;
        }
        return n;
    }
}
