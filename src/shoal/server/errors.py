"""Every error shoald answers has one shape: `{"error": shoal.core.errors.to_wire(e)}` with
`http_status(e)`; the HTTP backend raises the same class from it (`from_wire`).

Validation of a request answers 422, text that is not valid Unicode 400, another tenant's object 404
(never 403: existence is not confirmed). A 500 is a bug: logged here with its traceback, answered
as `InternalError` in the usual shape."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core import errors as E

log = logging.getLogger("shoald")


class NotFound(E.ShoalError):
    """No such route (the framework's own 404)."""


class HTTPError(E.ShoalError):
    """Another framework-level refusal (405 method not allowed...)."""


def fields_message(errors) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                     for e in errors)


def unicode_error(exc: UnicodeError) -> E.InvalidArgument:
    # JSON may carry lone surrogates (\\udXXX) that no file name, command or byte string can hold
    return E.InvalidArgument(f"the request holds text that is not valid Unicode (e.g. a lone surrogate): {exc}")


def as_shoal_error(exc: BaseException) -> E.ShoalError:
    """The typed error a failure is answered as (unknown exceptions: InternalError, logged)."""
    if isinstance(exc, E.ShoalError):
        return exc
    if isinstance(exc, UnicodeError):
        return unicode_error(exc)
    if isinstance(exc, ValidationError):  # a model built inside a handler rejected the client's values
        return E.InvalidArgument(fields_message(exc.errors()))
    log.error("internal error", exc_info=exc)
    return E.InternalError(f"internal error ({type(exc).__name__}); see the shoald log")


def sse_error(exc: BaseException) -> str:
    """The `error` event that ends an exec stream whose headers were already sent."""
    return f"event: error\ndata: {json.dumps(E.to_wire(as_shoal_error(exc)))}\n\n"


def install(app: FastAPI, counters: dict[str, int] | None) -> None:
    def respond(exc: E.ShoalError, status: int | None = None) -> JSONResponse:
        code = status or E.http_status(exc)
        if counters is not None:
            counters["errors_4xx" if code < 500 else "errors_5xx"] += 1
        return JSONResponse({"error": E.to_wire(exc)}, status_code=code,
                            headers={"Retry-After": "1"} if exc.retryable else None)

    @app.exception_handler(E.ShoalError)
    async def shoal_error(_: Request, exc: E.ShoalError):
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return respond(E.InvalidArgument(fields_message(exc.errors())), 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        err = NotFound(str(exc.detail)) if exc.status_code == 404 else HTTPError(str(exc.detail))
        return respond(err, exc.status_code)

    @app.exception_handler(ValidationError)
    async def model_error(_: Request, exc: ValidationError):
        return respond(as_shoal_error(exc), 400)

    @app.exception_handler(UnicodeError)
    async def unicode_error_(_: Request, exc: UnicodeError):
        return respond(unicode_error(exc), 400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return respond(E.InternalError(f"internal error ({type(exc).__name__}); see the shoald log"), 500)
