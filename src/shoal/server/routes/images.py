"""Images and layers of this host's store, as a tenant may see them: its own and the shared ones."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Response

from ...core import errors as E
from ...core.contract import API_PREFIX, ImageSummary
from ..auth import Caller, caller

router = APIRouter(prefix=API_PREFIX, tags=["images"])


def visible_images(c: Caller) -> list[ImageSummary]:
    out = []
    for img in c.d.backend.images():
        owner = c.d.state.owner("image", img.ref)
        if c.t.admin or owner in (None, c.t.name):
            out.append(img.model_copy(update={"owner": owner}))
    return out


@router.get("/images")
def images(c: Caller = Depends(caller)) -> list[ImageSummary]:
    return visible_images(c)


@router.delete("/images/{ref:path}", status_code=204)
def remove_image(ref: str, c: Caller = Depends(caller)) -> Response:
    c.d.check_image(c.t, ref)
    if c.d.state.owner("image", ref) is None and not c.t.admin:
        raise E.Unauthorized(f"image {ref} is shared; only the admin may remove it")
    c.d.remove_image(ref)
    c.d.state.disown("image", ref)
    return Response(status_code=204)


@router.get("/layers")
def layers(c: Caller = Depends(caller)) -> list[dict[str, Any]]:
    visible = None if c.t.admin else {digest for img in visible_images(c) for digest in img.layers}
    return [x if c.t.admin else {k: v for k, v in x.items() if k != "source"}
            for x in c.d.layers() if visible is None or x["digest"] in visible]
