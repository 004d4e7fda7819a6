"""Order averaging: the orders asked, the combined answer against hand computations, and the
real engine and HTTP service running orderings (one batch, a planted position bias, limits,
calibrated temperatures per mode)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections import Counter
from pathlib import Path

import httpx
import pytest

from semif_serve.app import create_app
from semif_serve.domain.orderings import combine, option_orders
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.service.startup import Service
from semif_serve.tools.demo import write_checkpoint
from tests.support import TOKEN, decision, make_settings

# -- helpers -------------------------------------------------------------------------------


def post(service: Service, url: str, body: dict) -> httpx.Response:
    """One request to the real ASGI app of `service` (admission included), with the token."""
    transport = httpx.ASGITransport(app=create_app(service))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"})

    return asyncio.run(go())


def softmax_by_hand(values: list[float], temperature: float = 1.0) -> list[float]:
    exps = [math.exp(v / temperature) for v in values]
    return [e / sum(exps) for e in exps]


def options(*descriptions: str) -> list[dict]:
    return [{"id": f"o{i}", "description": d} for i, d in enumerate(descriptions)]


def assert_close(actual, expected, tol: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) <= tol, (actual, expected)


def mean_logit_by_option(result: dict) -> dict[str, float]:
    """Each option id's logit averaged over the native reads of every ordering (by option id)."""
    sums: dict[str, float] = {}
    for native in result["orderings"]:
        for option_id, logit in zip(native["option_ids"], native["option_logits"], strict=True):
            sums[option_id] = sums.get(option_id, 0.0) + logit
    return {k: v / len(result["orderings"]) for k, v in sums.items()}


# -- option_orders ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
def test_rotations_give_n_distinct_cyclic_shifts_with_the_callers_order_first(n) -> None:
    orders = option_orders(n, "rotations")
    identity = list(range(n))
    shifts = [identity[s:] + identity[:s] for s in range(n)]
    assert len(orders) == n
    assert list(orders[0]) == identity
    assert len(set(orders)) == n
    for order in orders:
        assert list(order) in shifts
    # every option sits in every slot exactly once
    for slot in range(n):
        assert sorted(order[slot] for order in orders) == identity


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_gives_every_permutation_once_with_each_option_equally_often_in_each_slot(n) -> None:
    orders = option_orders(n, "all")
    assert len(orders) == math.factorial(n)
    assert len(set(orders)) == len(orders)
    assert list(orders[0]) == list(range(n))
    assert set(orders) == set(itertools.permutations(range(n)))
    for slot in range(n):
        counts = Counter(order[slot] for order in orders)
        assert counts == {option: math.factorial(n - 1) for option in range(n)}


def test_no_orderings_asks_the_callers_order_once_and_an_unknown_mode_is_refused() -> None:
    assert [list(o) for o in option_orders(3, None)] == [[0, 1, 2]]
    with pytest.raises(ValueError, match="unknown orderings mode"):
        option_orders(3, "shuffled")


# -- combine against a hand computation ----------------------------------------------------

IDS = ["x", "y", "z"]
ORDERS = [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
# Slot logits per ordering (slot k shows option ORDERS[j][k]). Own argmax per ordering:
# ordering 0 -> slot 0 -> x; ordering 1 -> slot 2 -> x; ordering 2 -> slot 0 -> z.
LOGITS = [[2.0, 0.5, -1.0], [1.0, 0.0, 3.0], [2.5, 1.5, 0.1]]
# By hand, per option: x = 2.0 (o0 s0) + 3.0 (o1 s2) + 1.5 (o2 s1); y = 0.5 + 1.0 + 0.1;
# z = -1.0 + 0.0 + 2.5.
MEAN = {"x": 6.5 / 3, "y": 1.6 / 3, "z": 1.5 / 3}


def test_combined_probabilities_are_the_softmax_of_each_options_mean_logit() -> None:
    out = combine(IDS, ORDERS, LOGITS, "rotations")
    expected = softmax_by_hand([MEAN["x"], MEAN["y"], MEAN["z"]])
    assert_close([out.probabilities[i] for i in IDS], expected, 1e-12)
    assert math.isclose(sum(out.probabilities.values()), 1.0, abs_tol=1e-12)


def test_combined_probabilities_are_the_renormalised_geometric_mean_of_each_orderings_probabilities() -> None:
    per_order = [softmax_by_hand(row) for row in LOGITS]
    geometric = {}
    for option, name in enumerate(IDS):
        probs = [p[order.index(option)] for order, p in zip(ORDERS, per_order, strict=True)]
        geometric[name] = math.prod(probs) ** (1 / len(probs))
    total = sum(geometric.values())
    out = combine(IDS, ORDERS, LOGITS, "rotations")
    assert_close([out.probabilities[i] for i in IDS], [geometric[i] / total for i in IDS], 1e-12)


def test_combine_reports_top_agreement_and_spread_of_the_top_option() -> None:
    out = combine(IDS, ORDERS, LOGITS, "rotations")
    assert out.top == "x"
    assert out.agreement == pytest.approx(2 / 3)  # orderings 0 and 1 pick x, ordering 2 picks z
    # the probability each ordering gave x: slot 0, slot 2 and slot 1 respectively
    p_x = [softmax_by_hand(LOGITS[0])[0], softmax_by_hand(LOGITS[1])[2], softmax_by_hand(LOGITS[2])[1]]
    assert out.spread == pytest.approx(max(p_x) - min(p_x), abs=1e-12)
    assert out.mode == "rotations" and out.orderings == 3


def test_combine_with_unanimous_identical_orderings_has_full_agreement_and_no_spread() -> None:
    orders = [(0, 1), (1, 0)]
    logits = [[1.0, 0.0], [0.0, 1.0]]  # both orderings pick option 0 with the same confidence
    out = combine(["a", "b"], orders, logits, "all")
    assert out.top == "a" and out.agreement == 1.0
    assert out.spread == pytest.approx(0.0, abs=1e-12)
    assert out.probabilities["a"] == pytest.approx(math.exp(1) / (math.exp(1) + 1), abs=1e-12)


# -- through the real engine ---------------------------------------------------------------

STATE = {"zones": 3, "health": "passed"}  # a state whose prefix survives tokenisation


def test_rotations_run_in_one_forward_batch_and_each_ordering_equals_a_direct_read(service, engine) -> None:
    descs = ["It succeeded.", "It failed.", "Unclear.", "It was rolled back."]
    body = decision(state=STATE, options=options(*descs), orderings="rotations")
    response = post(service, "/decide", body)
    assert response.status_code == 200, response.text
    result = response.json()

    timing = result["timing"]
    assert timing["forward_batches"] == 1
    assert timing["batch_size"] == 4
    assert timing["prefix_tokens"] > 0
    assert len(result["orderings"]) == 4
    for k, native in enumerate(result["orderings"]):
        order = [(k + i) % 4 for i in range(4)]
        assert native["option_ids"] == [f"o{i}" for i in order]
        row = PromptRow(body["question"], tuple(descs[i] for i in order))
        direct = engine.read(RowsRequest.of(STATE, [row], shared=False, max_input_tokens=4096)).rows[0]
        assert_close(native["option_logits"], direct.option_logits, 1e-5)
        assert native["prompt_sha256"] == direct.prompt_sha256
    # the reply's own fields are the caller's order, i.e. the first ordering
    assert result["option_ids"] == ["o0", "o1", "o2", "o3"]
    assert result["option_logits"] == result["orderings"][0]["option_logits"]
    # the combined block agrees with the native reads it was built from
    mean = mean_logit_by_option(result)
    expected = softmax_by_hand([mean[f"o{i}"] for i in range(4)])
    assert_close([result["combined"]["probabilities"][f"o{i}"] for i in range(4)], expected, 1e-9)


BIAS = 4.0


@pytest.fixture(scope="module")
def biased_service(tmp_path_factory) -> Service:
    """A model with a planted preference for the letter A: it picks whatever is listed first."""
    directory = write_checkpoint(tmp_path_factory.mktemp("biased"), slot_bias={"A": BIAS})
    return Service.start(make_settings(directory))


def test_the_planted_bias_makes_a_single_read_pick_the_first_listed_option(biased_service) -> None:
    for listed in (["o0", "o1", "o2"], ["o2", "o0", "o1"], ["o1", "o2", "o0"]):
        descs = {"o0": "It succeeded.", "o1": "It failed.", "o2": "Unclear."}
        body = decision(state=STATE, options=[{"id": i, "description": descs[i]} for i in listed])
        result = post(biased_service, "/decide", body).json()
        logits = result["option_logits"]
        assert logits[0] > max(logits[1:]) + BIAS / 2  # slot A leads by about the planted bias
        assert result["probabilities"][0] > 0.9


def test_averaging_over_rotations_cancels_a_planted_position_bias(biased_service) -> None:
    descs = {"o0": "It succeeded.", "o1": "It failed.", "o2": "Unclear."}
    tops, combined = [], []
    for listed in (["o0", "o1", "o2"], ["o2", "o0", "o1"]):
        opts = [{"id": i, "description": descs[i]} for i in listed]
        single = post(biased_service, "/decide", decision(state=STATE, options=opts)).json()
        probs = single["probabilities"]
        tops.append(single["option_ids"][probs.index(max(probs))])
        rotated = post(biased_service, "/decide", decision(state=STATE, options=opts, orderings="rotations"))
        assert rotated.status_code == 200, rotated.text
        combined.append(rotated.json()["combined"])

    assert tops == ["o0", "o2"]  # a single read follows the listing order
    assert combined[0]["top"] == combined[1]["top"]  # the combined answer does not
    for block in combined:
        assert block["agreement"] == pytest.approx(1 / 3)  # each ordering picked its own first option
        assert max(block["probabilities"].values()) - min(block["probabilities"].values()) < 0.05
    for option in descs:
        assert combined[0]["probabilities"][option] == pytest.approx(
            combined[1]["probabilities"][option], abs=1e-5
        )


# -- limits --------------------------------------------------------------------------------


def test_orderings_all_with_five_options_is_refused_naming_the_orderings_field(service) -> None:
    body = decision(options=options("a", "b", "c", "d", "e"), orderings="all")
    response = post(service, "/decide", body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == "orderings"
    assert "4" in error["message"]


def test_orderings_all_with_four_options_asks_all_twenty_four_orders(service) -> None:
    body = decision(state=STATE, options=options("a", "b", "c", "d"), orderings="all")
    result = post(service, "/decide", body).json()
    assert result["timing"]["batch_size"] == 24 and result["combined"]["orderings"] == 24
    seen = {tuple(n["option_ids"]) for n in result["orderings"]}
    assert seen == set(itertools.permutations(["o0", "o1", "o2", "o3"]))


@pytest.fixture(scope="module")
def five_row_service(engine, checkpoint) -> Service:
    return Service.start(make_settings(checkpoint, max_rows=5), engine=engine)


def test_rows_over_max_rows_are_refused_with_too_many_rows(five_row_service) -> None:
    six = options("a", "b", "c", "d", "e", "f")
    response = post(five_row_service, "/decide", decision(options=six, orderings="rotations"))
    assert response.status_code == 422
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("too_many_rows", "orderings")
    assert "6" in error["message"] and "5" in error["message"]

    shared = {
        "state": STATE,
        "decisions": [
            {"id": f"d{i}", "question": "Which?", "options": options("a", "b"), "orderings": "rotations"}
            for i in range(3)
        ],
    }
    response = post(five_row_service, "/decide/shared", shared)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "too_many_rows"


def test_rows_at_max_rows_are_served(five_row_service) -> None:
    five = options("a", "b", "c", "d", "e")
    response = post(five_row_service, "/decide", decision(state=STATE, options=five, orderings="rotations"))
    assert response.status_code == 200, response.text
    assert response.json()["timing"]["batch_size"] == 5


# -- calibration with orderings ------------------------------------------------------------


@pytest.fixture(scope="module")
def calibrated_service(engine, checkpoint, tmp_path_factory) -> Service:
    path: Path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    path.write_text(json.dumps({"w": {"single": 2.0, "rotations": 0.5}, "v": 1.5}), encoding="utf-8")
    return Service.start(make_settings(checkpoint, calibration=path), engine=engine)


def argmax(values) -> int:
    return max(range(len(values)), key=lambda i: values[i])


THREE = options("It succeeded.", "It failed.", "Unclear.")


@pytest.mark.parametrize("workload, temperature", [("w", 2.0), ("v", 1.5)])
def test_a_single_read_is_calibrated_with_the_workloads_single_temperature(
    calibrated_service, workload, temperature
) -> None:
    body = decision(state=STATE, options=THREE, workload=workload)
    result = post(calibrated_service, "/decide", body).json()
    block = result["calibrated"]
    expected = softmax_by_hand(result["option_logits"], temperature)
    assert (block["workload"], block["temperature"], block["temperature_mode"]) == (
        workload,
        temperature,
        "single",
    )
    assert_close(block["probabilities"], expected, 1e-9)
    assert argmax(block["probabilities"]) == argmax(result["probabilities"])
    assert_close(result["probabilities"], softmax_by_hand(result["option_logits"]), 1e-6)  # native untouched


def test_rotations_are_calibrated_with_the_rotations_temperature_on_the_mean_logits(
    calibrated_service,
) -> None:
    body = decision(state=STATE, options=THREE, workload="w", orderings="rotations")
    result = post(calibrated_service, "/decide", body).json()
    block = result["combined"]["calibrated"]
    mean = mean_logit_by_option(result)
    ids = [o["id"] for o in THREE]
    expected = softmax_by_hand([mean[i] for i in ids], 0.5)
    assert (block["temperature"], block["temperature_mode"]) == (0.5, "rotations")
    assert_close([block["probabilities"][i] for i in ids], expected, 1e-9)
    top = max(ids, key=lambda i: block["probabilities"][i])
    assert top == result["combined"]["top"]
    assert "calibrated" not in result  # the single-read block is not added beside combined


def test_all_without_its_own_temperature_falls_back_to_the_single_temperature(calibrated_service) -> None:
    body = decision(state=STATE, options=THREE, workload="w", orderings="all")
    result = post(calibrated_service, "/decide", body).json()
    block = result["combined"]["calibrated"]
    mean = mean_logit_by_option(result)
    ids = [o["id"] for o in THREE]
    assert (block["temperature"], block["temperature_mode"]) == (2.0, "single")
    assert_close([block["probabilities"][i] for i in ids], softmax_by_hand([mean[i] for i in ids], 2.0), 1e-9)
    assert max(ids, key=lambda i: block["probabilities"][i]) == result["combined"]["top"]


def test_an_unknown_workload_is_refused_naming_the_known_ones(calibrated_service) -> None:
    response = post(calibrated_service, "/decide", decision(options=THREE, workload="nope"))
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "unknown_workload"
    assert error["field"] == "workload"
    assert "'nope'" in error["message"] and "v" in error["message"] and "w" in error["message"]
    assert "v, w" in error["message"]
