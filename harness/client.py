"""The HTTP client of one semif-serve, for the acceptance commands, the benchmarks and `gpu_run`:
keep-alive, the bearer token on every POST, `429 busy` retried after its Retry-After, every
other non-2xx raised as the service's error envelope."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_BUSY_RETRIES = 120


class ServiceCallError(Exception):
    """A non-2xx answer from the service, with its error envelope."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"HTTP {status} {code}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "message": self.message, "field": self.field}


class Client:
    """A keep-alive client of one service; POSTs carry the bearer token.

    A `429 busy` is retried after its Retry-After (at most `max_busy_retries` times); every
    other non-2xx raises ServiceCallError. `post` returns the JSON body and the end-to-end
    seconds of the successful attempt (encode, round trip, decode).
    """

    def __init__(
        self,
        url: str,
        token: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_busy_retries: int = DEFAULT_MAX_BUSY_RETRIES,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_busy_retries = max_busy_retries
        self.busy_retries = 0
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=10.0),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        for attempt in range(self.max_busy_retries + 1):
            started = time.perf_counter()
            response = self._http.post(path, content=json.dumps(body, ensure_ascii=False).encode("utf-8"))
            if response.status_code == 429 and attempt < self.max_busy_retries:
                self.busy_retries += 1
                time.sleep(retry_after_seconds(response.headers.get("retry-after")))
                continue
            payload = _json_or_none(response)
            elapsed = time.perf_counter() - started
            if response.is_success and isinstance(payload, dict):
                return payload, elapsed
            raise error_from(response.status_code, payload, response.text)
        raise AssertionError("unreachable")  # pragma: no cover

    def decide(self, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        return self.post("/decide", body)

    def decide_shared(self, state: Any, decisions: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
        return self.post("/decide/shared", {"state": state, "decisions": decisions})

    def metrics(self) -> str:
        """The service's `/metrics` exposition text."""
        response = self._http.get("/metrics")
        if not response.is_success:
            raise error_from(response.status_code, _json_or_none(response), response.text)
        return response.text

    def health(self) -> dict[str, Any]:
        response = self._http.get("/health")
        payload = _json_or_none(response)
        if not isinstance(payload, dict):
            raise error_from(response.status_code, payload, response.text)
        return payload


def retry_after_seconds(header: str | None, default: float = 1.0, cap: float = 30.0) -> float:
    """Seconds to wait from a Retry-After header (delta-seconds only; anything else: default)."""
    try:
        value = float(header) if header is not None else default
    except ValueError:
        value = default
    return min(max(value, 0.05), cap)


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def error_from(status: int, payload: Any, text: str) -> ServiceCallError:
    """The service's error envelope as an exception (or the raw text if it sent none)."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return ServiceCallError(status, str(err.get("code")), str(err.get("message")), err.get("field"))
    return ServiceCallError(status, "unexpected_response", text[:500])
