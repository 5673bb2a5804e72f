/* memhog MIB [SUMFILE]: hold MIB MiB of anonymous memory filled with data that compresses about as
 * well as an interpreter's heap (a quarter of each page random, the rest repeated text), write its
 * checksum to SUMFILE, then on every SIGUSR1 re-read all of it and write the checksum again (to
 * SUMFILE.check). Built static by the density tests so it runs in a busybox sandbox. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t check;
static void on_usr1(int s) { (void)s; check = 1; }

static uint64_t sum(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;  /* FNV-1a over 8-byte words */
    const uint64_t *w = (const uint64_t *)p;
    for (size_t i = 0; i < n / 8; i++) h = (h ^ w[i]) * 1099511628211ULL;
    return h;
}

static void put(const char *path, uint64_t h) {
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) exit(2);
    fprintf(f, "%016llx\n", (unsigned long long)h);
    fclose(f);
    rename(tmp, path);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    size_t n = (size_t)atol(argv[1]) << 20;
    const char *out = argc > 2 ? argv[2] : "/tmp/memhog.sum";
    unsigned char *p = malloc(n);
    if (!p) return 3;
    static const char text[] = "def handler(request, context):\n    return {'status': 200, 'body': None}\n";
    uint64_t x = 88172645463325252ULL ^ (uint64_t)getpid();
    for (size_t off = 0; off < n; off += 4096) {
        for (size_t i = 0; i < 1024; i += 8) {  /* xorshift64: incompressible quarter */
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            memcpy(p + off + i, &x, 8);
        }
        for (size_t i = 1024; i < 4096; i++) p[off + i] = (unsigned char)text[(i + off / 4096) % (sizeof text - 1)];
    }
    signal(SIGUSR1, on_usr1);
    put(out, sum(p, n));
    char chk[512];
    snprintf(chk, sizeof chk, "%s.check", out);
    for (;;) {
        pause();
        if (check) { check = 0; put(chk, sum(p, n)); }
    }
}
