"""Many Shoal hosts behind one API, with the fleet's state in PostgreSQL (docs/fleet.md).

  schema     the tables (hosts, sandbox directory, tenants, owners, snapshots); database-clock times
  directory  hosts under leases; sandboxes: reserve (quota + placement, one transaction), confirm,
             locate, expire (lease ran out -> LOST with the reason)
  placement  the score: image locality, spread over failure domains, free capacity
  tenants    tenants, keys, owners: the TenantStore a host keeps in SQLite, fleet-wide
  backend    FleetBackend: the contract over many hosts (creates placed, every other call routed)
  gateway    shoald's routes over a FleetBackend: `shoal gateway`
  agent      the host's side inside shoald: register, heartbeat, reconcile (`shoal serve --join`)
  pki        the fleet CA: host server certificates, the gateways' client certificate (mTLS)

Everything here needs the `fleet` extra (psycopg, cryptography); a single host needs none of it.
"""
from __future__ import annotations

try:
    import cryptography  # noqa: F401  (the fleet CA)
    import psycopg  # noqa: F401  (the directory)
except ImportError as e:  # an extra: a single host needs none of it
    raise ImportError("the fleet needs psycopg and cryptography: pip install 'shoal[fleet]'") from e
