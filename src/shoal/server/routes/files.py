"""Files inside a sandbox. File contents and tars travel as raw bodies, not JSON."""
from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Query, Response

from ...core.contract import (
    API_PREFIX,
    DEFAULT_DOWNLOAD_MAX,
    DEFAULT_READ_MAX,
    FileEntry,
)
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX + "/sandboxes/{sandbox_id}/files", tags=["files"])


@router.get("", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
def read_file(sandbox_id: str, path: str, max_bytes: int = Query(DEFAULT_READ_MAX, gt=0, le=1 << 40),
              c: Caller = Depends(caller)) -> Response:
    data = c.d.backend.read_file(c.sandbox(sandbox_id), path, max_bytes)
    return Response(data, media_type="application/octet-stream")


@router.put("")
def write_file(sandbox_id: str, path: str, request_body: bytes = Body(b"", media_type="application/octet-stream"),
               mode: int = Query(0o644, ge=0, le=0o7777), c: Caller = Depends(caller)) -> dict[str, int]:
    return {"bytes": c.d.backend.write_file(c.sandbox(sandbox_id), path, request_body, mode)}


@router.delete("", status_code=204)
def remove_file(sandbox_id: str, path: str, c: Caller = Depends(caller)) -> Response:
    c.d.backend.remove_file(c.sandbox(sandbox_id), path)
    return Response(status_code=204)


@router.post("/mkdir", status_code=204)
def mkdir(sandbox_id: str, path: str, c: Caller = Depends(caller)) -> Response:
    c.d.backend.mkdir(c.sandbox(sandbox_id), path)
    return Response(status_code=204)


@router.post("/xattrs", status_code=204)
def set_xattrs(sandbox_id: str, path: str, attrs: dict[str, str] = Body(...), c: Caller = Depends(caller)) -> Response:
    """Set `user.*` extended attributes of a file (contract's set_xattrs limits)."""
    c.d.backend.set_xattrs(c.sandbox(sandbox_id), path, attrs)
    return Response(status_code=204)


@router.post("/chown", status_code=204)
def chown(sandbox_id: str, path: str, uid: int = Query(ge=0, lt=1 << 31), gid: int = Query(ge=0, lt=1 << 31),
          c: Caller = Depends(caller)) -> Response:
    """Set a file's owner inside the sandbox (a symlink itself, never its target)."""
    c.d.backend.chown(c.sandbox(sandbox_id), path, uid, gid)
    return Response(status_code=204)


@router.get("/list")
def list_files(sandbox_id: str, path: str = "/", c: Caller = Depends(caller)) -> list[FileEntry]:
    return c.d.backend.list_files(c.sandbox(sandbox_id), path)


@router.get("/stat")
def stat_file(sandbox_id: str, path: str, c: Caller = Depends(caller)) -> FileEntry:
    return c.d.backend.stat_file(c.sandbox(sandbox_id), path)


@router.post("/upload")
def upload_tar(sandbox_id: str, dest: str, request_body: bytes = Body(..., media_type="application/x-tar"),
               c: Caller = Depends(caller)) -> dict[str, int]:
    """Extract a tar into `dest`; answers the number of entries written."""
    return {"entries": c.d.backend.upload_tar(c.sandbox(sandbox_id), dest, request_body)}


@router.get("/download", response_class=Response, responses={200: {"content": {"application/x-tar": {}}}})
def download_tar(sandbox_id: str, path: str, max_bytes: int = Query(DEFAULT_DOWNLOAD_MAX, gt=0, le=1 << 40),
                 c: Caller = Depends(caller)) -> Response:
    return Response(c.d.backend.download_tar(c.sandbox(sandbox_id), path, max_bytes), media_type="application/x-tar")
