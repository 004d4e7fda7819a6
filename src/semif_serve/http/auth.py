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


def presented_token(authorization: bytes | None) -> bytes:
    """The token of the request's `Authorization: Bearer <token>` header (`http.headers` has
    already refused a second one); raises a 401 ServiceError."""
    if authorization is None:
        raise unauthorized("missing Authorization: Bearer <token> header")
    match = BEARER.fullmatch(authorization)
    if match is None:
        raise unauthorized(
            "the Authorization header must be 'Bearer <token>': one space, a visible-ASCII token, "
            "nothing after it but spaces or tabs"
        )
    return match.group(1)


class Authenticator:
    """Checks a request's Authorization header against the service's one bearer token."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode("ascii")

    def check(self, authorization: bytes | None) -> None:
        """Return if the header carries the token; raise the 401 ServiceError otherwise."""
        if not hmac.compare_digest(presented_token(authorization), self._expected):
            raise unauthorized("the bearer token is not valid")
