"""Ask a running semif-serve through System One with TypeSafe's official Python SDK, unchanged.

    export TYPESAFE_BASE_URL=http://127.0.0.1:8032
    export TYPESAFE_API_KEY=demo-token
    uv run python examples/systemone_client.py

The SDK finds the service and the key in the environment, as any application written for
TypeSafe's hosted Jev does, and asks for `jev-latest` (or `TYPESAFE_DEFAULT_MODEL`), which
the loaded model serves. One request asks a noul, a choice and a score question over one
state (one shared prefill); the script prints one line per answer and exits 1 with the
service's error on a refusal.
"""

from __future__ import annotations

import sys

from typesafe_sdk import Choice, Noul, Score, TypeSafeAPIError, TypeSafeClient

TICKET = {
    "customer": "Dana",
    "message": "I was charged twice for my March invoice and the refund I was promised has not arrived.",
}
QUESTIONS = {
    "wants-refund": Noul(instructions="Is the customer asking for money back?"),
    "team": Choice(
        instructions="Which team should handle this ticket?",
        criteria={
            "billing": "Payments, invoices and refunds.",
            "engineering": None,
            "sales": "New contracts.",
        },
    ),
    "upset": Score(instructions="How upset is the customer?", criteria=["calm", "annoyed", "furious"]),
}


def main() -> int:
    """Ask the three questions and print each answer."""
    with TypeSafeClient() as client:
        try:
            result = client.system_one(state=TICKET, questions=QUESTIONS)
        except TypeSafeAPIError as error:
            sys.exit(f"{error.status}: {error}")
    for name, noul in result.nouls.items():
        print(f"{name}: P(true)={noul.noul:.3f}")
    for name, choice in result.choices.items():
        top = choice.probabilities[choice.choice]
        print(f"{name}: {choice.choice} (p={top:.3f}, confidence {choice.confidence:.3f})")
    for name, score in result.scores.items():
        print(f"{name}: {score.score:.2f} on 0..{len(score.legend) - 1} (confidence {score.confidence:.3f})")
    print(
        f"model {result.model}: {result.usage.input_tokens} input tokens, {result.usage.output_tokens} output"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
