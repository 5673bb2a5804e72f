#!/bin/sh
# Baked into the VM image; started by shoal-vm-test.service once the guest is up. Mounts the work disk
# (the source tree, made fresh by vm/run.py on each run), runs its vm/guest-run.sh, records the exit
# code on that disk for the host to read, and powers off.
echo "SHOAL-VM: guest up ($(uname -r))"
mkdir -p /shoal
if ! mount -t ext4 /dev/vdb /shoal; then
  echo "SHOAL-VM: cannot mount the work disk /dev/vdb"
  systemctl --no-block poweroff 2>/dev/null || poweroff -f
  exit 1
fi
mkdir -p /shoal/.vm-out
/bin/bash /shoal/vm/guest-run.sh
echo "$?" > /shoal/.vm-out/rc
sync
umount /shoal || umount -l /shoal
echo "SHOAL-VM: done, powering off"
systemctl --no-block poweroff 2>/dev/null || poweroff -f
