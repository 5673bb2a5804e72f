/* Tries each operation the sandbox must forbid and prints NAME=errno-name (OK if it succeeded).
 * Built statically by the security tests and placed in a layer, so it runs in any image. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <netinet/in.h>
#include <unistd.h>

static void report(const char *name, long rc) {
    if (rc < 0) printf("%s=%s\n", name, strerrorname_np(errno));
    else printf("%s=OK\n", name);
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : NULL;
#define TRY(name, expr) if (!only || !strcmp(only, name)) { errno = 0; report(name, (long)(expr)); }
    TRY("mount", mount("tmpfs", "/tmp", "tmpfs", 0, NULL));
    TRY("umount", umount2("/proc", MNT_DETACH));
    TRY("unshare_user", unshare(CLONE_NEWUSER));
    TRY("unshare_mnt", unshare(CLONE_NEWNS));
    TRY("clone_newuser", syscall(SYS_clone, CLONE_NEWUSER | 17, 0, 0, 0, 0));
    TRY("ptrace_init", ptrace(PTRACE_ATTACH, 1, 0, 0));
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
    TRY("socket_inet_ok", socket(AF_INET, SOCK_STREAM, 0)); /* control: ordinary calls still work */
    return 0;
}
