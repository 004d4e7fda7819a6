"""What every HTTP door shares: the door interface the app composes, and request authentication.

A door owns a set of routes, turns domain errors into its own status and body through its
own table, and renders every error on its paths in its own shape.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .errors import ServiceError
from .startup import Service


class Door(Protocol):
    """An HTTP surface over the decision core."""

    #: Paths starting with this belong to the door (its error shape answers their 404/405/500).
    path_prefix: str

    def router(self) -> APIRouter:
        """The door's routes, ready to include in the app."""
        ...

    def render(self, error: ServiceError, request: Request) -> Response:
        """An error on one of the door's paths, in the door's own body shape."""
        ...


def unauthorized(message: str) -> ServiceError:
    """A 401 that asks for a bearer token."""
    return ServiceError(401, "unauthorized", message, "Authorization", headers={"WWW-Authenticate": "Bearer"})


def authenticate(service: Service, request: Request) -> None:
    """Require `Authorization: Bearer <token>`, compared in constant time; every authenticated
    route of every door calls this and nothing else."""
    header = request.headers.get("authorization")
    if not header:
        raise unauthorized("missing Authorization: Bearer <token> header")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise unauthorized("the Authorization header must be 'Bearer <token>'")
    if not service.token_matches(presented.strip()):
        raise unauthorized("the bearer token is not valid")
