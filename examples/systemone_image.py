"""Ask a running semif-serve about an image with TypeSafe's official Python SDK, unchanged.

    export TYPESAFE_BASE_URL=http://127.0.0.1:8032
    export TYPESAFE_API_KEY=demo-token
    uv run python examples/systemone_image.py examples/red.png

The SDK sends the `Image` as multipart/form-data (a `request` part, then the image's bytes as
`asset-0`), zstd-compressed from 1 KiB up. The script prints the answer, or exits 1 with the
service's refusal (a model without a vision tower refuses images with 400 rather than answer
from the placeholder text).
"""

from __future__ import annotations

import sys
from pathlib import Path

from typesafe_sdk import Image, Noul, TypeSafeAPIError, TypeSafeClient


def main() -> int:
    """Ask whether the image on the command line shows something red, and print the answer."""
    photo = Image(Path(sys.argv[1]))
    with TypeSafeClient() as client:
        try:
            result = client.system_one(
                state={"photo": photo, "caption": "a product photo"},
                questions={"red": Noul(instructions="Is the object in the photo red?")},
            )
        except TypeSafeAPIError as error:
            sys.exit(f"{error.status}: {error}")
    print(f"red: P(true)={result.nouls['red'].noul:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
