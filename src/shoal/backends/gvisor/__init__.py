"""The gvisor backend: Shoal's layer stacks under gVisor (runsc). See backend.py and docs/backends.md."""
