"""shoald: the host daemon (HTTP API over a Unix socket, optionally TCP+TLS), tenants, admission."""
