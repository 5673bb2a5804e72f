/* Tries to reach the host's root file system from inside a sandbox (after shoal-init's root switch).
 * Prints NAME=VALUE lines; test_root_switch.py reads them.
 *   root_escape MARKER   MARKER: an absolute path that exists only on the host's root file system */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *seen(const char *path) { return access(path, F_OK) == 0 ? "yes" : "no"; }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    const char *marker = argv[1];
    char up[4096];
    /* ".." above "/" many times */
    snprintf(up, sizeof up, "/../../../../../../..%s", marker);
    printf("dotdot=%s\n", seen(up));
    /* the classic chroot escape: chroot into a subdirectory while the cwd stays outside it, walk
     * ".." past the new root, chroot there */
    mkdir("/esc", 0755);
    struct stat root0;
    if (stat("/", &root0) < 0) return 3;
    int cwd = open("/", O_RDONLY | O_DIRECTORY);
    if (chroot("/esc") < 0) { printf("chroot=%s\n", strerror(errno)); return 0; }
    if (fchdir(cwd) < 0) return 3;
    for (int i = 0; i < 64; i++) (void)chdir("..");
    printf("chroot_escape_chroot=%s\n", chroot(".") == 0 ? "ok" : strerror(errno));
    printf("chroot_escape=%s\n", seen(marker));
    /* where the escape landed: the sandbox's own root again, or an empty directory (the template's
     * root), or somewhere else */
    struct stat now;
    int entries = -1;
    DIR *dir = opendir("/");
    if (dir) {
        entries = 0;
        for (struct dirent *e; (e = readdir(dir));) entries += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
        closedir(dir);
    }
    const char *at = "other";
    if (stat("/", &now) == 0 && now.st_dev == root0.st_dev && now.st_ino == root0.st_ino) at = "sandbox_root";
    else if (entries == 0) at = "empty";
    printf("escape_at=%s\n", at);
    /* uncover what is under "/" */
    printf("umount_root=%s\n", umount2("/", MNT_DETACH) == 0 ? "ok" : strerror(errno));
    printf("after_umount=%s\n", seen(marker));
    printf("bin_busybox=%s\n", seen("/bin/busybox"));
    return 0;
}
