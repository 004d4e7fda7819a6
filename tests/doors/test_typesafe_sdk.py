"""The official `typesafe-sdk` (0.7.5), unmodified, against the live service over HTTP.

It parses every answer type into its strict models, finds its endpoint through
`TYPESAFE_BASE_URL` and `TYPESAFE_API_KEY` alone, and sends bodies of 1 KiB or more
zstd-compressed: on Python 3.11 it does so with `backports.zstd` (its `zstd` extra, also our
runtime dependency), as it does by default on 3.14. Each number the SDK parses is compared with
the JSON a plain httpx call gets for the same request.
"""

from __future__ import annotations

import json

import httpx
import httpx2
import pytest
from typesafe_sdk import (
    Choice,
    ChoiceAnswer,
    Noul,
    NoulAnswer,
    Score,
    ScoreAnswer,
    TypeSafeAuthenticationError,
    TypeSafeClient,
)
from typesafe_sdk._core.compression import MIN_COMPRESSED_BODY_LENGTH, resolve_compression

from harness.server import LoopbackServer
from semif_serve.app import create_app
from tests.support import TOKEN

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
STATE = "Hi, I was charged twice for my March invoice and the refund I was promised has not arrived."
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "Payments and refunds.", "tech": None, "sales": "New contracts."},
    },
    "anger": {
        "type": "score",
        "instructions": "How upset is the customer?",
        "criteria": ["calm", "annoyed", {"level": "furious", "signs": ["threats"]}],
    },
}


@pytest.fixture(scope="module")
def server(service):
    with LoopbackServer(create_app(service)) as running:
        yield running


class Sent:
    """What the SDK put on the wire: each request's headers and body, seen by an httpx2 hook."""

    def __init__(self) -> None:
        self.requests: list[httpx2.Request] = []

    def client(self) -> httpx2.Client:
        return httpx2.Client(timeout=120, event_hooks={"request": [self.requests.append]})


def raw_answers(server, body: dict) -> dict:
    reply = httpx.post(
        f"{server.url}/v1/systemone", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def sdk_questions() -> dict:
    team = QUESTIONS["team"]
    anger = QUESTIONS["anger"]
    return {
        "refund": Noul(instructions=QUESTIONS["refund"]["instructions"]),
        "team": Choice(instructions=team["instructions"], criteria=team["criteria"]),
        "anger": Score(instructions=anger["instructions"], criteria=anger["criteria"]),
    }


def test_the_sdk_compresses_with_zstd_here_by_default():
    assert resolve_compression(None) == "zstd"


def test_the_sdk_parses_noul_choice_and_score_answers_as_the_wire_has_them(server):
    sent = Sent()
    with TypeSafeClient(api_key=TOKEN, base_url=server.url, http_client=sent.client()) as client:
        result = client.system_one(state=STATE, questions=sdk_questions())
    raw = raw_answers(server, {"model": "jev-latest", "state": STATE, "questions": QUESTIONS})
    assert isinstance(result.nouls["refund"], NoulAnswer)
    assert isinstance(result.choices["team"], ChoiceAnswer)
    assert isinstance(result.scores["anger"], ScoreAnswer)
    assert result.model == raw["model"]
    assert result.nouls["refund"].noul == pytest.approx(raw["answers"]["refund"]["noul"], abs=1e-6)
    team = result.choices["team"]
    assert team.choice == raw["answers"]["team"]["choice"]
    assert dict(team.probabilities) == pytest.approx(raw["answers"]["team"]["probabilities"], abs=1e-6)
    anger = result.scores["anger"]
    assert anger.score == pytest.approx(raw["answers"]["anger"]["score"], abs=1e-6)
    assert dict(anger.legend) == {0: "calm", 1: "annoyed", 2: json.dumps(QUESTIONS["anger"]["criteria"][2])}
    assert result.usage.input_tokens == raw["usage"]["input_tokens"] and result.usage.output_tokens == 0
    (request,) = sent.requests
    assert request.url.path == "/v1/systemone"


def test_a_body_the_sdk_sends_zstd_compressed_gets_the_answers_of_the_plain_body(server):
    long_state = {
        "ticket": STATE,
        "history": [f"message {i}: still waiting for the refund" for i in range(40)],
    }
    sent = Sent()
    with TypeSafeClient(api_key=TOKEN, base_url=server.url, http_client=sent.client()) as client:
        packed = client.system_one(state=long_state, questions=sdk_questions())
    with TypeSafeClient(api_key=TOKEN, base_url=server.url, compression=False) as client:
        plain = client.system_one(state=long_state, questions=sdk_questions())
    (request,) = sent.requests
    assert request.headers["content-encoding"] == "zstd"
    assert request.content.startswith(ZSTD_MAGIC)
    assert len(json.dumps(long_state)) >= MIN_COMPRESSED_BODY_LENGTH
    # The same answers: the second asks about the state the first cached, and a forward's float32
    # sums may differ in their last bits with what it is packed beside (contract.md: within 1e-5).
    (numbers, words), (want_numbers, want_words) = fields_of(packed.answers), fields_of(plain.answers)
    assert words == want_words
    assert numbers == pytest.approx(want_numbers, rel=0, abs=1e-6)


def fields_of(answers: dict) -> tuple[dict[str, float], dict[str, str]]:
    """Every field of every answer by `question.field[.key]`: its numbers, and the rest as text."""
    numbers: dict[str, float] = {}
    words: dict[str, str] = {}
    for question, answer in answers.items():
        for name, value in answer.model_dump().items():
            for key, item in value.items() if isinstance(value, dict) else [(None, value)]:
                label = f"{question}.{name}" + ("" if key is None else f".{key}")
                if isinstance(item, float):
                    numbers[label] = item
                else:
                    words[label] = str(item)
    return numbers, words


def test_a_255_option_choice_round_trips_its_option_names_through_the_sdk(server):
    names = [f"option {i} · 선택 {i}" for i in range(255)]
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as client:
        result = client.system_one(
            state=STATE, questions={"pick": Choice(instructions="Pick one.", criteria=dict.fromkeys(names))}
        )
    pick = result.choices["pick"]
    assert list(pick.probabilities) == names
    assert pick.choice == max(names, key=pick.probabilities.__getitem__)


def test_an_application_finds_the_service_through_the_environment_alone(server, monkeypatch):
    monkeypatch.setenv("TYPESAFE_BASE_URL", server.url)
    monkeypatch.setenv("TYPESAFE_API_KEY", TOKEN)
    with TypeSafeClient() as client:
        listed = client.models.list()
        result = client.system_one(state=STATE, questions={"refund": Noul(instructions="Money back?")})
    assert 0.0 <= result.nouls["refund"].noul <= 1.0
    assert result.model in {m.name for m in listed.models}


def test_a_wrong_key_raises_the_sdks_authentication_error(server):
    with TypeSafeClient(api_key="not-the-token", base_url=server.url) as client:
        with pytest.raises(TypeSafeAuthenticationError) as refused:
            client.system_one(state=STATE, questions={"refund": Noul(instructions="Money back?")})
    assert refused.value.status == 401
    assert "not-the-token" not in str(refused.value)


def test_the_sdk_reads_the_request_id_of_answers_and_of_refusals(server):
    seen: list[httpx2.Response] = []
    hooks = {"response": [seen.append]}
    with TypeSafeClient(
        api_key=TOKEN, base_url=server.url, http_client=httpx2.Client(event_hooks=hooks)
    ) as c:
        result = c.system_one(state=STATE, questions={"refund": Noul(instructions="Money back?")})
    assert result.request_id == seen[-1].headers["x-request-id"]
    with TypeSafeClient(api_key="not-the-token", base_url=server.url) as client:
        with pytest.raises(TypeSafeAuthenticationError) as refused:
            client.system_one(state=STATE, questions={"refund": Noul(instructions="Money back?")})
    assert refused.value.request_id is not None
    assert f"request_id={refused.value.request_id}" in str(refused.value)
