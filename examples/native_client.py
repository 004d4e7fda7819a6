"""Call a running semif-serve through its native API with httpx: one /decide, one /decide/shared.

    SEMIF_URL=http://127.0.0.1:8032 SEMIF_API_TOKEN=... uv run python examples/native_client.py

SEMIF_URL defaults to the demo's address; SEMIF_API_TOKEN is the bearer token the service
was started with. Prints one line per decision and exits 1 on an error reply.

Each request carries X-SemIf-State-Key, the hex SHA-256 of its state: a replica ignores it, and
the gateway in front of several (stacks/semif-k8s) sends every request with the same key to the
replica that already holds that state prefilled (docs/gateway.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import httpx

YES_NO = [
    {"id": "yes", "description": "It succeeded."},
    {"id": "no", "description": "It failed."},
]


def state_key(state: str | dict) -> dict[str, str]:
    """The routing header for `state`: SHA-256 of a text state's UTF-8 bytes (what the gateway
    computes from the body itself), or of an object state's canonical JSON (the gateway does not
    read objects, so there the header is what keeps one state on one replica)."""
    text = state if isinstance(state, str) else json.dumps(state, sort_keys=True, separators=(",", ":"))
    return {"X-SemIf-State-Key": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def decide(client: httpx.Client) -> dict:
    """One decision, averaged over both orders of its options (read `combined` for anything real)."""
    state = "Health checks passed in all three zones."
    reply = client.post(
        "/decide",
        json={
            "id": "deploy-1",
            "state": state,
            "question": "Did the deployment succeed?",
            "options": YES_NO,
            "orderings": "rotations",
        },
        headers=state_key(state),
    )
    return checked(reply)


def decide_shared(client: httpx.Client) -> dict:
    """Two decisions over one state: the state is prefilled once and both are scored in one batch."""
    state = {"ticket": "The invoice PDF is blank since this morning's release."}
    reply = client.post(
        "/decide/shared",
        headers=state_key(state),
        json={
            "state": state,
            "decisions": [
                {"id": "is-bug", "question": "Is this a software defect?", "options": YES_NO},
                {
                    "id": "queue",
                    "question": "Which queue handles this ticket?",
                    "options": [
                        {"id": "billing", "description": "Billing questions."},
                        {"id": "engineering", "description": "Defects in the product."},
                        {"id": "sales", "description": "New contracts."},
                    ],
                },
            ],
        },
    )
    return checked(reply)


def checked(reply: httpx.Response) -> dict:
    """The JSON body of a 2xx reply; otherwise the service's error envelope, and exit 1."""
    body = reply.json()
    if reply.is_error:
        error = body.get("error", {})
        sys.exit(
            f"{reply.status_code} {error.get('code')}: {error.get('message')} (field {error.get('field')})"
        )
    return body


def top(result: dict) -> tuple[str, float]:
    """The chosen option and its probability (the order-averaged one where there is one)."""
    if "combined" in result:
        combined = result["combined"]
        return combined["top"], combined["probabilities"][combined["top"]]
    probabilities = dict(zip(result["option_ids"], result["probabilities"], strict=True))
    best = max(probabilities, key=probabilities.__getitem__)
    return best, probabilities[best]


def main() -> int:
    """Run both calls and print each decision's answer."""
    base_url = os.environ.get("SEMIF_URL", "http://127.0.0.1:8032")
    token = os.environ["SEMIF_API_TOKEN"]
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        single = decide(client)
        shared = decide_shared(client)
    for result in [single, *shared["results"]]:
        choice, probability = top(result)
        print(f"{result['id']}: {choice} (p={probability:.3f}, model {result['model']['source']})")
    print(f"shared prefix: {shared['timing']['prefix_tokens']} tokens, {shared['timing']['batch_size']} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
