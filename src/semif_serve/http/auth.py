"""Bearer authentication from the request headers alone: strict parsing, constant-time comparison.

It needs no body, so admission runs it before a request may take a slot. Nothing here
ever puts the presented or the expected token into a message.
"""

from __future__ import annotations

import hmac
import re

from semif_serve.http.errors import ServiceError

# Scheme case-insensitive, exactly one space, a visible-ASCII token, then only ASCII spaces/tabs.
BEARER = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr] ([\x21-\x7e]+)[ \t]*")


def unauthorized(message: str) -> ServiceError:
    """The 401 every authentication failure answers (with `WWW-Authenticate: Bearer`)."""
    return ServiceError(401, "unauthorized", message, "Authorization", headers={"WWW-Authenticate": "Bearer"})


def presented_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The token of the request's one `Authorization: Bearer <token>` header; raises a 401 ServiceError."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if not values:
        raise unauthorized("missing Authorization: Bearer <token> header")
    if len(values) > 1:
        raise unauthorized("send exactly one Authorization header")
    match = BEARER.fullmatch(values[0])
    if match is None:
        raise unauthorized(
            "the Authorization header must be 'Bearer <token>': one space, a visible-ASCII token, "
            "nothing after it but spaces or tabs"
        )
    return match.group(1)


class Authenticator:
    """Checks ASGI request headers against the service's one bearer token."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode("ascii")

    def check(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Return if the headers carry the token; raise the 401 ServiceError otherwise."""
        if not hmac.compare_digest(presented_token(headers), self._expected):
            raise unauthorized("the bearer token is not valid")
