"""Bodies for the real-proxy tests (nginx in tests/deploy/test_nginx_proxy.py, HAProxy in
tests/deploy/test_gateway.py): a System One multipart "photo" as the official SDK lays it out, sized
between the JSON body limit and the photo limit, and how to tell who answered a request.

The photo part starts as a PNG and then is not one, so a replica that reads it refuses it with
its own 4xx in TypeSafe's shape (never a 413): that answer proves the body got past the proxy.
"""

from __future__ import annotations

import json

from semif_serve.service.settings import Settings

JSON_LIMIT = Settings.model_fields["max_body_bytes"].default  # SEMIF_MAX_BODY_BYTES: 1 MiB
PHOTO_LIMIT = JSON_LIMIT + Settings.model_fields["systemone_max_image_bytes"].default  # 21 MiB
PHOTO_BYTES = 3 * JSON_LIMIT // 2  # 1.5 MiB: past the JSON limit, well within the photo limit
PLACEHOLDER = "<image:0123456789abcdef0123456789abcdef>"
BOUNDARY = "semif-proxy-boundary"


def photo_multipart(size: int) -> tuple[str, bytes]:
    """(content type, body) of a System One request whose one image is a part, the whole body
    `size` bytes long (RFC 7578, the SDK's layout: `request` first, then `asset-0`)."""
    request = {
        "model": "jev-latest",
        "state": "The photo: " + PLACEHOLDER,
        "questions": {"damaged": {"type": "noul", "instructions": "Is the package damaged?"}},
        "assets": {PLACEHOLDER: {"type": "image", "format": "png", "part": "asset-0"}},
    }

    def part(name: str, kind: str, content: bytes) -> bytes:
        head = (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\nContent-Type: {kind}\r\n\r\n'
        )
        return head.encode() + content + b"\r\n"

    first = part("request", "application/json", json.dumps(request).encode())
    end = f"--{BOUNDARY}--\r\n".encode()
    framing = len(part("asset-0", "image/png", b"")) + len(first) + len(end)
    photo = b"\x89PNG\r\n\x1a\n" + b"\x00" * (size - framing - 8)
    body = first + part("asset-0", "image/png", photo) + end
    assert len(body) == size
    return f"multipart/form-data; boundary={BOUNDARY}", body


def refused_by_a_replica(response) -> bool:
    """A replica's own refusal of the photo: a TypeSafe-shaped 4xx other than 413."""
    return 400 <= response.status_code < 500 and response.status_code != 413 and "detail" in response.json()


def too_large_for_systemone(response, limit: int) -> bool:
    """413 in TypeSafe's shape, naming `limit`: the proxy's or the service's, alike."""
    detail = response.json().get("detail", {})
    return (
        response.status_code == 413
        and detail.get("error_type") == "request_too_large"
        and str(limit) in detail.get("message", "")
    )
