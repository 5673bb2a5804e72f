"""Media types and annotation keys: the wire format of Shoal images in an OCI registry.

A Shoal image is an OCI image manifest whose config blob is the Shoal image config
(`SHOAL_CONFIG_MEDIA_TYPE`) and whose `layers` list, bottom to top, holds each layer's EROFS image
(`LAYER_MEDIA_TYPE`) followed by its chunk index (`CHUNK_INDEX_MEDIA_TYPE`). Both descriptors carry
the Shoal layer digest (the tree digest the layer store is keyed by) in `ANN_LAYER`, so a puller
knows what it already has before it fetches a byte. Ordinary container images use the OCI and
Docker types below and are converted on pull."""
from __future__ import annotations

from ..lazy.chunks import CHUNK_INDEX_MEDIA_TYPE, LAYER_MEDIA_TYPE

SHOAL_CONFIG_MEDIA_TYPE = "application/vnd.shoal.image.config.v1+json"

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT_MANIFESTS = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

# container layer media types -> compression ("gzip", "zstd", "" for a plain tar)
CONTAINER_LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "",
}

ANN_LAYER = "io.shoal.layer.digest"  # the Shoal (tree) digest of the layer
ANN_LAYER_SIZE = "io.shoal.layer.size"  # bytes of file content (LayerInfo.size)
ANN_LAYER_ENTRIES = "io.shoal.layer.entries"
ANN_CHUNKS = "io.shoal.layer.chunks"  # on the layer descriptor: the digest of its chunk-index blob
# on a layer pushed laid out by first read (`push --relayout`): how many bytes at the blob's start
# hold what the recorded run read before its first command finished (eStargz's prefetch landmark)
ANN_STARTUP_BYTES = "io.shoal.layer.startup-bytes"
ANN_TITLE = "org.opencontainers.image.title"

# prefetch lists (shoal.registry.prefetch): an artifact manifest per layer blob, tagged
# `shoal-prefetch-<hex of the EROFS blob>`, whose one blob is the list
PREFETCH_MEDIA_TYPE = "application/vnd.shoal.layer.v1.prefetch+json"
ANN_PREFETCH_BLOB = "io.shoal.prefetch.blob"  # the EROFS blob (sha256) the list's chunk numbers refer to
OCI_EMPTY = "application/vnd.oci.empty.v1+json"

__all__ = [
    "LAYER_MEDIA_TYPE", "CHUNK_INDEX_MEDIA_TYPE", "SHOAL_CONFIG_MEDIA_TYPE", "OCI_INDEX",
    "OCI_MANIFEST", "OCI_CONFIG", "DOCKER_LIST", "DOCKER_MANIFEST", "DOCKER_CONFIG", "INDEX_TYPES",
    "MANIFEST_TYPES", "ACCEPT_MANIFESTS", "CONTAINER_LAYER_TYPES", "ANN_LAYER", "ANN_LAYER_SIZE",
    "ANN_LAYER_ENTRIES", "ANN_CHUNKS", "ANN_STARTUP_BYTES", "ANN_TITLE", "PREFETCH_MEDIA_TYPE",
    "ANN_PREFETCH_BLOB", "OCI_EMPTY",
]
