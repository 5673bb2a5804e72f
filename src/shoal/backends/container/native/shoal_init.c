/*
 * shoal-init: the small privileged core of Shoal's container backend.
 *
 * One binary, three roles (bubblewrap-style: each step maps to one kernel feature):
 *
 *   launcher   (the process Python starts)   forks the supervisor, waits for "ready", prints
 *                                            "OK <init_pid> <supervisor_pid> <upper_fd> t=<marks>"
 *                                            (marks: see mark()) and exits.
 *   supervisor (host namespaces, detached)   mounts the size-capped tmpfs that holds the writable
 *                                            upper, clones the sandbox init, puts it in its cgroups,
 *                                            then waits for it to die and releases everything
 *                                            (tmpfs, cgroups, state dir) and writes a tombstone.
 *   init       (PID 1 of new mnt/pid/uts/ipc/net/cgroup namespaces)
 *                                            builds the rootfs (overlayfs over the EROFS layer
 *                                            mounts), pivots into it, hardens itself (capability
 *                                            bounding set, no_new_privs, seccomp, non-dumpable) and
 *                                            then serves exec requests on a SOCK_SEQPACKET socket
 *                                            that lives in a host directory the sandbox cannot see.
 *                                            Every command it forks inherits the hardening.
 *
 * Protocol (little endian; one message per packet; see shoal/runtime/container/agent.py):
 *   client -> init   'E' exec: u8 op, u8 flags, u16 pad, u32 timeout_ms, u32 argc, u32 envc,
 *                              [flags & 4: u16 pty_rows, u16 pty_cols, i32 uid, i32 gid, u32 ngroups,
 *                               u32 groups[ngroups]]
 *                              then cwd\0 argv[i]\0... env[i]\0...; SCM_RIGHTS: stdin, stdout, stderr
 *                              (none with a PTY: rows > 0 runs it on a new PTY of the sandbox's devpts,
 *                              whose master comes back with 'S'; uid >= 0 drops to uid/gid/groups)
 *                    'K' signal: u8 op, u8 mode (0 = process group, 1 = group except leader), i32 sig
 *                    'T' touch: u8 op, u8 busy   (marks this connection busy/idle for the idle TTL)
 *                    'P' ping:  u8 op            (answers 'P' + u32 running commands)
 *                    'L' lifetimes: u8 op, 7 pad, i64 ttl_ms from now (0 none, -1 keep), i64 idle_ttl_ms
 *   init -> client   'S' started: u8 op, 3 pad, i32 pid (pid inside the sandbox); SCM_RIGHTS: the PTY
 *                                master when one was asked for
 *                    'X' exited:  u8 op, u8 timed_out, 2 pad, i32 wait status
 *                    'F' failed:  u8 op, 3 pad, i32 errno, message
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>

#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif

#define MAX_CGROUPS 16
#ifndef TIOCGPTPEER /* Linux 4.13; older headers lack it */
#define TIOCGPTPEER _IO('T', 0x41)
#endif
#ifndef PR_SET_MEMORY_MERGE /* Linux 6.4: KSM for every anonymous mapping of a process, inherited by children */
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif
#define MAX_MSG (256 * 1024)

enum { EXIT_OK = 0, EXIT_SETUP = 70, EXIT_TTL = 71, EXIT_IDLE = 72 };

/* OOM scores (density-oom). The supervisor must outlive its sandbox's processes, so a host-wide OOM
 * picks sandbox processes long before it (and shoald, -900 too). Init and everything under it start at
 * +500; init writes it while it still holds CAP_SYS_RESOURCE, which makes 500 the kernel's floor
 * (oom_score_adj_min) for the whole sandbox: without the capability no process in it can go lower.
 * Commands go a little higher than init, so a sandbox at its own limit loses the command, not init. */
#define SUPERVISOR_OOM_ADJ "-900"
#define SANDBOX_OOM_ADJ "500"
#define COMMAND_OOM_ADJ "600"
enum { OOM_KILL_COMMAND = 0, OOM_KILL_SANDBOX = 1 };

struct config {
    const char *rootfs, *disk, *lower, *sock, *hostname, *state_dir, *tombstone;
    const char *cgroups[MAX_CGROUPS];
    int n_cgroups;
    long disk_mb, shm_mb;
    long long ttl_ms, idle_ttl_ms;
    int host_net; /* builds only: keep the host network namespace (package registries reachable) */
    const char *ca_bundle; /* builds only: host CA bundle, bound read-only at /run/shoal-build/ca.crt */
    int upper_mounted; /* --upper mounted: the caller mounted a disk-backed fs on disk/ (no tmpfs) */
    const char *sysfs; /* --sysfs DIR: a read-only sysfs template to bind at /sys (see sysfs_template) */
    int upper_detached; /* the upper (disk/) is a detached mount held on UPPER_FD, not in the host namespace */
    const char *empty_dir; /* --empty-dir DIR: the host's empty read-only tmpfs, bound over masked /proc dirs */
    const char *mntns; /* --mntns FILE: the host's template mount namespace (see mntns_template) */
    int ksm;           /* --ksm 1: every process of the sandbox is KSM-mergeable (create option ksm) */
    int no_aslr;       /* --aslr 0: processes exec'd in the sandbox get ADDR_NO_RANDOMIZE (aslr=False) */
    const char *memory_cgroup; /* --memory-cgroup: the sandbox's memory cgroup, watched for OOM kills */
    int oom_kill;              /* --oom-kill command|sandbox: what an OOM kill inside the sandbox ends */
    /* --memory-pooled 1: memory_cgroup is a pool shared with other sandboxes (cgroups.py, pooled memory
     * cgroups): its OOM kills may be a neighbour's, so they never end this sandbox from here */
    int memory_pooled;
    const char *join_cgroup;   /* --join-cgroup DIR: joined like --cgroup but never removed (the v1 pool) */
};

static struct config cfg;
static char **g_argv; /* scrubbed in init so /proc/1/cmdline shows no host paths */
static int status_fd = -1; /* init -> supervisor: "+<init's marks>" on success, error text on failure */
static int ready_out_fd = -1; /* supervisor -> launcher: "OK ..." or "ERR ..." */

static void die(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 64, fmt, ap);
    va_end(ap);
    if (errno) n += snprintf(buf + n, sizeof buf - n, ": %s", strerror(errno));
    if (status_fd >= 0) {
        ssize_t w = write(status_fd, buf, (size_t)n);
        (void)w;
    } else if (ready_out_fd >= 0) {
        dprintf(ready_out_fd, "ERR %s\n", buf);
    } else {
        fprintf(stderr, "shoal-init: %s\n", buf);
    }
    _exit(EXIT_SETUP);
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Launch phases: CLOCK_MONOTONIC microseconds at each step of a launch, reported on the "OK" line as
 * "t=name:us,..." so the runtime can say where a slow create spent its time (docs/density.md, "The
 * create tail"). Each process keeps its own copy (fork/clone copy it): the launcher's first mark
 * reaches the supervisor, and init sends the marks it adds back on the status pipe. */
#define MAX_MARKS 24
static struct { const char *name; long long us; } marks[MAX_MARKS];
static int n_marks;

static void mark(const char *name) {
    struct timespec ts;
    if (n_marks == MAX_MARKS) return;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    marks[n_marks].name = name;
    marks[n_marks++].us = (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* "name:us,name:us" of marks[from..]; "" when there are none */
static void format_marks(char *out, size_t len, int from) {
    size_t n = 0;
    out[0] = 0;
    for (int i = from; i < n_marks && n < len; i++) {
        int w = snprintf(out + n, len - n, "%s%s:%lld", i > from ? "," : "", marks[i].name, marks[i].us);
        if (w < 0 || (size_t)w >= len - n) { out[n] = 0; break; }
        n += (size_t)w;
    }
}

static int write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, data, strlen(data));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(data) ? 0 : -1;
}

/* ------------------------------------------------------------------------------------------ */
/* rootfs                                                                                      */

/* The writable upper (tmpfs, or the caller's ext4) is kept out of the host mount namespace: with one
 * mount per live sandbox there, every clone(CLONE_NEWNS) copies all of them and the new init then
 * detaches them again (copy_tree, umount_tree): O(N) per create. The supervisor holds the upper as a
 * detached mount on UPPER_FD (the host reaches it at /proc/<supervisor>/fd/UPPER_FD), and init
 * attaches it in its own namespace only. The new mount API has fixed syscall numbers on every arch. */
#define UPPER_FD 10
#define SH_STR2(x) #x
#define SH_STR(x) SH_STR2(x)
#define SH_SYS_open_tree 428
#define SH_SYS_move_mount 429
#define SH_SYS_fsopen 430
#define SH_SYS_fsconfig 431
#define SH_SYS_fsmount 432
#define SH_FSCONFIG_SET_FLAG 0
#define SH_FSCONFIG_SET_STRING 1
#define SH_FSCONFIG_CMD_CREATE 6
#define SH_MOUNT_ATTR_NOSUID 0x2
#define SH_MOUNT_ATTR_NODEV 0x4
#define SH_MOVE_MOUNT_F_EMPTY_PATH 0x4
#define SH_OPEN_TREE_CLONE 1
#ifndef STATX_ATTR_MOUNT_ROOT
#define STATX_ATTR_MOUNT_ROOT 0x00002000
#endif

static void mount_or_die(const char *src, const char *dst, const char *type, unsigned long flags,
                         const char *data) {
    if (mount(src, dst, type, flags, data) < 0) die("mount %s on %s (%s)", src ? src : "-", dst, type ? type : "bind");
}

static void mkdir_p_in(const char *path, mode_t mode) {
    if (mkdir(path, mode) < 0 && errno != EEXIST) die("mkdir %s", path);
    errno = 0;
}

static int empty_fd = -1;        /* template path: a detached bind of cfg.empty_dir, until first used */
static const char *empty_src;    /* the first masked dir it was attached on (later masks bind that) */

/* Hide a /proc entry: a file gets the sandbox's own dev/null bound over it read-only, a directory an
 * empty read-only tmpfs. Never the host's /dev/null: a bind shares the inode, and the sandbox's root
 * could then chmod or chown the host's /dev/null through /proc/keys (every host program breaks). The
 * read-only bind makes chmod/chown on the masked entry fail with EROFS too. Needs dev/ set up first. */
static void mask_path(const char *path) {
    struct stat st;
    if (stat(path, &st) < 0) { errno = 0; return; }
    if (S_ISDIR(st.st_mode) && (empty_fd >= 0 || empty_src)) { /* template path: the detached bind */
        if (empty_src) {
            mount_or_die(empty_src, path, NULL, MS_BIND, NULL);
        } else {
            if (syscall(SH_SYS_move_mount, empty_fd, "", AT_FDCWD, path, SH_MOVE_MOUNT_F_EMPTY_PATH) < 0)
                die("attach the empty dir on %s", path);
            close(empty_fd);
            empty_fd = -1;
            empty_src = path;
        }
        mount_or_die(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    } else if (S_ISDIR(st.st_mode) && cfg.empty_dir) { /* a bind: no tmpfs superblock per sandbox and dir */
        mount_or_die(cfg.empty_dir, path, NULL, MS_BIND, NULL);
        mount_or_die(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    } else if (S_ISDIR(st.st_mode)) {
        mount_or_die("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0,mode=0555");
    } else {
        mount_or_die("dev/null", path, NULL, MS_BIND, NULL);
        mount_or_die(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, NULL);
    }
}

/* Bind a /proc subtree onto itself read-only (writes to /proc/sys et al. then fail with EROFS). */
static void readonly_path(const char *path) {
    struct stat st;
    if (stat(path, &st) < 0) { errno = 0; return; }
    mount_or_die(path, path, NULL, MS_BIND | MS_REC, NULL);
    mount_or_die(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

static void make_dev(const char *name, unsigned maj, unsigned min) {
    if (mknod(name, S_IFCHR | 0666, makedev(maj, min)) < 0) die("mknod /dev/%s", name);
    chmod(name, 0666); /* umask-proof */
}

/* A size-capped tmpfs that is mounted nowhere: -1 (errno set) where the kernel lacks fsopen (< 5.2). */
static int detached_tmpfs(long size_mb) {
    int fs = (int)syscall(SH_SYS_fsopen, "tmpfs", 1 /* FSOPEN_CLOEXEC */);
    if (fs < 0) return -1;
    char size[32];
    snprintf(size, sizeof size, "%ldm", size_mb);
    int m = -1;
    if (syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_SET_STRING, "size", size, 0) == 0 &&
        syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_SET_STRING, "mode", "0755", 0) == 0 &&
        syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_CMD_CREATE, NULL, NULL, 0) == 0)
        m = (int)syscall(SH_SYS_fsmount, fs, 1 /* FSMOUNT_CLOEXEC */, SH_MOUNT_ATTR_NOSUID | SH_MOUNT_ATTR_NODEV);
    int saved = errno;
    close(fs);
    errno = saved;
    return m;
}

/* Close every fd from 3 up except those in keep[] (sorted ascending, each >= 3). */
static void close_fds_except(const int *keep, int n) {
    unsigned lo = 3;
    for (int i = 0; i < n; i++) {
        if ((unsigned)keep[i] > lo) syscall(SYS_close_range, lo, (unsigned)keep[i] - 1, 0);
        if ((unsigned)keep[i] + 1 > lo) lo = (unsigned)keep[i] + 1;
    }
    syscall(SYS_close_range, lo, ~0U, 0);
}

/* The lower dirs as /proc/self/fd/N paths, each opened O_PATH here (the upper is passed the same way):
 * overlayfs shows its options as given, in the sandbox's own /proc/self/mountinfo, and the layers'
 * host paths would name Shoal's root and its layout there. Closed once the overlay is mounted. */
#define MAX_LOWER 512
static int lower_fds[MAX_LOWER], n_lower_fds;
static const char *lower_fd_paths(void) {
    static char out[MAX_LOWER * 24];
    char *copy = strdup(cfg.lower), *save = NULL;
    size_t len = 0;
    if (!copy) die("strdup");
    out[0] = 0;
    for (char *p = strtok_r(copy, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
        if (n_lower_fds == MAX_LOWER) { errno = 0; die("more than %d lower layers", MAX_LOWER); }
        int fd = open(p, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) die("open lower %s", p);
        lower_fds[n_lower_fds++] = fd;
        len += (size_t)snprintf(out + len, sizeof out - len, "%s/proc/self/fd/%d", len ? ":" : "", fd);
    }
    free(copy);
    return out;
}

static void close_lower_fds(void) {
    for (int i = 0; i < n_lower_fds; i++) close(lower_fds[i]);
    n_lower_fds = 0;
}

/* The upper's directory, attached at cfg.disk (a host path: kernels before 6.15, or no detached
 * upper), as /proc/self/fd/N too, for the same reason as the lower dirs. */
static int disk_fd = -1;
static const char *disk_fd_path(void) {
    static char out[32];
    disk_fd = open(cfg.disk, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (disk_fd < 0) die("open upper %s", cfg.disk);
    snprintf(out, sizeof out, "/proc/self/fd/%d", disk_fd);
    return out;
}

/* The overlay as a detached mount (fsopen/fsmount), made while init is still in the host's mount
 * namespace, where the layers are mounted: -1 (errno set) where this kernel cannot. overlayfs takes
 * layers one at a time ("lowerdir+": fsconfig strings are at most 256 bytes) from Linux 6.8 and a
 * detached upper from 6.15; before that, the caller falls back to the mount in a copy of the host's
 * namespace and pivot_root. Each layer is given as /proc/self/fd/N, as in lower_fd_paths. */
static int detached_overlay(void) {
    /* tried only where it can work: overlayfs logs every refused option to the kernel log */
    struct utsname u;
    int major = 0, minor = 0;
    if (uname(&u) < 0 || sscanf(u.release, "%d.%d", &major, &minor) != 2 || major * 1000 + minor < 6015) {
        errno = ENOTSUP;
        return -1;
    }
    int fs = (int)syscall(SH_SYS_fsopen, "overlay", 1 /* FSOPEN_CLOEXEC */);
    if (fs < 0) return -1;
    char p[64];
    int ok = 1;
    for (int i = 0; ok && i < n_lower_fds; i++) {
        snprintf(p, sizeof p, "/proc/self/fd/%d", lower_fds[i]);
        ok = syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_SET_STRING, "lowerdir+", p, 0) == 0;
    }
    ok = ok && syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_SET_STRING, "upperdir",
                       "/proc/self/fd/" SH_STR(UPPER_FD) "/upper", 0) == 0;
    ok = ok && syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_SET_STRING, "workdir",
                       "/proc/self/fd/" SH_STR(UPPER_FD) "/work", 0) == 0;
    ok = ok && syscall(SH_SYS_fsconfig, fs, SH_FSCONFIG_CMD_CREATE, NULL, NULL, 0) == 0;
    int m = ok ? (int)syscall(SH_SYS_fsmount, fs, 1 /* FSMOUNT_CLOEXEC */, SH_MOUNT_ATTR_NODEV) : -1;
    int saved = errno;
    close(fs);
    errno = saved;
    return m;
}

/* A detached copy of one host mount (a bind that is in no namespace yet), for the template path,
 * where host paths do not resolve any more once init has joined the template. */
static int clone_host_mount(const char *path) {
    return path ? (int)syscall(SH_SYS_open_tree, AT_FDCWD, path, SH_OPEN_TREE_CLONE | O_CLOEXEC) : -1;
}

static void setup_rootfs(void) {
    char path[4096], opts[8192];

    const char *lower = NULL;
    /* The root switch. pivot_root re-points every task on the host whose root or cwd is the old root
     * (chroot_fs_refs walks them all, under tasklist_lock): O(host tasks), and every sandbox adds
     * some. Instead, where the kernel allows, init joins the host's template mount namespace (one
     * empty read-only tmpfs, made once per host by `shoal-init mntns-template`), copies it
     * (unshare: one mount, not the host's whole table), moves the overlay, built detached in the host
     * namespace, onto its "/" and chroots into it: no task walk, and nothing of the host to detach.
     * Outside the overlay there is only the template's empty root, covered by it; ".." at the
     * overlay's root comes back to it (the mount on "/" is crossed again). Builds (host network,
     * CA bundle) bind host files, so they keep the old path. */
    int ovl = -1, tmpl = -1, sys_fd = -1;
    if (cfg.mntns && cfg.upper_detached && !cfg.host_net && !cfg.ca_bundle) {
        tmpl = open(cfg.mntns, O_RDONLY | O_CLOEXEC);
        if (tmpl >= 0) {
            lower_fd_paths(); /* the host namespace's layer mounts, which overlayfs accepts here */
            ovl = detached_overlay();
        }
        if (ovl >= 0 && cfg.sysfs && (sys_fd = clone_host_mount(cfg.sysfs)) < 0) { close(ovl); ovl = -1; }
        if (ovl >= 0 && cfg.empty_dir && (empty_fd = clone_host_mount(cfg.empty_dir)) < 0) { close(ovl); ovl = -1; }
        if (ovl >= 0 && setns(tmpl, CLONE_NEWNS) < 0) { close(ovl); ovl = -1; }
        if (tmpl >= 0) close(tmpl);
        if (ovl < 0) {
            close_lower_fds();
            if (sys_fd >= 0) close(sys_fd);
            if (empty_fd >= 0) close(empty_fd);
            sys_fd = empty_fd = -1;
        }
        errno = 0;
    }
    if (unshare(CLONE_NEWNS) < 0) die("unshare mount ns");
    mount_or_die(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    if (ovl >= 0) {
        if (syscall(SH_SYS_move_mount, ovl, "", AT_FDCWD, "/", SH_MOVE_MOUNT_F_EMPTY_PATH) < 0)
            die("move the overlay onto the template's root");
        if (fchdir(ovl) < 0) die("chdir rootfs");
        close(ovl);
    } else {
        lower = lower_fd_paths(); /* opened in this namespace: overlayfs takes only its own mounts */
        /* overlayfs takes a detached upper by its fd path (Linux >= 6.15 clones a private mount of an
         * anonymous namespace's root); older kernels refuse it: attach it in this namespace instead */
        static const char *fd_disk = "/proc/self/fd/" SH_STR(UPPER_FD);
        const char *disk = cfg.upper_detached ? fd_disk : disk_fd_path();
        int n = snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s/upper,workdir=%s/work", lower, disk, disk);
        if (n >= (int)sizeof opts - 1) { errno = 0; die("overlay options too long (%d layers?)", n); }
        /* nodev (here and on the detached overlay): overlayfs opens a lower layer's special file with
         * the overlay's own flags, and an image (a tenant's native EROFS layer) may carry nodes for
         * host devices (input, GPUs, kvm, uinput); the sandbox's devices live in its own /dev tmpfs */
        if (mount("overlay", cfg.rootfs, "overlay", MS_NODEV, opts) < 0) {
            if (!cfg.upper_detached || errno != EINVAL) die("mount overlay on %s", cfg.rootfs);
            if (syscall(SH_SYS_move_mount, UPPER_FD, "", AT_FDCWD, cfg.disk, SH_MOVE_MOUNT_F_EMPTY_PATH) < 0)
                die("attach the upper on %s", cfg.disk);
            disk = disk_fd_path();
            snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s/upper,workdir=%s/work", lower, disk, disk);
            mount_or_die("overlay", cfg.rootfs, "overlay", MS_NODEV, opts);
        }
        errno = 0;
        if (chdir(cfg.rootfs) < 0) die("chdir rootfs");
    }
    mark("overlay");
    close_lower_fds();
    if (disk_fd >= 0) close(disk_fd);
    close(UPPER_FD);
    errno = 0;

    /* /dev: a small tmpfs with the usual character devices; no host device is reachable. It holds
     * /dev/shm too (a directory bound onto itself, below), not a tmpfs of its own: every superblock
     * registers a memcg-aware shrinker, and each shrinker id widens the shrinker_info of every memory
     * cgroup on the host (about 1 KiB per 64 ids per cgroup), so superblocks per sandbox multiply
     * with sandboxes into kernel memory (docs/density.md). */
    mkdir_p_in("dev", 0755);
    snprintf(opts, sizeof opts, "mode=0755,size=%ldm,nr_inodes=%ld", cfg.shm_mb + 1, 256 + cfg.shm_mb * 256);
    mount_or_die("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, opts);
    if (chdir("dev") < 0) die("chdir dev");
    make_dev("null", 1, 3);
    make_dev("zero", 1, 5);
    make_dev("full", 1, 7);
    make_dev("random", 1, 8);
    make_dev("urandom", 1, 9);
    make_dev("tty", 5, 0);
    mkdir_p_in("pts", 0755);
    mount_or_die("devpts", "pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620");
    if (symlink("pts/ptmx", "ptmx") < 0) die("symlink ptmx");
    mkdir_p_in("shm", 01777);
    if (chmod("shm", 01777) < 0) die("chmod /dev/shm");
    /* its own mount flags on the same superblock: nodev, and exec allowed (shared memory mapped
     * executable: JITs) where the rest of /dev is noexec */
    mount_or_die("shm", "shm", NULL, MS_BIND, NULL);
    mount_or_die(NULL, "shm", NULL, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, NULL);
    if (symlink("/proc/self/fd", "fd") < 0 || symlink("/proc/self/fd/0", "stdin") < 0 ||
        symlink("/proc/self/fd/1", "stdout") < 0 || symlink("/proc/self/fd/2", "stderr") < 0)
        die("symlink /dev/fd");
    if (chdir("..") < 0) die("chdir ..");

    /* /proc: a fresh instance for the new PID namespace, then hide what leaks host state. */
    mkdir_p_in("proc", 0555);
    mount_or_die("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    static const char *masked[] = {"proc/kcore", "proc/kpagecgroup", "proc/kpagecount", "proc/kpageflags",
                                   "proc/kpageidle", "proc/keys", "proc/key-users", "proc/timer_list",
                                   "proc/sched_debug", "proc/latency_stats",
                                   "proc/acpi", "proc/scsi", "proc/driver", "proc/kmsg", "proc/vmallocinfo",
                                   "proc/slabinfo", "proc/pagetypeinfo", "proc/buddyinfo", "proc/mtrr", NULL};
    for (int i = 0; masked[i]; i++) mask_path(masked[i]);
    /* sysrq-trigger is read-only, not masked: /dev/null bound over it would take writes and succeed
     * (a device node ignores a read-only mount), where EROFS says plainly that the write was refused */
    static const char *ro[] = {"proc/sys", "proc/irq", "proc/bus", "proc/fs", "proc/asound", "proc/sysrq-trigger",
                               NULL};
    for (int i = 0; ro[i]; i++) readonly_path(ro[i]);

    /* /sys read-only. With --sysfs: a bind of the host's one template (a sysfs of an empty network
     * namespace, so /sys/class/net shows only `lo`); a fresh sysfs per sandbox would be one superblock
     * per network namespace, and mounting one walks all of them (sget), O(N) in live sandboxes. */
    mkdir_p_in("sys", 0555);
    if (sys_fd >= 0) {
        if (syscall(SH_SYS_move_mount, sys_fd, "", AT_FDCWD, "sys", SH_MOVE_MOUNT_F_EMPTY_PATH) < 0)
            die("attach the sysfs template on /sys");
        close(sys_fd);
        mount_or_die(NULL, "sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    } else if (cfg.sysfs) {
        mount_or_die(cfg.sysfs, "sys", NULL, MS_BIND, NULL);
        mount_or_die(NULL, "sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    } else if (mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) {
        errno = 0;
    }
    mkdir_p_in("tmp", 01777);
    chmod("tmp", 01777);

    /* builds with host networking see the host's resolver config, bound read-only over the image's
     * own file (only if the image has one, so nothing new lands in the writable upper) */
    struct stat rst;
    if (cfg.host_net && stat("etc/resolv.conf", &rst) == 0 && S_ISREG(rst.st_mode) &&
        mount("/etc/resolv.conf", "etc/resolv.conf", NULL, MS_BIND, NULL) == 0)
        mount(NULL, "etc/resolv.conf", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL);
    errno = 0;
    /* builds behind a TLS-intercepting proxy need the host's trust store; it is bound at a path the
     * builder leaves out of layers and points SSL_CERT_FILE & co. at, so no image ever contains it */
    if (cfg.ca_bundle) {
        mkdir_p_in("run", 0755);
        mkdir_p_in("run/shoal-build", 0755);
        int fd = open("run/shoal-build/ca.crt", O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) die("create ca.crt mount point");
        close(fd);
        mount_or_die(cfg.ca_bundle, "run/shoal-build/ca.crt", NULL, MS_BIND, NULL);
        mount_or_die(NULL, "run/shoal-build/ca.crt", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL);
    }

    if (empty_fd >= 0) close(empty_fd); /* no masked directory on this host */
    empty_fd = -1;
    if (ovl >= 0) {
        /* the template path: the overlay already sits on the namespace's "/" (see above) */
        if (chroot(".") < 0) die("chroot");
    } else {
        /* pivot_root(".", ".") stacks the old root under the new one; detaching it leaves no trace, in
         * one umount (one RCU grace period), but it walks every task on the host (chroot_fs_refs) */
        if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root");
        if (umount2(".", MNT_DETACH) < 0) die("detach old root");
    }
    if (chdir("/") < 0) die("chdir /");
    (void)path;
}

static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) die("socket");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) die("SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) die("SIOCSIFFLAGS lo");
    close(s);
}

/* ------------------------------------------------------------------------------------------ */
/* hardening                                                                                   */

/* The capabilities a root process inside the sandbox keeps (Docker's default set minus
 * NET_RAW and MKNOD). Everything else leaves the bounding set, so no exec can regain it. */
static const int keep_caps[] = {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL,
                                CAP_SETGID, CAP_SETUID, CAP_SETPCAP, CAP_NET_BIND_SERVICE,
                                CAP_SYS_CHROOT, CAP_AUDIT_WRITE, CAP_SETFCAP};

static void drop_capabilities(void) {
    uint64_t keep = 0;
    for (size_t i = 0; i < sizeof keep_caps / sizeof keep_caps[0]; i++) keep |= 1ULL << keep_caps[i];
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) die("PR_CAPBSET_DROP %d", cap);
        errno = 0;
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    data[0].effective = data[0].permitted = (uint32_t)keep;
    data[1].effective = data[1].permitted = (uint32_t)(keep >> 32);
    if (syscall(SYS_capset, &hdr, data) < 0) die("capset");
}

#if defined(__x86_64__)
#define SHOAL_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SHOAL_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#error "unsupported architecture"
#endif

/* Calls added after the oldest headers Shoal builds with. From 424 on, every architecture uses
 * the same number (the kernel unified the tables), so one definition serves x86_64 and aarch64. */
#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif
#ifndef SYS_fchmodat2
#define SYS_fchmodat2 452
#endif
#ifndef SYS_map_shadow_stack
#define SYS_map_shadow_stack 453
#endif
#ifndef SYS_futex_wake
#define SYS_futex_wake 454
#endif
#ifndef SYS_futex_wait
#define SYS_futex_wait 455
#endif
#ifndef SYS_futex_requeue
#define SYS_futex_requeue 456
#endif

/* The seccomp allowlist: the calls ordinary workloads make (strace of Python, gcc, git, pip, apt/dpkg,
 * pytest, Node, the JVM, cargo/rustc and Perl finds nothing outside it). A call on neither list,
 * including any the kernel adds later, answers ENOSYS. Kept sorted; the filter sorts by number
 * itself. Calls that still need a capability the sandbox lacks (sethostname, ...) are left to the
 * kernel's own checks. */
static const int allowed_syscalls[] = {
    SYS_accept, SYS_accept4, SYS_bind, SYS_brk, SYS_cachestat, SYS_capget, SYS_capset, SYS_chdir,
    SYS_chroot, SYS_clock_getres, SYS_clock_gettime, SYS_clock_nanosleep, SYS_close, SYS_close_range,
    SYS_connect, SYS_copy_file_range, SYS_dup, SYS_dup3, SYS_epoll_create1, SYS_epoll_ctl,
    SYS_epoll_pwait, SYS_epoll_pwait2, SYS_eventfd2, SYS_execve, SYS_execveat, SYS_exit,
    SYS_exit_group, SYS_faccessat, SYS_faccessat2, SYS_fadvise64, SYS_fallocate, SYS_fchdir,
    SYS_fchmod, SYS_fchmodat, SYS_fchmodat2, SYS_fchown, SYS_fchownat, SYS_fcntl, SYS_fdatasync,
    SYS_fgetxattr, SYS_flistxattr, SYS_flock, SYS_fremovexattr, SYS_fsetxattr, SYS_fstat,
    SYS_fstatfs, SYS_fsync, SYS_ftruncate, SYS_futex, SYS_futex_requeue, SYS_futex_wait,
    SYS_futex_waitv, SYS_futex_wake, SYS_get_mempolicy, SYS_get_robust_list, SYS_getcpu,
    SYS_getcwd, SYS_getdents64, SYS_getegid, SYS_geteuid, SYS_getgid, SYS_getgroups, SYS_getitimer,
    SYS_getpeername, SYS_getpgid, SYS_getpid, SYS_getppid, SYS_getpriority, SYS_getrandom,
    SYS_getresgid, SYS_getresuid, SYS_getrlimit, SYS_getrusage, SYS_getsid, SYS_getsockname,
    SYS_getsockopt, SYS_gettid, SYS_gettimeofday, SYS_getuid, SYS_getxattr, SYS_inotify_add_watch,
    SYS_inotify_init1, SYS_inotify_rm_watch, SYS_io_cancel, SYS_io_destroy, SYS_io_getevents,
    SYS_io_pgetevents, SYS_io_setup, SYS_io_submit, SYS_ioprio_get, SYS_ioprio_set, SYS_kill,
    SYS_landlock_add_rule, SYS_landlock_create_ruleset, SYS_landlock_restrict_self, SYS_lgetxattr,
    SYS_linkat, SYS_listen, SYS_listxattr, SYS_llistxattr, SYS_lremovexattr, SYS_lseek,
    SYS_lsetxattr, SYS_madvise, SYS_map_shadow_stack, SYS_mbind, SYS_membarrier, SYS_memfd_create,
    SYS_mincore, SYS_mkdirat, SYS_mknodat, SYS_mlock, SYS_mlock2, SYS_mlockall, SYS_mmap,
    SYS_mprotect, SYS_mq_getsetattr, SYS_mq_notify, SYS_mq_open, SYS_mq_timedreceive,
    SYS_mq_timedsend, SYS_mq_unlink, SYS_mremap, SYS_msgctl, SYS_msgget, SYS_msgrcv, SYS_msgsnd,
    SYS_msync, SYS_munlock, SYS_munlockall, SYS_munmap, SYS_nanosleep, SYS_newfstatat, SYS_openat,
    SYS_openat2, SYS_pidfd_open, SYS_pidfd_send_signal, SYS_pipe2, SYS_pkey_alloc, SYS_pkey_free,
    SYS_pkey_mprotect, SYS_ppoll, SYS_prctl, SYS_pread64, SYS_preadv, SYS_preadv2, SYS_prlimit64,
    SYS_pselect6, SYS_pwrite64, SYS_pwritev, SYS_pwritev2, SYS_read, SYS_readahead, SYS_readlinkat,
    SYS_readv, SYS_recvfrom, SYS_recvmmsg, SYS_recvmsg, SYS_remap_file_pages, SYS_removexattr,
    SYS_renameat, SYS_renameat2, SYS_restart_syscall, SYS_rseq, SYS_rt_sigaction,
    SYS_rt_sigpending, SYS_rt_sigprocmask, SYS_rt_sigqueueinfo, SYS_rt_sigreturn,
    SYS_rt_sigsuspend, SYS_rt_sigtimedwait, SYS_rt_tgsigqueueinfo, SYS_sched_get_priority_max,
    SYS_sched_get_priority_min, SYS_sched_getaffinity, SYS_sched_getattr, SYS_sched_getparam,
    SYS_sched_getscheduler, SYS_sched_rr_get_interval, SYS_sched_setaffinity, SYS_sched_setattr,
    SYS_sched_setparam, SYS_sched_setscheduler, SYS_sched_yield, SYS_seccomp, SYS_semctl,
    SYS_semget, SYS_semop, SYS_semtimedop, SYS_sendfile, SYS_sendmmsg, SYS_sendmsg, SYS_sendto,
    SYS_set_mempolicy, SYS_set_robust_list, SYS_set_tid_address, SYS_setdomainname, SYS_setfsgid,
    SYS_setfsuid, SYS_setgid, SYS_setgroups, SYS_sethostname, SYS_setitimer, SYS_setpgid,
    SYS_setpriority, SYS_setregid, SYS_setresgid, SYS_setresuid, SYS_setreuid, SYS_setrlimit,
    SYS_setsid, SYS_setsockopt, SYS_setuid, SYS_setxattr, SYS_shmat, SYS_shmctl, SYS_shmdt,
    SYS_shmget, SYS_shutdown, SYS_sigaltstack, SYS_signalfd4, SYS_socket, SYS_socketpair,
    SYS_splice, SYS_statfs, SYS_statx, SYS_symlinkat, SYS_sync, SYS_sync_file_range, SYS_syncfs,
    SYS_sysinfo, SYS_tee, SYS_tgkill, SYS_timer_create, SYS_timer_delete, SYS_timer_getoverrun,
    SYS_timer_gettime, SYS_timer_settime, SYS_timerfd_create, SYS_timerfd_gettime,
    SYS_timerfd_settime, SYS_times, SYS_tkill, SYS_truncate, SYS_umask, SYS_uname, SYS_unlinkat,
    SYS_utimensat, SYS_vmsplice, SYS_wait4, SYS_waitid, SYS_write, SYS_writev,
#if defined(__x86_64__) /* the pre-*at calls and x86 specifics that aarch64 never had */
    SYS_access, SYS_alarm, SYS_arch_prctl, SYS_chmod, SYS_chown, SYS_creat, SYS_dup2,
    SYS_epoll_create, SYS_epoll_wait, SYS_eventfd, SYS_fork, SYS_futimesat, SYS_get_thread_area,
    SYS_getdents, SYS_getpgrp, SYS_inotify_init, SYS_lchown, SYS_link, SYS_lstat, SYS_mkdir,
    SYS_mknod, SYS_open, SYS_pause, SYS_pipe, SYS_poll, SYS_readlink, SYS_rename, SYS_rmdir,
    SYS_select, SYS_set_thread_area, SYS_signalfd, SYS_stat, SYS_symlink, SYS_time, SYS_unlink,
    SYS_utime, SYS_utimes, SYS_vfork,
#endif
};

/* Calls that exist but no sandboxed process may make (EPERM, "not permitted", rather than the
 * ENOSYS of an unknown call): they reach host-global kernel state, other processes' memory, or
 * kernel code with a long record of exploitable bugs (io_uring, bpf, userfaultfd). */
static const int denied_syscalls[] = {
    SYS_acct, SYS_add_key, SYS_adjtimex, SYS_bpf, SYS_clock_adjtime, SYS_clock_settime,
    SYS_delete_module, SYS_fanotify_init, SYS_finit_module, SYS_fsconfig, SYS_fsmount, SYS_fsopen,
    SYS_fspick, SYS_init_module, SYS_io_uring_enter, SYS_io_uring_register, SYS_io_uring_setup,
    SYS_kcmp, SYS_kexec_file_load, SYS_kexec_load, SYS_keyctl, SYS_migrate_pages, SYS_mount,
    SYS_mount_setattr, SYS_move_mount, SYS_move_pages, SYS_name_to_handle_at, SYS_open_by_handle_at,
    SYS_open_tree, SYS_perf_event_open, SYS_pidfd_getfd, SYS_pivot_root,
    SYS_process_madvise, SYS_process_vm_readv, SYS_process_vm_writev, SYS_ptrace, SYS_quotactl,
    SYS_reboot, SYS_request_key, SYS_setns, SYS_settimeofday, SYS_swapoff, SYS_swapon, SYS_syslog,
    SYS_umount2, SYS_userfaultfd, SYS_vhangup,
#ifdef SYS_lookup_dcookie
    SYS_lookup_dcookie,
#endif
#ifdef SYS_quotactl_fd
    SYS_quotactl_fd,
#endif
#if defined(__x86_64__)
    SYS__sysctl, SYS_ioperm, SYS_iopl, SYS_modify_ldt, SYS_sysfs, SYS_uselib, SYS_ustat,
#endif
};

/* ioctl commands (type and number, any size/direction) that move or share extents between
 * files or inject terminal input: XFS_IOC_SWAPEXT, EXT4_IOC_MOVE_EXT, FICLONE, FICLONERANGE,
 * FIDEDUPERANGE, TIOCSTI, TIOCLINUX. */
static const uint32_t denied_ioctls[] = {0x586d, 0x660f, 0x9409, 0x940d, 0x9436, 0x5412, 0x541c};

#define RET_ERRNO(e) (SECCOMP_RET_ERRNO | ((e) & SECCOMP_RET_DATA))
/* Unknown calls answer ENOSYS, not EPERM: every libc reads ENOSYS as "this kernel is older" and
 * falls back (clone3 -> clone, faccessat2 -> faccessat, fchmodat2 -> fchmodat, statx -> fstatat,
 * close_range -> a loop), where EPERM makes programs fail outright on calls newer than this list. */
#define RET_UNKNOWN RET_ERRNO(ENOSYS)
#define RET_DENIED RET_ERRNO(EPERM)

struct seccomp_rule {
    uint32_t nr, action;
};

static int rule_cmp(const void *a, const void *b) {
    uint32_t x = ((const struct seccomp_rule *)a)->nr, y = ((const struct seccomp_rule *)b)->nr;
    return x < y ? -1 : x > y;
}

#define N_ALLOWED (sizeof allowed_syscalls / sizeof allowed_syscalls[0])
#define N_DENIED (sizeof denied_syscalls / sizeof denied_syscalls[0])
#define N_RULES (N_ALLOWED + N_DENIED)

/* Both lists as (number, action), sorted by number. A call on both lists is a bug in this file. */
static size_t seccomp_rules(struct seccomp_rule *rules) {
    size_t n = 0;
    for (size_t i = 0; i < N_ALLOWED; i++) rules[n++] = (struct seccomp_rule){(uint32_t)allowed_syscalls[i], SECCOMP_RET_ALLOW};
    for (size_t i = 0; i < N_DENIED; i++) rules[n++] = (struct seccomp_rule){(uint32_t)denied_syscalls[i], RET_DENIED};
    qsort(rules, n, sizeof *rules, rule_cmp);
    for (size_t i = 1; i < n; i++) {
        if (rules[i].nr == rules[i - 1].nr) { errno = 0; die("seccomp: syscall %u listed twice", rules[i].nr); }
    }
    return n;
}

#define MAX_INSNS 4096 /* BPF_MAXINSNS */
#define LEAF_RULES 4
#define EMIT(code, k, jt, jf)                                                                   \
    do {                                                                                        \
        if (*n >= MAX_INSNS) { errno = 0; die("seccomp: program too long"); }                   \
        prog[(*n)++] = (struct sock_filter)BPF_JUMP(code, k, jt, jf);                           \
    } while (0)

/* A binary search over the sorted rules: ~log2(N) comparisons per call instead of a linear
 * scan. Each inner node is "JGE pivot ? JA(right) : left"; BPF_JA takes a 32-bit offset, so no
 * jump ever needs more than the 8 bits jt/jf hold, however long the left subtree grows. */
static void emit_search(struct sock_filter *prog, int *n, const struct seccomp_rule *r, size_t lo, size_t hi) {
    if (hi - lo <= LEAF_RULES) {
        for (size_t i = lo; i < hi; i++) {
            EMIT(BPF_JMP | BPF_JEQ | BPF_K, r[i].nr, 0, 1);
            EMIT(BPF_RET | BPF_K, r[i].action, 0, 0);
        }
        EMIT(BPF_RET | BPF_K, RET_UNKNOWN, 0, 0);
        return;
    }
    size_t mid = lo + (hi - lo) / 2;
    EMIT(BPF_JMP | BPF_JGE | BPF_K, r[mid].nr, 0, 1);
    int ja = *n;
    EMIT(BPF_JMP | BPF_JA, 0, 0, 0);
    emit_search(prog, n, r, lo, mid);
    prog[ja].k = (uint32_t)(*n - ja - 1);
    emit_search(prog, n, r, mid, hi);
}

static int build_seccomp(struct sock_filter *prog) {
    int count = 0, *n = &count;
    const size_t n_ioctl = sizeof denied_ioctls / sizeof denied_ioctls[0];
    static struct seccomp_rule rules[N_RULES];
    size_t n_rules = seccomp_rules(rules);

    /* a foreign ABI (32-bit int 0x80 on x86_64, AArch32 on arm64) kills the process */
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch), 0, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SHOAL_AUDIT_ARCH, 1, 0);
    EMIT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS, 0, 0);
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr), 0, 0);
#if defined(__x86_64__)
    /* x32 calls share AUDIT_ARCH_X86_64 and set bit 30 of the number: none is allowed */
    EMIT(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1);
    EMIT(BPF_RET | BPF_K, RET_DENIED, 0, 0);
#endif
    /* clone3 passes flags in memory that seccomp cannot read: ENOSYS makes libc fall back to clone */
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 0, 1);
    EMIT(BPF_RET | BPF_K, RET_ERRNO(ENOSYS), 0, 0);
    /* clone/unshare: no new user namespace (the door to most kernel attack surface) */
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 1, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_unshare, 0, 4);
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]), 0, 0);
    EMIT(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER, 0, 1);
    EMIT(BPF_RET | BPF_K, RET_DENIED, 0, 0);
    EMIT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0);
    /* personality: the query (0xffffffff) and plain PER_LINUX only; other personas turn off ASLR
     * (ADDR_NO_RANDOMIZE) or change the ABI. The kernel takes the argument as a 32-bit int. */
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_personality, 0, 5);
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]), 0, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, 0xffffffff, 2, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, 0 /* PER_LINUX */, 1, 0);
    EMIT(BPF_RET | BPF_K, RET_DENIED, 0, 0);
    EMIT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0);
    /* prctl(PR_SET_MEMORY_MERGE) and madvise(MADV_MERGEABLE): whether a sandbox's pages are merged
     * with other tenants' (a timing side channel) is the host's choice, create option ksm, made in init
     * before this filter; a sandbox cannot opt itself in (nor out) */
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_prctl, 0, 4);
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]), 0, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, PR_SET_MEMORY_MERGE, 0, 1);
    EMIT(BPF_RET | BPF_K, RET_DENIED, 0, 0);
    EMIT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_madvise, 0, 4);
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2]), 0, 0);
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, 12 /* MADV_MERGEABLE */, 0, 1);
    EMIT(BPF_RET | BPF_K, RET_DENIED, 0, 0);
    EMIT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0);
    /* ioctl: compare the low 16 bits (type << 8 | nr) of the request */
    EMIT(BPF_JMP | BPF_JEQ | BPF_K, SYS_ioctl, 0, (uint8_t)(3 + 2 * n_ioctl));
    EMIT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1]), 0, 0);
    EMIT(BPF_ALU | BPF_AND | BPF_K, 0xffff, 0, 0);
    for (size_t i = 0; i < n_ioctl; i++) {
        EMIT(BPF_JMP | BPF_JEQ | BPF_K, denied_ioctls[i], 0, 1);
        EMIT(BPF_RET | BPF_K, RET_DENIED, 0, 0);
    }
    EMIT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0);
    /* everything else: the allow/deny table, unknown -> ENOSYS */
    emit_search(prog, n, rules, 0, n_rules);
    return count;
}

static void install_seccomp(void) {
    static struct sock_filter prog[MAX_INSNS];
    int n = build_seccomp(prog);
    struct sock_fprog fprog = {.len = (unsigned short)n, .filter = prog};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs");
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog) < 0) die("seccomp");
}

/* `shoal-init seccomp-table`: the table as "<nr> allow|deny|special" lines and the BPF program, for
 * tests that probe every call the filter refuses and run the program on every number (the numbers
 * are this build's architecture's). */
static int print_seccomp_table(void) {
    static struct seccomp_rule rules[N_RULES];
    static struct sock_filter prog[MAX_INSNS];
    size_t n = seccomp_rules(rules);
    for (size_t i = 0; i < n; i++) printf("%u %s\n", rules[i].nr, rules[i].action == SECCOMP_RET_ALLOW ? "allow" : "deny");
    /* checked before the table: clone3 always ENOSYS, the others by their arguments */
    printf("%u special\n%u special\n%u special\n%u special\n%u special\n", (unsigned)SYS_clone3,
           (unsigned)SYS_clone, (unsigned)SYS_unshare, (unsigned)SYS_ioctl, (unsigned)SYS_personality);
    printf("%u special\n%u special\n", (unsigned)SYS_prctl, (unsigned)SYS_madvise);
    int len = build_seccomp(prog);
    printf("insns %d\narch %u\n", len, (unsigned)SHOAL_AUDIT_ARCH);
    /* the program itself, so a test can run it on every number without a kernel in the way */
    for (int i = 0; i < len; i++) printf("bpf %u %u %u %u\n", prog[i].code, prog[i].jt, prog[i].jf, prog[i].k);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* init: the exec server                                                                       */

struct conn {
    int fd;
    pid_t pid;          /* running command, 0 if none */
    int kill_on_close;  /* kill the command's process group if the client goes away */
    int busy;           /* counts as activity for the idle TTL */
    int timed_out;
    long long deadline; /* ms, 0 = none */
};

static struct conn *conns;
static int n_conns, cap_conns;
static long long last_activity;
static long long ttl_deadline; /* ms on CLOCK_MONOTONIC, 0 = none */

static void conn_add(int fd) {
    if (n_conns == cap_conns) {
        cap_conns = cap_conns ? cap_conns * 2 : 64;
        conns = realloc(conns, sizeof *conns * (size_t)cap_conns);
        if (!conns) _exit(EXIT_SETUP);
    }
    conns[n_conns++] = (struct conn){.fd = fd};
}

/* Signal a command's process group. The child calls setsid() right after fork, while init has
 * already reported its pid: a signal that arrives in between finds no group (ESRCH), so it goes to
 * the child itself, which has not exec'd or forked yet. */
static void kill_group(pid_t pid, int sig) {
    if (kill(-pid, sig) < 0 && errno == ESRCH) kill(pid, sig);
}

static void conn_close(int i) {
    if (conns[i].pid > 0 && conns[i].kill_on_close) kill_group(conns[i].pid, SIGKILL);
    close(conns[i].fd);
    conns[i] = conns[--n_conns];
}

static void send_msg(int fd, const void *buf, size_t len) {
    /* MSG_DONTWAIT: a client that stops reading must never stall the sandbox's init */
    ssize_t r = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)r;
}

static void reply_failed(int fd, int err, const char *what) {
    char buf[512];
    memset(buf, 0, 8);
    buf[0] = 'F';
    int32_t e = err;
    memcpy(buf + 4, &e, 4);
    size_t n = strlen(what);
    if (n > sizeof buf - 8) n = sizeof buf - 8;
    memcpy(buf + 8, what, n);
    send_msg(fd, buf, 8 + n);
}

/* Kill every process in process group `pgid` except its leader (interrupts a session's command
 * while keeping the session shell). */
static void kill_group_except_leader(pid_t pgid, int sig) {
    DIR *d = opendir("/proc");
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        pid_t p = (pid_t)atoi(de->d_name);
        if (p <= 1 || p == pgid) continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%d/stat", p);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t r = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (r <= 0) continue;
        buf[r] = 0;
        char *rp = strrchr(buf, ')');
        int ppid, pgrp;
        char state;
        if (!rp || sscanf(rp + 2, "%c %d %d", &state, &ppid, &pgrp) != 3) continue;
        if (pgrp == pgid) kill(p, sig);
    }
    closedir(d);
}

#define FLAG_EXT 4
#define MAX_GROUPS 64

struct exec_ext {
    uint16_t rows, cols; /* rows > 0: run on a new PTY of this size */
    int32_t uid, gid;    /* uid >= 0: drop to it (and gid, groups) before exec */
    uint32_t ngroups;
    gid_t groups[MAX_GROUPS];
};

/* The optional block after the 16-byte exec header (flags & FLAG_EXT); *hdr = where the strings start. */
static int parse_ext(const char *msg, ssize_t len, struct exec_ext *x, size_t *hdr) {
    if (len < 32) return -1;
    memcpy(&x->rows, msg + 16, 2);
    memcpy(&x->cols, msg + 18, 2);
    memcpy(&x->uid, msg + 20, 4);
    memcpy(&x->gid, msg + 24, 4);
    memcpy(&x->ngroups, msg + 28, 4);
    if (x->ngroups > MAX_GROUPS || (size_t)len < 32 + 4 * (size_t)x->ngroups) return -1;
    if ((x->uid >= 0) != (x->gid >= 0) || (x->rows == 0) != (x->cols == 0)) return -1;
    for (uint32_t i = 0; i < x->ngroups; i++) {
        uint32_t g;
        memcpy(&g, msg + 32 + 4 * i, 4);
        x->groups[i] = (gid_t)g;
    }
    *hdr = 32 + 4 * (size_t)x->ngroups;
    return 0;
}

/* A new PTY pair in the sandbox's own devpts (its /dev/pts, mounted newinstance), opened by path and
 * checked to be the ptmx device: root inside the sandbox could have put anything at /dev/ptmx. The
 * peer is opened from the master (TIOCGPTPEER), never by a path the sandbox could swap. */
static int open_pty(const struct exec_ext *x, int *master, int *slave) {
    int m = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (m < 0) return -1;
    struct stat st;
    int unlock = 0;
    struct winsize ws = {.ws_row = x->rows, .ws_col = x->cols};
    if (fstat(m, &st) < 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != 5 || minor(st.st_rdev) != 2) {
        close(m);
        errno = ENODEV;
        return -1;
    }
    int s = -1;
    if (ioctl(m, TIOCSPTLCK, &unlock) < 0 || ioctl(m, TIOCSWINSZ, &ws) < 0 ||
        (s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
        int e = errno;
        close(m);
        errno = e;
        return -1;
    }
    *master = m;
    *slave = s;
    return 0;
}

/* In the forked child, before exec: become uid/gid with exactly `groups`. Every failure ends the
 * child: a command asked to run as a user must never run as root instead. Leaving uid 0 clears the
 * permitted, effective and ambient capabilities; no_new_privs (set in init) keeps setuid binaries
 * and file capabilities from handing them back. */
static void drop_to_user(const struct exec_ext *x) {
    if (setgroups(x->ngroups, x->groups) < 0 || setresgid((gid_t)x->gid, (gid_t)x->gid, (gid_t)x->gid) < 0 ||
        setresuid((uid_t)x->uid, (uid_t)x->uid, (uid_t)x->uid) < 0) {
        dprintf(2, "shoal: cannot switch to uid %d gid %d: %s\n", x->uid, x->gid, strerror(errno));
        _exit(126);
    }
    uid_t r, e, s;
    if (x->uid != 0 && (getresuid(&r, &e, &s) < 0 || r == 0 || e == 0 || s == 0 || setuid(0) == 0)) _exit(126);
}

static void send_msg_fd(int fd, const void *buf, size_t len, int pass) {
    if (pass < 0) { send_msg(fd, buf, len); return; }
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {(void *)buf, len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &pass, sizeof(int));
    ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)r;
}

static void handle_exec(int ci, char *msg, ssize_t len, int *fds, int nfds) {
    struct conn *c = &conns[ci];
    if (c->pid > 0) { reply_failed(c->fd, EBUSY, "connection already runs a command"); goto closefds; }
    if (len < 16) { reply_failed(c->fd, EINVAL, "exec needs a header"); goto closefds; }
    uint8_t flags = (uint8_t)msg[1];
    uint32_t timeout_ms, argc, envc;
    memcpy(&timeout_ms, msg + 4, 4);
    memcpy(&argc, msg + 8, 4);
    memcpy(&envc, msg + 12, 4);
    if (argc == 0 || argc > 65536 || envc > 65536) { reply_failed(c->fd, EINVAL, "bad argc/envc"); goto closefds; }
    struct exec_ext ext = {.uid = -1, .gid = -1};
    size_t hdr = 16;
    if (flags & FLAG_EXT) {
        if (parse_ext(msg, len, &ext, &hdr) < 0) { reply_failed(c->fd, EINVAL, "bad exec extension"); goto closefds; }
    }
    if (nfds != (ext.rows ? 0 : 3)) { reply_failed(c->fd, EINVAL, "exec needs 3 fds (none with a PTY)"); goto closefds; }
    int master = -1, slave = -1;
    if (ext.rows && open_pty(&ext, &master, &slave) < 0) {
        reply_failed(c->fd, errno, "could not open a PTY in the sandbox");
        goto closefds;
    }
    /* split the NUL-separated strings: cwd, argv..., env... */
    size_t want = 1 + argc + envc;
    char **strs = calloc(want + 2, sizeof *strs);
    if (!strs) { reply_failed(c->fd, ENOMEM, "oom"); goto closepty; }
    char *p = msg + hdr, *end = msg + len;
    for (size_t i = 0; i < want; i++) {
        char *z = memchr(p, 0, (size_t)(end - p));
        if (!z) { free(strs); reply_failed(c->fd, EINVAL, "truncated exec request"); goto closepty; }
        strs[i] = p;
        p = z + 1;
    }
    char *cwd = strs[0];
    char **argv = calloc(argc + 1, sizeof *argv), **envp = calloc(envc + 1, sizeof *envp);
    if (!argv || !envp) { free(strs); free(argv); free(envp); reply_failed(c->fd, ENOMEM, "oom"); goto closepty; }
    for (uint32_t i = 0; i < argc; i++) argv[i] = strs[1 + i];
    for (uint32_t i = 0; i < envc; i++) envp[i] = strs[1 + argc + i];

    pid_t pid = fork();
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        setsid();
        write_file("/proc/self/oom_score_adj", COMMAND_OOM_ADJ); /* raising needs no capability */
        if (slave >= 0) {
            /* the PTY becomes the session's controlling terminal and its stdio */
            if (ioctl(slave, TIOCSCTTY, 0) < 0 || dup2(slave, 0) < 0 || dup2(slave, 1) < 0 || dup2(slave, 2) < 0)
                _exit(126);
            if (ext.uid >= 0 && fchown(0, (uid_t)ext.uid, (gid_t)-1) < 0) _exit(126); /* /dev/tty opens for it */
        } else if (dup2(fds[0], 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[2], 2) < 0) {
            _exit(126);
        }
        syscall(SYS_close_range, 3, ~0U, 0);
        if (ext.uid >= 0) drop_to_user(&ext);
        if (chdir(cwd) < 0) {
            dprintf(2, "shoal: cannot enter working directory %s: %s\n", cwd, strerror(errno));
            _exit(126);
        }
        extern char **environ;
        environ = envp;
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "shoal: %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    free(strs);
    free(argv);
    free(envp);
    if (pid < 0) { reply_failed(c->fd, errno, "fork failed"); goto closepty; }
    c->pid = pid;
    c->kill_on_close = flags & 1;
    c->busy = (flags & 2) ? 1 : 0;
    c->timed_out = 0;
    c->deadline = timeout_ms ? now_ms() + timeout_ms : 0;
    char out[8] = {'S', 0, 0, 0};
    int32_t p32 = pid;
    memcpy(out + 4, &p32, 4);
    send_msg_fd(c->fd, out, sizeof out, master);
closepty:
    if (master >= 0) close(master);
    if (slave >= 0) close(slave);
closefds:
    for (int i = 0; i < nfds; i++) close(fds[i]);
}

static void handle_message(int ci) {
    static char buf[MAX_MSG];
    char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {buf, sizeof buf};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t len = recvmsg(conns[ci].fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (len < 0 && (errno == EAGAIN || errno == EINTR)) return;
    int fds[4], nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int j = 0; j < k && nfds < 4; j++) memcpy(&fds[nfds++], CMSG_DATA(cm) + j * sizeof(int), sizeof(int));
        }
    }
    if (len <= 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        for (int i = 0; i < nfds; i++) close(fds[i]);
        conn_close(ci);
        return;
    }
    last_activity = now_ms();
    switch (buf[0]) {
    case 'E':
        handle_exec(ci, buf, len, fds, nfds);
        return;
    case 'K':
        if (len >= 8 && conns[ci].pid > 0) {
            int32_t sig;
            memcpy(&sig, buf + 4, 4);
            if (buf[1] == 1) kill_group_except_leader(conns[ci].pid, sig);
            else kill_group(conns[ci].pid, sig);
        }
        break;
    case 'T':
        if (len >= 2) conns[ci].busy = buf[1] ? 1 : 0;
        break;
    case 'L': /* set lifetimes: i64 ttl_ms from now (0 = none, -1 = keep), i64 idle_ttl_ms (-1 = keep) */
        if (len >= 24) {
            int64_t ttl, idle;
            memcpy(&ttl, buf + 8, 8);
            memcpy(&idle, buf + 16, 8);
            if (ttl >= 0) ttl_deadline = ttl ? now_ms() + ttl : 0;
            if (idle >= 0) cfg.idle_ttl_ms = idle;
            char out[8] = {'L', 0, 0, 0, 0, 0, 0, 0};
            send_msg(conns[ci].fd, out, sizeof out);
        }
        break;
    case 'P': {
        char out[8] = {'P', 0, 0, 0};
        uint32_t running = 0;
        for (int i = 0; i < n_conns; i++) running += conns[i].pid > 0;
        memcpy(out + 4, &running, 4);
        send_msg(conns[ci].fd, out, sizeof out);
        break;
    }
    default:
        reply_failed(conns[ci].fd, EINVAL, "unknown request");
    }
    for (int i = 0; i < nfds; i++) close(fds[i]);
}

static void reap_children(void) {
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        for (int i = 0; i < n_conns; i++) {
            if (conns[i].pid != pid) continue;
            char out[8] = {'X', (char)conns[i].timed_out, 0, 0};
            int32_t s32 = st;
            memcpy(out + 4, &s32, 4);
            send_msg(conns[i].fd, out, sizeof out);
            conns[i].pid = 0;
            conns[i].busy = 0;
            last_activity = now_ms();
            break;
        }
    }
}

static int serve(int listen_fd) {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) die("signalfd");
    signal(SIGPIPE, SIG_IGN);
    long long started = now_ms();
    last_activity = started;
    ttl_deadline = cfg.ttl_ms > 0 ? started + cfg.ttl_ms : 0;
    struct pollfd *pfds = NULL;
    int cap_pfds = 0;

    for (;;) {
        long long now = now_ms(), wait = -1;
        if (ttl_deadline > 0) {
            if (now >= ttl_deadline) return EXIT_TTL;
            wait = ttl_deadline - now;
        }
        if (cfg.idle_ttl_ms > 0) {
            int busy = 0;
            for (int i = 0; i < n_conns; i++) busy |= conns[i].busy;
            if (busy) last_activity = now;
            else if (now >= last_activity + cfg.idle_ttl_ms) return EXIT_IDLE;
            long long w = last_activity + cfg.idle_ttl_ms - now;
            if (wait < 0 || w < wait) wait = w;
        }
        for (int i = 0; i < n_conns; i++) {
            if (conns[i].pid <= 0 || !conns[i].deadline) continue;
            if (now >= conns[i].deadline) {
                if (!conns[i].timed_out) kill_group(conns[i].pid, SIGKILL);
                conns[i].timed_out = 1;
                conns[i].deadline = 0;
                continue;
            }
            long long w = conns[i].deadline - now;
            if (wait < 0 || w < wait) wait = w;
        }
        if (n_conns + 2 > cap_pfds) {
            cap_pfds = (n_conns + 2) * 2;
            pfds = realloc(pfds, sizeof *pfds * (size_t)cap_pfds);
            if (!pfds) return EXIT_SETUP;
        }
        pfds[0] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        pfds[1] = (struct pollfd){.fd = sfd, .events = POLLIN};
        int polled = n_conns;
        for (int i = 0; i < polled; i++) pfds[2 + i] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        int r = poll(pfds, (nfds_t)(polled + 2), wait > 0x7fffffff ? 0x7fffffff : (int)wait);
        if (r < 0) {
            if (errno == EINTR) continue;
            return EXIT_SETUP;
        }
        if (pfds[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            reap_children();
        }
        /* walk backwards: conn_close() moves the last entry into the closed slot */
        for (int i = polled - 1; i >= 0; i--) {
            if (!pfds[2 + i].revents) continue;
            if (pfds[2 + i].revents & POLLIN) handle_message(i);
            else conn_close(i);
        }
        if (pfds[0].revents & POLLIN) {
            for (;;) {
                int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
                if (fd < 0) break;
                conn_add(fd);
            }
        }
    }
}

struct init_args {
    int go_fd, status_fd, upper_detached;
};

/* Density options (docs/ksm-and-scheduling.md), set in init before seccomp so that every process of
 * the sandbox inherits them: MMF_VM_MERGE_ANY survives fork and exec; the persona survives exec. The
 * seccomp filter then refuses personality() changes other than back to PER_LINUX. */
static void density_options(void) {
    if (cfg.ksm && prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) < 0)
        die("ksm: prctl(PR_SET_MEMORY_MERGE) failed (needs Linux >= 6.4 built with CONFIG_KSM)");
    if (cfg.no_aslr && personality(PER_LINUX | ADDR_NO_RANDOMIZE) < 0) die("aslr: personality(ADDR_NO_RANDOMIZE)");
}

/* `shoal-init ksm-probe`: whether this kernel has per-process KSM (prints "ok" or why not) */
static int ksm_probe(void) {
    if (prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) < 0) {
        printf("unsupported: prctl(PR_SET_MEMORY_MERGE): %s (needs Linux >= 6.4 with CONFIG_KSM)\n", strerror(errno));
        return 1;
    }
    printf("ok\n");
    return 0;
}

static int init_main(void *arg) {
    /* the fds come through the argument: static globals written just before clone() may be
     * optimised away, since the compiler cannot see clone() copy them into the child */
    struct init_args *ia = arg;
    int go_fd = ia->go_fd;
    int first_mark = n_marks; /* the supervisor's marks came with the clone: send only init's own */
    status_fd = ia->status_fd;
    cfg.upper_detached = ia->upper_detached;
    char b;
    /* wait until the supervisor has placed us in our cgroups */
    if (read(go_fd, &b, 1) != 1) _exit(EXIT_SETUP);
    close(go_fd);
    mark("go");
    /* before the capabilities go: written with CAP_SYS_RESOURCE, 500 becomes the floor too */
    if (write_file("/proc/self/oom_score_adj", SANDBOX_OOM_ADJ) < 0) die("oom_score_adj");
    ready_out_fd = -1;
    /* keep only fd 3 (listening socket), the upper (until it is attached) and the status pipe */
    int keep[3] = {3, status_fd < UPPER_FD ? status_fd : UPPER_FD, status_fd < UPPER_FD ? UPPER_FD : status_fd};
    close_fds_except(keep, 3);
    /* nothing of the host's stdio may stay open inside the sandbox */
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(devnull, 1) < 0 || dup2(devnull, 2) < 0) die("stdio");
    close(devnull);
    errno = 0;
    /* now inside the sandbox cgroups: a cgroup namespace rooted here hides the host's tree */
    if (unshare(CLONE_NEWCGROUP) < 0) die("unshare cgroup ns");
    mark("cgroupns");
    setup_rootfs();
    mark("rootfs");
    if (sethostname(cfg.hostname, strlen(cfg.hostname)) < 0) die("sethostname");
    if (!cfg.host_net) loopback_up();
    mark("net");
    density_options();
    prctl(PR_SET_PDEATHSIG, 0);
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) die("dumpable");
    drop_capabilities();
    install_seccomp();
    int listen_fd = 3;
    mark("hardened");
    /* success: "+" and init's marks (an error is text that never starts with "+") */
    for (char **a = g_argv; *a; a++) memset(*a, 0, strlen(*a));
    prctl(PR_SET_NAME, "shoal-init", 0, 0, 0);
    char done[512] = "+";
    format_marks(done + 1, sizeof done - 1, first_mark);
    ssize_t w = write(status_fd, done, strlen(done));
    (void)w;
    close(status_fd);
    status_fd = -1;
    return serve(listen_fd);
}

/* ------------------------------------------------------------------------------------------ */
/* supervisor and launcher                                                                     */

static void write_tombstone(const char *reason) {
    if (!cfg.tombstone) return;
    /* written aside, then renamed into place: readers poll for the file and read it at once, and a
     * file seen between open() and write() would say nothing (the runtime then reported "exited"
     * for an expired TTL; the slow guest of `make test-vm` hit it) */
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", cfg.tombstone) >= (int)sizeof tmp) return;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ssize_t w = write(fd, reason, strlen(reason));
    close(fd);
    /* link, not rename: a tombstone already there (a kill through Shoal writes "killed" before its
     * signal) says better why the sandbox ended than what this supervisor can see */
    if (w == (ssize_t)strlen(reason)) {
        if (link(tmp, cfg.tombstone) < 0 && errno != EEXIST) rename(tmp, cfg.tombstone);
    }
    unlink(tmp);
}

static void release_resources(void) {
    char path[4096];
    close(UPPER_FD);
    umount2(cfg.disk, MNT_DETACH);
    for (int i = 0; i < cfg.n_cgroups; i++) {
        /* a memory cgroup can stay busy for a moment after its last task is reaped */
        for (int tries = 0; tries < 200; tries++) {
            if (rmdir(cfg.cgroups[i]) == 0 || errno == ENOENT) break;
            usleep(5000);
        }
    }
    static const char *names[] = {"agent.sock", "meta.json", "meta.json.tmp", "rootfs", "disk", NULL};
    for (int i = 0; names[i]; i++) {
        snprintf(path, sizeof path, "%s/%s", cfg.state_dir, names[i]);
        if (unlink(path) < 0) rmdir(path);
    }
    rmdir(cfg.state_dir);
}

/* ---- OOM watch (density-oom) ----------------------------------------------------------------
 * The supervisor watches its sandbox's memory cgroup for OOM kills: v2 memory.events (poll wakes with
 * POLLPRI when it changes), v1 an eventfd registered on memory.oom_control. A kill counts as the
 * sandbox's own ("oom <its limit MiB>") when its own limit was hit (v2: the `oom` event; v1: its peak
 * usage reached its limit, failcnt being no longer kept on recent kernels), else as the aggregate limit
 * of all sandboxes, the parent cgroup's ("oom <MiB> shared"). */
#define OOM_RECHECK_MAX_MS 1024 /* v1: the last wait for a kill after an OOM notification (~2 s in all) */

struct oom_watch {
    int v2, fd, ctl_fd;     /* fd: what poll() watches; ctl_fd: v1's memory.oom_control */
    long long kills, own;   /* counters as last read */
    long long last_ms;      /* when the last kill was seen, 0 = never */
    int shared;             /* the last kill came from the parent's (aggregate) limit */
};

static long long read_key(const char *path, const char *key) {
    char buf[4096];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    size_t kl = strlen(key);
    for (char *line = buf; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (key[0] == 0) return atoll(line); /* a single-number file */
        if (!strncmp(line, key, kl) && line[kl] == ' ') return atoll(line + kl + 1);
    }
    return -1;
}

/* v1: 1 when the peak usage since the last call came within 1 MiB of the limit (the peak is reset) */
static int v1_peak_at_limit(const char *usage, const char *limit) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", cfg.memory_cgroup, usage);
    long long peak = read_key(path, "");
    if (!cfg.memory_pooled) write_file(path, "0"); /* a pool's peak is its members' to read, not one's to reset */
    snprintf(path, sizeof path, "%s/%s", cfg.memory_cgroup, limit);
    long long lim = read_key(path, "");
    errno = 0;
    return peak > 0 && lim > 0 && peak + (1 << 20) >= lim;
}

static long long oom_kill_count(const struct oom_watch *w) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", cfg.memory_cgroup, w->v2 ? "memory.events" : "memory.oom_control");
    return read_key(path, "oom_kill");
}

/* How often the cgroup's own limit was reached. v2: the `oom` count. v1: a counter of our own, +1 when
 * the peak since the last look reached the limit (memory, or memory+swap); read only once a kill is
 * seen, since the look resets the peak. */
static long long own_oom_count(const struct oom_watch *w) {
    if (w->v2) {
        char path[4096];
        snprintf(path, sizeof path, "%s/memory.events", cfg.memory_cgroup);
        return read_key(path, "oom");
    }
    int hit = v1_peak_at_limit("memory.max_usage_in_bytes", "memory.limit_in_bytes");
    hit |= v1_peak_at_limit("memory.memsw.max_usage_in_bytes", "memory.memsw.limit_in_bytes");
    return w->own + hit;
}

static int oom_watch_open(struct oom_watch *w) {
    char path[4096];
    memset(w, 0, sizeof *w);
    w->fd = w->ctl_fd = -1;
    if (!cfg.memory_cgroup) return -1;
    snprintf(path, sizeof path, "%s/memory.events", cfg.memory_cgroup);
    if (access(path, R_OK) == 0) {
        w->v2 = 1;
        w->fd = open(path, O_RDONLY | O_CLOEXEC);
    } else {
        snprintf(path, sizeof path, "%s/memory.oom_control", cfg.memory_cgroup);
        w->ctl_fd = open(path, O_RDONLY | O_CLOEXEC);
        w->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        char reg[64];
        snprintf(reg, sizeof reg, "%d %d", w->fd, w->ctl_fd);
        snprintf(path, sizeof path, "%s/cgroup.event_control", cfg.memory_cgroup);
        if (w->ctl_fd < 0 || w->fd < 0 || write_file(path, reg) < 0) {
            if (w->fd >= 0) close(w->fd);
            if (w->ctl_fd >= 0) close(w->ctl_fd);
            w->fd = w->ctl_fd = -1;
        }
    }
    errno = 0;
    w->kills = oom_kill_count(w);
    w->own = own_oom_count(w);
    return w->fd;
}

/* Read the counters after a wake-up (or at the end); returns 1 when a new OOM kill happened. */
static int oom_check(struct oom_watch *w) {
    if (w->fd >= 0 && !w->v2) {
        uint64_t v;
        while (read(w->fd, &v, sizeof v) > 0) {}
    } else if (w->fd >= 0) {
        /* kernfs keeps answering POLLPRI until the watched fd itself has read the new contents */
        char buf[512];
        if (lseek(w->fd, 0, SEEK_SET) == 0)
            while (read(w->fd, buf, sizeof buf) > 0) {}
        errno = 0;
    }
    long long kills = oom_kill_count(w);
    if (kills <= w->kills) return 0;
    long long own = own_oom_count(w);
    w->shared = own <= w->own;
    w->kills = kills;
    w->own = own;
    w->last_ms = now_ms();
    return 1;
}

static long read_limit_mib(const char *dir) {
    char path[4096];
    char buf[64] = {0};
    snprintf(path, sizeof path, "%s/memory.max", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(path, sizeof path, "%s/memory.limit_in_bytes", dir);
        fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    errno = 0;
    if (n <= 0 || buf[0] < '0' || buf[0] > '9') return 0; /* "max": no limit */
    long long b = atoll(buf);
    return b >= (1LL << 50) ? 0 : (long)(b >> 20);
}

/* "oom <MiB>" (the sandbox's own limit), "oom <MiB> pooled" (its pool's limit: the sum of its members')
 * or "oom <MiB> shared" (the parent's: all sandboxes together) */
static void oom_reason(const struct oom_watch *w, char *out, size_t len) {
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", cfg.memory_cgroup);
    char *slash = strrchr(parent, '/');
    if (slash) *slash = 0;
    if (w->shared) snprintf(out, len, "oom %ld shared", read_limit_mib(parent));
    else snprintf(out, len, cfg.memory_pooled ? "oom %ld pooled" : "oom %ld", read_limit_mib(cfg.memory_cgroup));
}

static int supervise(int ready_fd) {
    char opts[128];
    ready_out_fd = ready_fd;
    setsid();
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    /* inherited by init, which raises its own to SANDBOX_OOM_ADJ first thing */
    if (write_file("/proc/self/oom_score_adj", SUPERVISOR_OOM_ADJ) < 0) errno = 0;
    mark("forked");

    /* the upper, detached (see UPPER_FD); on kernels without the new mount API, mounted on disk/ */
    int ufd = -1;
    if (cfg.upper_mounted) {
        ufd = (int)syscall(SH_SYS_open_tree, AT_FDCWD, cfg.disk, SH_OPEN_TREE_CLONE | O_CLOEXEC);
        if (ufd >= 0 && umount2(cfg.disk, MNT_DETACH) < 0) die("detach the disk upper from %s", cfg.disk);
    } else {
        ufd = detached_tmpfs(cfg.disk_mb);
        if (ufd < 0) {
            snprintf(opts, sizeof opts, "size=%ldm,mode=0755", cfg.disk_mb);
            if (mount("tmpfs", cfg.disk, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
                die("mount disk tmpfs on %s", cfg.disk);
        }
    }
    cfg.upper_detached = ufd >= 0;
    if (ufd < 0) ufd = open(cfg.disk, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (ufd < 0 || (ufd != UPPER_FD && dup3(ufd, UPPER_FD, O_CLOEXEC) < 0)) die("hold the upper");
    if (ufd != UPPER_FD) close(ufd);
    errno = 0;
    char path[4096];
    if (mkdirat(UPPER_FD, "upper", 0755) < 0) die("mkdir upper");
    if (mkdirat(UPPER_FD, "work", 0755) < 0) die("mkdir work");
    mark("upper");

    /* the control socket is bound here, in the host mount namespace, before the sandbox exists */
    int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (lfd < 0) die("socket");
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(cfg.sock) >= sizeof sa.sun_path) { errno = 0; die("socket path too long: %s", cfg.sock); }
    strcpy(sa.sun_path, cfg.sock);
    unlink(cfg.sock);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) < 0) die("bind %s", cfg.sock);
    chmod(cfg.sock, 0600);
    if (listen(lfd, 1024) < 0) die("listen");
    if (lfd != 3) {
        if (dup3(lfd, 3, 0) < 0) die("dup3");
        close(lfd);
    }
    /* fd 3 must survive into init: clear CLOEXEC (clone does not exec, but be explicit) */
    fcntl(3, F_SETFD, 0);
    mark("socket");

    int go[2], st[2];
    if (pipe2(go, O_CLOEXEC) < 0 || pipe2(st, O_CLOEXEC) < 0) die("pipe");
    static char stack[256 * 1024] __attribute__((aligned(16)));
    static struct init_args ia;
    ia.go_fd = go[0];
    ia.status_fd = st[1];
    ia.upper_detached = cfg.upper_detached;
    pid_t init_pid = clone(init_main, stack + sizeof stack,
                           /* no CLONE_NEWNS: init makes its own (setup_rootfs) */
                           CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC |
                               (cfg.host_net ? 0 : CLONE_NEWNET) | SIGCHLD, &ia);
    if (init_pid < 0) die("clone");
    mark("clone");
    close(go[0]);
    close(st[1]);
    close(3);
    char pidbuf[32];
    snprintf(pidbuf, sizeof pidbuf, "%d", init_pid);
    for (int i = 0; i <= cfg.n_cgroups; i++) {
        const char *cg = i < cfg.n_cgroups ? cfg.cgroups[i] : cfg.join_cgroup;
        if (!cg) break;
        snprintf(path, sizeof path, "%s/cgroup.procs", cg);
        if (write_file(path, pidbuf) < 0) {
            kill(init_pid, SIGKILL);
            waitpid(init_pid, NULL, 0);
            release_resources();
            die("join cgroup %s", path);
        }
    }
    mark("joined");
    if (write(go[1], "g", 1) != 1) die("start init");
    close(go[1]);

    char err[1024];
    ssize_t n = read(st[0], err, sizeof err - 1);
    close(st[0]);
    err[n > 0 ? n : 0] = 0;
    if (n > 0 && err[0] != '+') {
        waitpid(init_pid, NULL, 0);
        release_resources();
        dprintf(ready_fd, "ERR %s\n", err);
        _exit(1);
    }
    mark("ready");
    char sup_marks[640];
    format_marks(sup_marks, sizeof sup_marks, 0);
    /* init's marks (after its "+") go between the supervisor's: they happened before "ready" */
    const char *ready_mark = strrchr(sup_marks, ',');
    dprintf(ready_fd, "OK %d %d %d t=%.*s%s%s%s\n", init_pid, getpid(), UPPER_FD,
            ready_mark ? (int)(ready_mark - sup_marks) : 0, sup_marks, n > 1 ? "," : "", n > 1 ? err + 1 : "",
            ready_mark ? ready_mark : "");
    close(ready_fd);
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
        dup2(devnull, 0);
        dup2(devnull, 1);
        dup2(devnull, 2);
        if (devnull > 2) close(devnull);
    }

    struct oom_watch ow;
    int wfd = oom_watch_open(&ow);
    int pfd = (int)syscall(SYS_pidfd_open, init_pid, 0);
    int oom_ended = 0; /* --oom-kill sandbox: this supervisor ended it after an OOM kill */
    /* v1's notification comes when the cgroup goes under OOM, before the killer has chosen and counted
     * its victim: after a wake-up with no new kill, look again after 4, 8, 16 ... ms, for about 2 s.
     * A parent's OOM notifies every sandbox below it, so the look-ups stay few (9) per sandbox. */
    int recheck_ms = 0;
    while (pfd >= 0 && wfd >= 0) {
        struct pollfd pf[2] = {{.fd = pfd, .events = POLLIN}, {.fd = wfd, .events = ow.v2 ? POLLPRI : POLLIN}};
        int ready = poll(pf, 2, recheck_ms ? recheck_ms : -1);
        if (ready < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (pf[1].revents || (ready == 0 && recheck_ms)) {
            int killed = oom_check(&ow);
            if (killed) recheck_ms = 0;
            else if (!ow.v2 && pf[1].revents) recheck_ms = 4;
            else if (recheck_ms) recheck_ms = recheck_ms * 2 > OOM_RECHECK_MAX_MS ? 0 : recheck_ms * 2;
            if (killed && cfg.oom_kill == OOM_KILL_SANDBOX && !oom_ended && !cfg.memory_pooled) {
                oom_ended = 1;
                kill(init_pid, SIGKILL);
            }
        }
        if (pf[0].revents) break;
    }
    int status;
    while (waitpid(init_pid, &status, 0) < 0 && errno == EINTR) {}
    const char *reason = "exited";
    char oom_buf[64];
    if (WIFSIGNALED(status)) reason = WTERMSIG(status) == SIGKILL ? "killed" : "crashed";
    /* init killed by the OOM killer (a kill not yet read, or one just before its death), or ended by
     * this supervisor for one: say so. A kill through Shoal wrote "killed" before its signal. */
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && cfg.memory_cgroup &&
        (oom_check(&ow) || oom_ended || (ow.last_ms && now_ms() - ow.last_ms < 1000))) {
        oom_reason(&ow, oom_buf, sizeof oom_buf);
        reason = oom_buf;
    }
    else if (WEXITSTATUS(status) == EXIT_TTL) reason = "ttl";
    else if (WEXITSTATUS(status) == EXIT_IDLE) reason = "idle_ttl";
    else if (WEXITSTATUS(status) == EXIT_SETUP) reason = "init_error";
    release_resources();
    write_tombstone(reason);
    return 0;
}

/* `shoal-init sysfs-template DIR NSFILE`: mount, read-only at DIR in the host mount namespace, the
 * sysfs of a new, empty network namespace, which NSFILE holds alive (a bind of its nsfs file, as
 * `ip netns add` does: a sysfs superblock holds only a passive reference, and without an active one
 * the namespace is torn down, `lo` with it, and /sys/class/net would be empty). Sandboxes bind DIR
 * (--sysfs DIR). */
static int sysfs_template(const char *dir, const char *nsfile) {
    if (mkdir(dir, 0555) < 0 && errno != EEXIST) { perror("mkdir"); return 1; }
    int fd = open(nsfile, O_WRONLY | O_CREAT | O_CLOEXEC, 0444);
    if (fd < 0) { perror("create netns file"); return 1; }
    close(fd);
    if (unshare(CLONE_NEWNET) < 0) { perror("unshare(CLONE_NEWNET)"); return 1; }
    if (mount("/proc/self/ns/net", nsfile, NULL, MS_BIND, NULL) < 0) {
        fprintf(stderr, "bind the netns on %s: %s\n", nsfile, strerror(errno));
        return 1;
    }
    if (mount("sysfs", dir, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) {
        fprintf(stderr, "mount sysfs on %s: %s\n", dir, strerror(errno));
        return 1;
    }
    return 0;
}

/* `shoal-init mntns-template FILE`: make the host's template mount namespace and hold it with a bind
 * of its nsfs file at FILE (as `unshare --mount=FILE` does). Its only mount is an empty read-only
 * tmpfs, its root (one pivot_root, once per host). A sandbox's init joins it and copies it instead
 * of copying the host's mount table (setup_rootfs). FILE's directory is bound onto itself and made
 * private first: a bind of a mount namespace's file cannot propagate to peers (the kernel refuses
 * it), and a shared /run would have some. */
static int mntns_template(const char *file) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", file);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) { fprintf(stderr, "%s: not an absolute path below /\n", file); return 2; }
    *slash = 0;
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) { perror("mkdir"); return 1; }
    struct statx stx;
    if (statx(AT_FDCWD, dir, AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &stx) < 0) { perror("statx"); return 1; }
    if (!((stx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) && (stx.stx_attributes & STATX_ATTR_MOUNT_ROOT)) &&
        mount(dir, dir, NULL, MS_BIND, NULL) < 0) {
        fprintf(stderr, "bind %s onto itself: %s\n", dir, strerror(errno));
        return 1;
    }
    if (mount(NULL, dir, NULL, MS_PRIVATE, NULL) < 0) { fprintf(stderr, "make %s private: %s\n", dir, strerror(errno)); return 1; }
    int fd = open(file, O_WRONLY | O_CREAT | O_CLOEXEC, 0444);
    if (fd < 0) { perror("create the namespace file"); return 1; }
    close(fd);
    int ready[2], done[2];
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(done, O_CLOEXEC) < 0) { perror("pipe"); return 1; }
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child == 0) {
        close(ready[0]);
        close(done[1]);
        /* any directory of the copy will do as the mount point: it is left behind with the host's tree */
        if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
            mount("shoal-template", dir, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555") < 0 ||
            chdir(dir) < 0 || syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 || chdir("/") < 0) {
            fprintf(stderr, "template namespace: %s\n", strerror(errno));
            _exit(1);
        }
        if (write(ready[1], "k", 1) != 1) _exit(1);
        char b;
        (void)!read(done[0], &b, 1); /* until the parent has bound the namespace */
        _exit(0);
    }
    close(ready[1]);
    close(done[0]);
    char b, nspath[64];
    int rc = 1;
    if (read(ready[0], &b, 1) == 1) {
        snprintf(nspath, sizeof nspath, "/proc/%d/ns/mnt", child);
        if (mount(nspath, file, NULL, MS_BIND, NULL) == 0) rc = 0;
        else fprintf(stderr, "bind the mount namespace on %s: %s\n", file, strerror(errno));
    }
    close(done[1]);
    int st;
    waitpid(child, &st, 0);
    return rc;
}

static void usage(void) {
    fprintf(stderr,
            "usage: shoal-init launch --state DIR --lower L1:L2 --hostname H --disk-mb N [--shm-mb N]\n"
            "                         [--cgroup DIR]... [--ttl-ms N] [--idle-ttl-ms N] [--tombstone FILE]\n"
            "                         [--net none|host] [--ca-bundle FILE] [--upper tmpfs|mounted]\n"
            "                         [--memory-cgroup DIR] [--oom-kill command|sandbox]\n"
            "                         [--memory-pooled 0|1] [--join-cgroup DIR]\n"
            "                         [--ksm 0|1] [--aslr 0|1] [--sysfs DIR] [--empty-dir DIR]\n"
            "                         [--mntns FILE]\n"
            "       shoal-init seccomp-table | ksm-probe\n"
            "       shoal-init sysfs-template DIR NSFILE\n"
            "       shoal-init mntns-template FILE\n");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "seccomp-table") == 0) return print_seccomp_table();
    if (argc == 4 && strcmp(argv[1], "sysfs-template") == 0) return sysfs_template(argv[2], argv[3]);
    if (argc == 3 && strcmp(argv[1], "mntns-template") == 0) return mntns_template(argv[2]);
    if (argc == 2 && strcmp(argv[1], "ksm-probe") == 0) return ksm_probe();
    if (argc < 2 || strcmp(argv[1], "launch") != 0) usage();
    static char rootfs[4096], disk[4096], sock[4096];
    cfg.shm_mb = 64;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--state")) cfg.state_dir = v;
        else if (!strcmp(a, "--lower")) cfg.lower = v;
        else if (!strcmp(a, "--hostname")) cfg.hostname = v;
        else if (!strcmp(a, "--disk-mb")) cfg.disk_mb = atol(v);
        else if (!strcmp(a, "--shm-mb")) cfg.shm_mb = atol(v);
        else if (!strcmp(a, "--ttl-ms")) cfg.ttl_ms = atoll(v);
        else if (!strcmp(a, "--idle-ttl-ms")) cfg.idle_ttl_ms = atoll(v);
        else if (!strcmp(a, "--tombstone")) cfg.tombstone = v;
        else if (!strcmp(a, "--ksm") || !strcmp(a, "--aslr")) {
            if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0) usage();
            if (a[2] == 'k') cfg.ksm = v[0] == '1';
            else cfg.no_aslr = v[0] == '0';
        }
        else if (!strcmp(a, "--ca-bundle")) cfg.ca_bundle = v;
        else if (!strcmp(a, "--sysfs")) cfg.sysfs = v;
        else if (!strcmp(a, "--empty-dir")) cfg.empty_dir = v;
        else if (!strcmp(a, "--mntns")) cfg.mntns = v;
        else if (!strcmp(a, "--memory-cgroup")) cfg.memory_cgroup = v;
        else if (!strcmp(a, "--memory-pooled")) {
            if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0) usage();
            cfg.memory_pooled = v[0] == '1';
        }
        else if (!strcmp(a, "--join-cgroup")) cfg.join_cgroup = v;
        else if (!strcmp(a, "--oom-kill")) {
            if (!strcmp(v, "sandbox")) cfg.oom_kill = OOM_KILL_SANDBOX;
            else if (strcmp(v, "command") != 0) usage();
        }
        else if (!strcmp(a, "--upper")) {
            if (!strcmp(v, "mounted")) cfg.upper_mounted = 1;
            else if (strcmp(v, "tmpfs") != 0) usage();
        }
        else if (!strcmp(a, "--net")) {
            if (!strcmp(v, "host")) cfg.host_net = 1;
            else if (strcmp(v, "none") != 0) usage();
        }
        else if (!strcmp(a, "--cgroup")) {
            if (cfg.n_cgroups == MAX_CGROUPS) usage();
            cfg.cgroups[cfg.n_cgroups++] = v;
        } else usage();
    }
    if (!cfg.state_dir || !cfg.lower || !cfg.hostname || cfg.disk_mb <= 0) usage();
    /* own copies of everything that points into argv, which init wipes */
    cfg.state_dir = strdup(cfg.state_dir);
    cfg.lower = strdup(cfg.lower);
    cfg.hostname = strdup(cfg.hostname);
    if (cfg.tombstone) cfg.tombstone = strdup(cfg.tombstone);
    if (cfg.ca_bundle) cfg.ca_bundle = strdup(cfg.ca_bundle);
    if (cfg.sysfs) cfg.sysfs = strdup(cfg.sysfs);
    if (cfg.empty_dir) cfg.empty_dir = strdup(cfg.empty_dir);
    if (cfg.mntns) cfg.mntns = strdup(cfg.mntns);
    if (cfg.memory_cgroup) cfg.memory_cgroup = strdup(cfg.memory_cgroup);
    if (cfg.join_cgroup) cfg.join_cgroup = strdup(cfg.join_cgroup);
    for (int i = 0; i < cfg.n_cgroups; i++) cfg.cgroups[i] = strdup(cfg.cgroups[i]);
    g_argv = argv;
    snprintf(rootfs, sizeof rootfs, "%s/rootfs", cfg.state_dir);
    snprintf(disk, sizeof disk, "%s/disk", cfg.state_dir);
    snprintf(sock, sizeof sock, "%s/agent.sock", cfg.state_dir);
    cfg.rootfs = rootfs;
    cfg.disk = disk;
    cfg.sock = sock;

    int ready[2];
    mark("exec");
    if (pipe2(ready, O_CLOEXEC) < 0) die("pipe");
    pid_t sup = fork();
    if (sup < 0) die("fork");
    if (sup == 0) {
        close(ready[0]);
        _exit(supervise(ready[1]));
    }
    close(ready[1]);
    char line[1200];
    ssize_t n = 0, r;
    while (n < (ssize_t)sizeof line - 1 && (r = read(ready[0], line + n, sizeof line - 1 - (size_t)n)) > 0) {
        n += r;
        if (memchr(line, '\n', (size_t)n)) break;
    }
    line[n] = 0;
    /* the supervisor's first fork child is reparented; reap nothing here except a failed one */
    if (n == 0) {
        int st;
        waitpid(sup, &st, 0);
        fprintf(stdout, "ERR supervisor died before the sandbox started\n");
        return 1;
    }
    fputs(line, stdout);
    if (strncmp(line, "OK", 2) != 0) {
        waitpid(sup, NULL, 0);
        return 1;
    }
    return 0;
}
