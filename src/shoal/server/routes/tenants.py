"""Tenants and their API keys (admin only)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, Field

from ...core import errors as E
from ...core.contract import API_PREFIX
from ..auth import Caller, admin_caller
from ..state import Quotas

router = APIRouter(prefix=API_PREFIX + "/tenants", tags=["tenants"])


class TenantRequest(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="lowercase letters, digits, _ and -")
    quotas: dict[str, float] | None = None


def _quotas(fields: dict[str, float]) -> Quotas:
    try:
        return Quotas(**fields)  # type: ignore[arg-type]  # JSON numbers; Quotas checks each is > 0
    except TypeError as e:  # an unknown field name: the caller's error, not a 500
        raise E.InvalidArgument(f"unknown quota field: {e}") from None


@router.post("", status_code=201)
def create_tenant(body: TenantRequest, c: Caller = Depends(admin_caller)) -> dict[str, Any]:
    """Answers the tenant's API key, once (only its hash is kept)."""
    tnt, key = c.d.state.create_tenant(body.name, _quotas(body.quotas) if body.quotas else None)
    return {"name": tnt.name, "quotas": tnt.quotas.__dict__, "api_key": key}


@router.get("")
def list_tenants(c: Caller = Depends(admin_caller)) -> list[dict[str, Any]]:
    return [{"name": x.name, "quotas": x.quotas.__dict__, "created": x.created, "usage": c.d.usage(x)}
            for x in c.d.state.list_tenants()]


@router.put("/{name}/quotas")
def set_quotas(name: str, quotas: dict[str, float], c: Caller = Depends(admin_caller)) -> dict[str, Any]:
    return {"name": name, "quotas": c.d.state.set_quotas(name, _quotas(quotas)).quotas.__dict__}


@router.delete("/{name}", status_code=204)
def delete_tenant(name: str, c: Caller = Depends(admin_caller)) -> Response:
    c.d.state.delete_tenant(name)
    return Response(status_code=204)
