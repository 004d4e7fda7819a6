"""System One's errors: the one table from domain error to TypeSafe's answer, the door's own
refusals, and every error on `/v1/...` as TypeSafe's body models (422 in FastAPI's shape)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from semif_serve.domain import types as domain
from semif_serve.domain.types import DecisionError
from semif_serve.doors.base import (
    ErrorRule,
    error_responses,
    json_reply,
)
from semif_serve.doors.systemone.schemas import (
    SystemOneValidationError,
    TypeSafeError,
    TypeSafeErrorDetail,
    TypeSafeValidationError,
    ValidationItem,
)
from semif_serve.http.errors import ServiceError

SYSTEMONE_ERRORS: dict[type[DecisionError], ErrorRule] = {
    domain.TooManyOptions: ErrorRule(
        400, "api_usage_error", when="more options than the loaded tokenizer's answer codes"
    ),
    domain.TooManyRows: ErrorRule(
        413, "request_too_large", when="questions × orderings over SEMIF_SYSTEMONE_MAX_ROWS"
    ),
    domain.TooManyTokens: ErrorRule(
        413,
        "request_too_large",
        when="a prompt over SEMIF_SYSTEMONE_MAX_INPUT_TOKENS; the message gives the need",
    ),
    domain.TooLargeForMemory: ErrorRule(
        413, "request_too_large", when="one row alone needs more memory than the cap leaves"
    ),
    domain.ImageTooLargeForMemory: ErrorRule(
        413, "request_too_large", when="an image needs more memory in the vision tower than the cap leaves"
    ),
    domain.UnknownWorkload: ErrorRule(
        400, "api_usage_error", when="`x_workload` is not in the calibration file"
    ),
    domain.WorkloadOfAnotherModel: ErrorRule(
        400,
        "api_usage_error",
        when="the question's workload is calibrated on another served model than `model`",
    ),
    domain.AnswerBoundary: ErrorRule(
        400, "api_usage_error", when="appending an answer code would change this prompt's tokenisation"
    ),
    domain.ReplyTooLarge: ErrorRule(
        413,
        "request_too_large",
        when="the reply, counted before any engine work, is over SEMIF_MAX_REPLY_BYTES; gives the need",
    ),
    domain.Unanswerable: ErrorRule(
        400,
        "api_usage_error",
        when="the model's method does not read what was asked (a lev model: a box, images, `x_orderings` "
        "or `x_workload`; a question for a candidate head its release lacks); the message names the field",
    ),
    domain.OutOfMemory: ErrorRule(
        503,
        "overloaded_error",
        headers={"Retry-After": "1"},
        when="the forward ran out of device memory; released",
    ),
    domain.EngineFailure: ErrorRule(500, "internal_error", when="an unexpected engine failure"),
}

# Errors raised outside the core (admission, routing, the door) by native code -> TypeSafe type.
HTTP_ERROR_TYPES = {
    "unauthorized": "authentication_error",
    "not_found": "not_found",
    "method_not_allowed": "method_not_allowed",
    "invalid_content_length": "api_usage_error",
    "duplicate_header": "api_usage_error",
    "invalid_compressed_body": "api_usage_error",
    "unsupported_content_encoding": "api_usage_error",
    "body_too_large": "request_too_large",
    "body_timeout": "timeout_error",
    "header_timeout": "timeout_error",
    "busy": "rate_limit_error",
    "draining": "overloaded_error",
    "internal_error": "internal_error",
}
# The door's own refusals, outside the core.
UNKNOWN_MODEL = ErrorRule(400, "api_usage_error", when="`model` is neither the loaded model nor an alias")
# A checkpoint without a vision tower reads no image, so none is accepted.
NO_VISION = ErrorRule(
    400, "api_usage_error", when="a request with images, and the loaded model does not read them"
)


def systemone_error(error: ServiceError) -> tuple[int, TypeSafeError | TypeSafeValidationError]:
    """The status and TypeSafe body model of any error on System One's paths."""
    if isinstance(error, SystemOneValidationError):
        return 422, TypeSafeValidationError.model_validate({"detail": error.detail})
    if error.code in ("invalid_json", "validation_error"):
        kind = "json_invalid" if error.code == "invalid_json" else "value_error"
        return 422, TypeSafeValidationError(
            detail=[ValidationItem(loc=["body"], msg=error.message, type=kind)]
        )
    error_type = HTTP_ERROR_TYPES.get(error.code, error.code)
    return error.status, TypeSafeError(
        detail=TypeSafeErrorDetail(error_type=error_type, message=error.message)
    )


def error_reply(error: ServiceError) -> JSONResponse:
    """Any error on `/v1/...` as TypeSafe's body, serialised once: `retry-after-ms` beside
    `Retry-After` (TypeSafe's clients read the finer one first)."""
    status, body = systemone_error(error)
    headers = dict(error.headers)
    if "Retry-After" in headers:
        headers["retry-after-ms"] = str(round(float(headers["Retry-After"]) * 1000))
    return json_reply(body, status, headers)


# TypeSafe's bodies for the published error responses (422 is FastAPI's own shape).
PUBLISHED_ERRORS = error_responses(
    TypeSafeError,
    {
        400: (
            TypeSafeError,
            "unknown model, a question the answer codes cannot read, a repeated header, or a corrupt body",
        ),
        422: (TypeSafeValidationError, "a field breaks a rule"),
    },
)
