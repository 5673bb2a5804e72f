/* Tries, from inside a sandbox, what the sandbox must forbid and prints NAME=errno-name (OK if it
 * succeeded). Built statically by the security tests and placed in a layer, so it runs in any image.
 *
 *   probe [NAME]                 the fixed list below (or one entry of it)
 *   probe sweep ALLOWED MAX      every syscall number 0..MAX not in ALLOWED (comma separated), each
 *                                called with zero arguments in a child: "sweep:NR=ERRNO"
 *   probe target PID             attach to / read the memory of PID (a pid learned outside)
 *   probe sockets PATH...        try to connect to every Unix socket it can name: "connect:WHAT=..."
 *   probe read PATH...           try to open and read each path directly and via /proc/N/root
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/io_uring.h>
#include <linux/perf_event.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

static void report(const char *name, long rc) {
    if (rc < 0) printf("%s=%s\n", name, strerrorname_np(errno));
    else printf("%s=OK\n", name);
    fflush(stdout);
}

static void *thread_fn(void *arg) { return arg; }

/* A child that just waits: a process of our own, same uid, same PID namespace, our descendant.
 * Without seccomp, root may ptrace it and read its memory; only the filter stands in the way. */
static pid_t spawn_sleeper(void) {
    pid_t p = fork();
    if (p == 0) {
        for (;;) pause();
    }
    usleep(20000);
    return p;
}

static long read_memory(pid_t pid, long *word) {
    struct iovec local = {word, sizeof *word}, remote = {(void *)&report, sizeof *word};
    return syscall(SYS_process_vm_readv, pid, &local, 1, &remote, 1, 0);
}

static long write_memory(pid_t pid) {
    long word = 0;
    struct iovec local = {&word, sizeof word}, remote = {(void *)&word, sizeof word};
    return syscall(SYS_process_vm_writev, pid, &local, 1, &remote, 1, 0);
}

/* PTRACE_TRACEME in a child: should it work, the probe itself must not end up traced */
static long traceme_in_child(void) {
    pid_t p = fork();
    if (p == 0) _exit(ptrace(PTRACE_TRACEME, 0, 0, 0) < 0 ? errno : 0);
    int st;
    waitpid(p, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st)) { errno = WEXITSTATUS(st); return -1; }
    return 0;
}

static int fixed_list(const char *only) {
#define TRY(name, expr) if (!only || !strcmp(only, name)) { errno = 0; report(name, (long)(expr)); }
    TRY("mount", mount("tmpfs", "/tmp", "tmpfs", 0, NULL));
    TRY("umount", umount2("/proc", MNT_DETACH));
    TRY("unshare_user", unshare(CLONE_NEWUSER));
    TRY("unshare_mnt", unshare(CLONE_NEWNS));
    TRY("clone_newuser", syscall(SYS_clone, CLONE_NEWUSER | 17, 0, 0, 0, 0));
    TRY("clone3", syscall(SYS_clone3, NULL, 0));
    TRY("ptrace_init", ptrace(PTRACE_ATTACH, 1, 0, 0));
    TRY("ptrace_traceme", traceme_in_child());
    pid_t child = spawn_sleeper();
    long word = 0;
    TRY("ptrace_own_child", ptrace(PTRACE_ATTACH, child, 0, 0));
    TRY("ptrace_seize_own_child", ptrace(PTRACE_SEIZE, child, 0, 0));
    TRY("process_vm_readv_own_child", read_memory(child, &word));
    TRY("process_vm_writev_own_child", write_memory(child));
    TRY("kcmp_own_child", syscall(SYS_kcmp, getpid(), child, 0 /* KCMP_FILE */, 0, 0));
    int pidfd = (int)syscall(SYS_pidfd_open, child, 0);
    TRY("pidfd_getfd_own_child", syscall(SYS_pidfd_getfd, pidfd, 0, 0));
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    struct io_uring_params up;
    memset(&up, 0, sizeof up);
    TRY("io_uring_setup", syscall(SYS_io_uring_setup, 4, &up));
    TRY("io_uring_enter", syscall(SYS_io_uring_enter, 0, 1, 0, 0, NULL, 0));
    TRY("io_uring_register", syscall(SYS_io_uring_register, 0, 0, NULL, 0));
    TRY("userfaultfd", syscall(SYS_userfaultfd, 0));
    TRY("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0));
    TRY("init_module", syscall(SYS_init_module, "", 0, ""));
    TRY("finit_module", syscall(SYS_finit_module, 0, "", 0));
    TRY("delete_module", syscall(SYS_delete_module, "ext4", 0));
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    TRY("bpf", syscall(SYS_bpf, BPF_MAP_CREATE, &attr, sizeof attr));
    TRY("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3, 0));
    TRY("add_key", syscall(SYS_add_key, "user", "k", "v", 1, -3));
    struct perf_event_attr pe;
    memset(&pe, 0, sizeof pe);
    pe.size = sizeof pe;
    pe.type = PERF_TYPE_SOFTWARE;
    TRY("perf_event_open", syscall(SYS_perf_event_open, &pe, 0, -1, -1, 0));
    int fd = open("/tmp/probe-ioctl", O_RDWR | O_CREAT, 0600);
    char buf[256] = {0};
    TRY("ioctl_xfs_swapext", ioctl(fd, 0xc0c0586d, buf));
    TRY("ioctl_ficlone", ioctl(fd, 0x40049409, 0));
    TRY("ioctl_tiocsti", ioctl(0, 0x5412, "x"));
    TRY("open_by_handle_at", syscall(SYS_open_by_handle_at, AT_FDCWD, buf, O_RDONLY));
    TRY("raw_socket", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    TRY("setns", syscall(SYS_setns, 0, 0));
    TRY("reboot", syscall(SYS_reboot, 0xfee1dead, 672274793, 0x4321FEDC, 0));
    TRY("swapon", syscall(SYS_swapon, "/tmp/probe-ioctl", 0));
    TRY("mknod_dev", mknod("/tmp/sda", 0060600, makedev(8, 0)));
    TRY("sethostname", sethostname("renamed", 7)); /* needs CAP_SYS_ADMIN, which is dropped */
    TRY("personality_query", syscall(SYS_personality, 0xffffffffUL));
    TRY("personality_no_aslr", syscall(SYS_personality, 0x0040000UL /* ADDR_NO_RANDOMIZE */));
    TRY("personality_linux32", syscall(SYS_personality, 0x0008UL /* PER_LINUX32 */));
    TRY("prctl_memory_merge", syscall(SYS_prctl, 67UL /* PR_SET_MEMORY_MERGE */, 1UL, 0UL, 0UL, 0UL));
    {
        static char page[8192] __attribute__((aligned(4096)));
        TRY("madvise_mergeable", syscall(SYS_madvise, page, 4096UL, 12UL /* MADV_MERGEABLE */));
        TRY("madvise_dontneed", syscall(SYS_madvise, page, 4096UL, 4UL /* MADV_DONTNEED: still allowed */));
    }
    TRY("unknown_syscall", syscall(1000, 0, 0, 0, 0, 0, 0)); /* not on any list: ENOSYS */
#if defined(__x86_64__)
    TRY("x32_getpid", syscall(0x40000000 | SYS_getpid));
#endif
    /* controls: ordinary calls still work, and threads do (glibc tries clone3 first, then clone) */
    TRY("socket_inet_ok", socket(AF_INET, SOCK_STREAM, 0));
    pthread_t th;
    int terr = pthread_create(&th, NULL, thread_fn, NULL);
    if (!terr) pthread_join(th, NULL);
    errno = terr;
    TRY("pthread_ok", terr ? -1 : 0);
    return 0;
}

/* Every number in 0..max that is not allowed, with all-zero arguments, each in its own child so
 * that a call which (wrongly) ran cannot disturb the next. The exit status carries the errno. */
static int sweep(const char *allowed_csv, long max) {
    char *allowed = calloc((size_t)max + 1, 1);
    for (const char *p = allowed_csv; *p;) {
        long nr = strtol(p, (char **)&p, 10);
        if (nr >= 0 && nr <= max) allowed[nr] = 1;
        if (*p == ',') p++;
        else if (*p) return 2;
    }
    for (long nr = 0; nr <= max; nr++) {
        if (allowed[nr]) continue;
        pid_t p = fork();
        if (p == 0) {
            alarm(5); /* a wrongly allowed call that blocks must not hang the sweep */
            errno = 0;
            long rc = syscall(nr, 0, 0, 0, 0, 0, 0);
            _exit(rc < 0 ? (errno & 0xff) : 255);
        }
        int st;
        waitpid(p, &st, 0);
        if (WIFSIGNALED(st)) printf("sweep:%ld=SIG%s\n", nr, sigabbrev_np(WTERMSIG(st)));
        else if (WEXITSTATUS(st) == 255) printf("sweep:%ld=OK\n", nr);
        else printf("sweep:%ld=%s\n", nr, strerrorname_np(WEXITSTATUS(st)));
    }
#if defined(__x86_64__)
    /* the i386 ABI through int 0x80: getpid (20) must kill the process, not run */
    pid_t p = fork();
    if (p == 0) {
        long rc;
        __asm__ volatile("int $0x80" : "=a"(rc) : "a"(20) : "memory");
        _exit(rc < 0 ? (int)(-rc & 0xff) : 255);
    }
    int st;
    waitpid(p, &st, 0);
    if (WIFSIGNALED(st)) printf("int80_getpid=SIG%s\n", sigabbrev_np(WTERMSIG(st)));
    else printf("int80_getpid=%s\n", WEXITSTATUS(st) == 255 ? "OK" : strerrorname_np(WEXITSTATUS(st)));
#endif
    fflush(stdout);
    return 0;
}

/* A process outside the sandbox, named by a pid the test learned on the host. */
static int target(pid_t pid) {
    long word = 0;
    char path[64];
    errno = 0;
    report("target_kill0", kill(pid, 0)); /* allowed call: only the PID namespace hides the pid */
    report("target_ptrace_attach", ptrace(PTRACE_ATTACH, pid, 0, 0));
    report("target_ptrace_seize", ptrace(PTRACE_SEIZE, pid, 0, 0));
    report("target_process_vm_readv", read_memory(pid, &word));
    report("target_process_vm_writev", write_memory(pid));
    report("target_kcmp", syscall(SYS_kcmp, getpid(), pid, 0, 0, 0));
    snprintf(path, sizeof path, "/proc/%d/mem", pid);
    report("target_proc_mem", open(path, O_RDONLY));
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    report("target_pidfd_open", pidfd);
    report("target_pidfd_getfd", syscall(SYS_pidfd_getfd, pidfd < 0 ? 0 : pidfd, 0, 0));
    return 0;
}

static int n_tried;

static void try_connect(const char *what, const struct sockaddr_un *sa, socklen_t len) {
    static const int types[] = {SOCK_STREAM, SOCK_SEQPACKET, SOCK_DGRAM};
    static const char *tnames[] = {"stream", "seqpacket", "dgram"};
    for (int i = 0; i < 3; i++) {
        int s = socket(AF_UNIX, types[i] | SOCK_CLOEXEC, 0);
        if (s < 0) continue;
        n_tried++;
        errno = 0;
        int rc = connect(s, (const struct sockaddr *)sa, len);
        printf("connect:%s:%s=%s\n", tnames[i], what, rc == 0 ? "OK" : strerrorname_np(errno));
        close(s);
    }
}

static void try_path(const char *path) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        /* too long for sun_path: reach it through an O_PATH fd, as an attacker would */
        int fd = open(path, O_PATH);
        if (fd < 0) { printf("connect:open:%s=%s\n", path, strerrorname_np(errno)); return; }
        snprintf(sa.sun_path, sizeof sa.sun_path, "/proc/self/fd/%d", fd);
        try_connect(path, &sa, sizeof sa);
        close(fd);
        return;
    }
    strcpy(sa.sun_path, path);
    try_connect(path, &sa, sizeof sa);
}

static void walk(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (!d || depth > 12) { if (d) closedir(d); return; }
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", strcmp(dir, "/") ? dir : "", de->d_name);
        if (depth == 0 && (!strcmp(de->d_name, "proc") || !strcmp(de->d_name, "sys"))) continue;
        struct stat st;
        if (lstat(p, &st) < 0) continue;
        if (S_ISSOCK(st.st_mode)) try_path(p);
        else if (S_ISDIR(st.st_mode)) walk(p, depth + 1);
    }
    closedir(d);
}

/* Every Unix socket this process can name: the paths it is given (host paths the test knows),
 * the same through each /proc/N/root, every socket file on the filesystem, every path and
 * abstract name in /proc/net/unix, and every socket fd it holds or can see in /proc/N/fd. */
static int sockets(int n, char **paths) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    /* control: a socket of our own, so a connect that should work does */
    int own = socket(AF_UNIX, SOCK_STREAM, 0);
    memcpy(sa.sun_path, "\0probe-own", 10);
    bind(own, (struct sockaddr *)&sa, offsetof(struct sockaddr_un, sun_path) + 10);
    listen(own, 8);
    try_connect("control-abstract", &sa, offsetof(struct sockaddr_un, sun_path) + 10);

    for (int i = 0; i < n; i++) {
        try_path(paths[i]);
        /* the same path as an abstract name, in case a daemon binds both */
        memset(sa.sun_path, 0, sizeof sa.sun_path);
        size_t l = strlen(paths[i]);
        if (l > sizeof sa.sun_path - 1) l = sizeof sa.sun_path - 1;
        memcpy(sa.sun_path + 1, paths[i], l);
        char what[4200];
        snprintf(what, sizeof what, "abstract:%s", paths[i]);
        try_connect(what, &sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + l));
    }
    DIR *proc = opendir("/proc");
    struct dirent *de;
    while (proc && (de = readdir(proc))) {
        if (de->d_name[0] < '1' || de->d_name[0] > '9') continue;
        char p[4200];
        for (int i = 0; i < n; i++) {
            snprintf(p, sizeof p, "/proc/%s/root%s", de->d_name, paths[i]);
            try_path(p);
        }
        /* fds of every process: sockets show as socket:[inode]; connecting needs a path, but
         * /proc/N/fd/M of a listening socket is what an attacker would try */
        snprintf(p, sizeof p, "/proc/%s/fd", de->d_name);
        DIR *fdd = opendir(p);
        if (!fdd) { printf("fds:%s=%s\n", de->d_name, strerrorname_np(errno)); continue; }
        struct dirent *fe;
        int link_err = 0;
        while ((fe = readdir(fdd))) {
            if (fe->d_name[0] == '.') continue;
            char fp[4300], target[256];
            snprintf(fp, sizeof fp, "%s/%s", p, fe->d_name);
            ssize_t r = readlink(fp, target, sizeof target - 1);
            if (r <= 0) {
                if (!link_err++) printf("fdlink:%s=%s\n", de->d_name, strerrorname_np(errno));
                continue;
            }
            target[r] = 0;
            if (strncmp(target, "socket:", 7) == 0) {
                printf("socketfd:%s=%s\n", fp, target);
                try_path(fp);
            }
        }
        closedir(fdd);
    }
    if (proc) closedir(proc);
    /* our own fds: anything inherited that is a connected socket could talk to the host */
    for (int fd = 0; fd < 1024; fd++) {
        if (fd == own) continue;
        int type;
        socklen_t tl = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0) printf("inherited_socket:%d=type%d\n", fd, type);
    }
    walk("/", 0);
    FILE *f = fopen("/proc/net/unix", "r");
    char line[1024];
    while (f && fgets(line, sizeof line, f)) {
        char *name = strrchr(line, ' ');
        if (!name || strchr(line, ':') == NULL || strstr(line, "Num")) continue;
        name++;
        name[strcspn(name, "\n")] = 0;
        if (!*name) continue;
        if (name[0] == '@') {
            if (!strcmp(name + 1, "probe-own")) continue;
            memset(sa.sun_path, 0, sizeof sa.sun_path);
            size_t l = strlen(name + 1);
            if (l > sizeof sa.sun_path - 1) l = sizeof sa.sun_path - 1;
            memcpy(sa.sun_path + 1, name + 1, l);
            try_connect(name, &sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + l));
        } else {
            try_path(name);
        }
    }
    if (f) fclose(f);
    printf("tried=%d\n", n_tried);
    return 0;
}

/* Open and read each path, directly and through /proc/N/root of every visible process. */
static int read_paths(int n, char **paths) {
    char buf[64];
    DIR *proc = opendir("/proc");
    struct dirent *de;
    char roots[256][32];
    int n_roots = 0;
    while (proc && (de = readdir(proc)) && n_roots < 256) {
        if (de->d_name[0] < '1' || de->d_name[0] > '9') continue;
        snprintf(roots[n_roots++], sizeof roots[0], "/proc/%s/root", de->d_name);
    }
    if (proc) closedir(proc);
    for (int i = 0; i < n; i++) {
        for (int r = -1; r < n_roots; r++) {
            char p[4200];
            snprintf(p, sizeof p, "%s%s", r < 0 ? "" : roots[r], paths[i]);
            int fd = open(p, O_RDONLY);
            if (fd < 0) { printf("read:%s=%s\n", p, strerrorname_np(errno)); continue; }
            ssize_t got = read(fd, buf, sizeof buf);
            printf("read:%s=%s\n", p, got >= 0 ? "OK" : strerrorname_np(errno));
            close(fd);
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "sweep")) return argc == 4 ? sweep(argv[2], atol(argv[3])) : 2;
    if (argc > 1 && !strcmp(argv[1], "target")) return argc == 3 ? target((pid_t)atoi(argv[2])) : 2;
    if (argc > 1 && !strcmp(argv[1], "sockets")) return sockets(argc - 2, argv + 2);
    if (argc > 1 && !strcmp(argv[1], "read")) return read_paths(argc - 2, argv + 2);
    return fixed_list(argc > 1 ? argv[1] : NULL);
}
