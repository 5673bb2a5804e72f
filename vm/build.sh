#!/usr/bin/env bash
# Build (once, cached) the test VM: a debootstrap'd Debian bookworm root with the stock 6.1 kernel,
# systemd as PID 1 (unified cgroup hierarchy, bookworm's default), and what the test subset needs.
#
#   vm/build.sh MIRROR [CACHE_DIR]   -> prints the image directory (vmlinuz, initrd.img, rootfs.img)
#
# The image directory is keyed by a hash of this script, the guest files and vm/requirements.txt, so a
# second run reuses it and only the source tree travels into the VM (vm/run.py). The debootstrap stage
# is cached on its own (keyed by suite + packages): changing the guest set-up does not redo it.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MIRROR="${1:?usage: vm/build.sh MIRROR [CACHE_DIR]}"
CACHE="${2:-/var/cache/shoal-vm}"
SUITE=bookworm
# linux-image-amd64 on bookworm is Debian's 6.1 kernel; initramfs-tools (its dependency) makes the initrd
PKGS=linux-image-amd64,initramfs-tools,systemd-sysv,udev,kmod,util-linux,mount,e2fsprogs,procps,\
python3,python3-venv,ca-certificates,erofs-utils,busybox-static,gcc,libc6-dev,iproute2,nftables,openssl

BASE_KEY=$(echo "$SUITE $PKGS" | sha256sum | cut -c1-16)
KEY=$(cat "$0" "$HERE/requirements.txt" "$HERE/guest-entry.sh" "$HERE/shoal-vm-test.service" \
      <(echo "$BASE_KEY") | sha256sum | cut -c1-16)
OUT="$CACHE/$KEY"
if [ -f "$OUT/.complete" ]; then
  echo "$OUT"
  exit 0
fi
log() { echo "[vm-build $(date +%H:%M:%S)] $*" >&2; }
mkdir -p "$CACHE"
BASE="$CACHE/base-$BASE_KEY"
if [ ! -f "$BASE/.complete" ]; then
  log "debootstrap $SUITE (+ stock kernel, systemd, test tools) from the host's apt mirror: a few minutes"
  rm -rf "$BASE.tmp"
  mkdir -p "$BASE.tmp"
  debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$BASE.tmp/root" "$MIRROR" \
    > "$BASE.tmp/debootstrap.log" 2>&1 || {
    tail -30 "$BASE.tmp/debootstrap.log" >&2; echo "debootstrap failed (log above)" >&2; exit 1; }
  rm -rf "$BASE.tmp/root/var/cache/apt/archives/"*.deb
  touch "$BASE.tmp/.complete"
  rm -rf "$BASE"
  mv "$BASE.tmp" "$BASE"
fi

WORK=$(mktemp -d "$CACHE/build.XXXXXX")
ROOT="$WORK/root"
cleanup() {
  for m in dev/pts dev proc sys; do umount -l "$ROOT/$m" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
log "copying the debootstrap stage"
cp -a "$BASE/root" "$ROOT"
mount --bind /dev "$ROOT/dev"; mount --bind /dev/pts "$ROOT/dev/pts"
mount -t proc proc "$ROOT/proc"; mount -t sysfs sys "$ROOT/sys"

log "guest configuration"
echo shoal-vm > "$ROOT/etc/hostname"
printf '/dev/vda / ext4 rw,errors=remount-ro 0 1\n' > "$ROOT/etc/fstab"
# no resume device to wait for at boot
echo RESUME=none > "$ROOT/etc/initramfs-tools/conf.d/resume"
# keep the serial console for the test output, and nothing starts work of its own mid-run
for u in serial-getty@ttyS0.service getty@tty1.service systemd-timesyncd.service apt-daily.timer \
         apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
  ln -sf /dev/null "$ROOT/etc/systemd/system/$u"
done
install -m 0755 "$HERE/guest-entry.sh" "$ROOT/usr/local/sbin/shoal-vm-entry"
install -m 0644 "$HERE/shoal-vm-test.service" "$ROOT/etc/systemd/system/shoal-vm-test.service"
mkdir -p "$ROOT/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/shoal-vm-test.service \
  "$ROOT/etc/systemd/system/multi-user.target.wants/shoal-vm-test.service"
chroot "$ROOT" update-initramfs -u -k all > "$WORK/initramfs.log" 2>&1 || {
  tail -20 "$WORK/initramfs.log" >&2; exit 1; }

log "python venv with the test subset's imports (vm/requirements.txt)"
# the host's pip fetches the wheels (it is configured for this host's registry access: index, CA bundle);
# the guest's venv installs them offline. Host and guest are both Debian 12: CPython 3.11, x86_64, glibc 2.36
"${HOST_PYTHON:-python3}" -m pip download -q --only-binary=:all: \
  -d "$ROOT/tmp/wheels" -r "$HERE/requirements.txt" 2> >(grep -v "is ignored" >&2)
chroot "$ROOT" python3 -m venv /opt/shoal-venv
chroot "$ROOT" env -u PIP_FIND_LINKS /opt/shoal-venv/bin/pip install -q --no-index --find-links /tmp/wheels \
  $(sed -e 's/#.*//' "$HERE/requirements.txt") >&2
rm -rf "$ROOT/tmp/wheels" "$ROOT/root/.cache" "$ROOT/var/lib/apt/lists/"*

for m in dev/pts dev proc sys; do umount -l "$ROOT/$m"; done
mkdir -p "$WORK/out"
cp -L "$ROOT/vmlinuz" "$WORK/out/vmlinuz"
cp -L "$ROOT/initrd.img" "$WORK/out/initrd.img"
KVER=$(basename "$(readlink "$ROOT/vmlinuz")" | sed 's/^vmlinuz-//')
echo "$KVER" > "$WORK/out/kernel-version"

log "ext4 root image (kernel $KVER)"
used_mb=$(du -sm "$ROOT" | cut -f1)
# room for the tests' state (Shoal roots under /tmp, layer images, compiled shoal-init)
mkfs.ext4 -q -L shoalvm -d "$ROOT" "$WORK/out/rootfs.img" "$((used_mb + 3072))M"
rm -rf "$OUT"
mv "$WORK/out" "$OUT"
touch "$OUT/.complete"
# older images (other keys) are dropped: one image per cache
find "$CACHE" -mindepth 1 -maxdepth 1 -type d ! -name "$KEY" ! -name "base-$BASE_KEY" ! -name "build.*" \
  -exec rm -rf {} +
log "image ready: $OUT"
echo "$OUT"
