"""What every HTTP door shares: the door interface the app composes.

A door owns a set of routes (admission authenticates its protected paths), turns domain
errors into its own status and body through its own table, and renders every error on its
paths in its own shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response

from semif_serve.http.errors import ServiceError


class Door(Protocol):
    """An HTTP surface over the decision core."""

    #: Paths starting with this belong to the door (its error shape answers their 404/405/500).
    path_prefix: str
    #: Paths that need the bearer token (admission checks it from the headers, before a slot).
    protected_paths: frozenset[str]

    def router(self) -> APIRouter:
        """The door's routes, ready to include in the app."""
        ...

    def render(self, error: ServiceError, request: Request) -> Response:
        """An error on one of the door's paths, in the door's own body shape."""
        ...


def door_of(doors: Sequence[Door], path: str) -> Door:
    """The door that owns `path`: the longest matching prefix wins; the native door ("") is the fallback."""
    return max((d for d in doors if path.startswith(d.path_prefix)), key=lambda d: len(d.path_prefix))
