"""Images whose layers are not on this host yet: where their bytes come from (`origin`), how a layer
is cut into verifiable chunks (`chunks`), and how a sandbox reads them on demand (docs/lazy-loading.md)."""
