"""HTTP errors: a status, a stable code, a message and a field, and the native error envelope
(its body model, serialised once by `error_response`)."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import JSONResponse

from semif_serve.domain.echo import bounded_message


class ErrorDetail(BaseModel):
    """What went wrong: a stable code, the rule, the offending field (or null), the request id."""

    code: str
    message: str
    field: str | None
    request_id: str | None = None


class ErrorEnvelope(BaseModel):
    """The one body every non-2xx native response carries."""

    error: ErrorDetail


class ServiceError(Exception):
    """A failure the service answers on purpose: an HTTP status, a stable code, a message.

    `field` names the offending request field (dotted path) where there is one. The
    message never contains the bearer token or the caller's state text, and is bounded
    (`domain.echo`).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = bounded_message(message)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}

    def envelope(self, request_id: str | None = None) -> ErrorEnvelope:
        """The body of the error response (`request_id` left out where there is none)."""
        detail = ErrorDetail(code=self.code, message=self.message, field=self.field)
        if request_id is not None:
            detail.request_id = request_id
        return ErrorEnvelope(error=detail)


def error_response(error: ServiceError, request_id: str | None = None) -> JSONResponse:
    """The native envelope as a response: the one serialisation of every native error."""
    headers = dict(error.headers)
    if request_id is not None:
        headers["X-Request-ID"] = request_id
    body = error.envelope(request_id).model_dump(mode="json", exclude_unset=True)
    return JSONResponse(body, status_code=error.status, headers=headers)


# The errors a door answers on its own (not from a domain error): code -> status.
HTTP_ERRORS = {
    "invalid_json": 400,
    "invalid_content_length": 400,
    "invalid_compressed_body": 400,
    "invalid_http_request": 400,
    "duplicate_header": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "body_timeout": 408,
    "header_timeout": 408,
    "body_too_large": 413,
    "unsupported_content_encoding": 415,
    "validation_error": 422,
    "busy": 429,
    "internal_error": 500,
    "draining": 503,
}


def invalid(field: str | None, message: str) -> ServiceError:
    """A request that breaks a rule of the contract (422)."""
    return ServiceError(HTTP_ERRORS["validation_error"], "validation_error", message, field)


def internal(message: str = "The service failed while answering this request.") -> ServiceError:
    """An unexpected failure (500); the service stays up."""
    return ServiceError(HTTP_ERRORS["internal_error"], "internal_error", message)
