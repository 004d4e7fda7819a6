"""The service's own failures and the one error envelope every non-2xx response carries."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A failure the service answers on purpose: an HTTP status, a stable code, a message.

    `field` names the offending request field (dotted path) where there is one. The
    message never contains the bearer token or the caller's state text.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}

    @property
    def is_client_error(self) -> bool:
        """True for a refusal of the request itself (4xx): nothing ran that needs releasing."""
        return 400 <= self.status < 500

    def envelope(self, request_id: str | None = None) -> dict[str, Any]:
        """The JSON body of the error response."""
        body: dict[str, Any] = {"code": self.code, "message": self.message, "field": self.field}
        if request_id is not None:
            body["request_id"] = request_id
        return {"error": body}


def invalid(field: str | None, message: str, code: str = "validation_error") -> ServiceError:
    """A request that breaks a rule of the contract (422)."""
    return ServiceError(422, code, message, field)


def out_of_memory(detail: str = "") -> ServiceError:
    """The device ran out of memory serving this request (503); memory is released."""
    suffix = f" {detail}" if detail else ""
    return ServiceError(
        503,
        "out_of_memory",
        "The request did not fit in the service's memory cap; memory was released. "
        "Split the decisions across smaller requests." + suffix,
        headers={"Retry-After": "1"},
    )


def internal(message: str = "The service failed while answering this request.") -> ServiceError:
    """An unexpected failure (500); the service stays up."""
    return ServiceError(500, "internal_error", message)
