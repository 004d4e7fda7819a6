"""Rows of a method rendering its own ids (lev's) share one prefill of their prefix only where that
computes fewer tokens than the rows run whole; SemIf's shared path always prefills its state.
Either way every row equals the plain forward of its prompt."""

from __future__ import annotations

import pytest
import torch

from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.sharing import prefill_pays
from semif_serve.engine.state_cache import StateCache
from tests.engine.test_reuse import TOL, long_state, plain_forward

DESCRIPTIONS = ("It succeeded.", "It failed.")
COLUMNS = [32, 33, 7, 1000]


def test_a_lone_row_and_two_rows_over_a_short_prefix_run_whole_rather_than_pay_a_second_forward():
    assert not prefill_pays(20, 20, rows=1, width=44)  # lev's rating noul: nothing to share
    assert not prefill_pays(20, 20, rows=2, width=44)  # lev's binary noul, two orders of 64 tokens


def test_rows_over_a_prefix_they_would_repeat_past_one_forwards_cost_share_its_prefill():
    assert prefill_pays(50, 50, rows=2, width=46)
    assert prefill_pays(20, 20, rows=8, width=44)  # eight rows repeat 140 prefix tokens
    assert prefill_pays(1000, 1000, rows=16, width=60)  # 8 choices in two orders over a 1k state


def test_a_cached_prefix_is_always_shared():
    assert prefill_pays(20, 0, rows=2, width=44)
    assert prefill_pays(20, 0, rows=1, width=44)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def whole_forward(engine, row: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return (
            engine.model(input_ids=torch.tensor([row]), use_cache=False, logits_to_keep=1)
            .logits[0, -1]
            .float()
        )


@pytest.mark.parametrize(("prefix_tokens", "kept"), [(12, False), (300, True)])
def test_rows_of_a_method_rendering_its_own_ids_share_a_prefix_only_where_it_pays(
    engine, prefix_tokens, kept
):
    engine = engine.with_options(cache=StateCache(1 << 30))
    prefix, suffixes = ids(prefix_tokens, 1), [ids(20, 2), ids(31, 3)]
    got = engine.read_prepared(engine.prepare_ids(prefix, suffixes, [COLUMNS] * len(suffixes)))
    assert engine.cache.has(prefix) is kept  # a 12-token prefix: two whole 64-token rows, nothing stored
    for row, suffix in zip(got.rows, suffixes, strict=True):
        want = whole_forward(engine, prefix + suffix)[COLUMNS]
        assert (torch.tensor(row.option_logits) - want).abs().max().item() <= TOL


def test_a_shared_request_over_a_long_state_prefills_it_once_and_keeps_it(engine):
    engine = engine.with_options(cache=StateCache(1 << 30))
    state = long_state("shared")
    rows = [PromptRow(f"Did step {i} succeed?", DESCRIPTIONS) for i in range(4)]
    readout = engine.read(RowsRequest.of(state, rows, shared=True, max_input_tokens=4096))
    assert readout.timing.prefix_tokens > 64 and readout.timing.prefill == "fresh"
    prefix = engine.prepare(RowsRequest.of(state, rows, shared=True, max_input_tokens=4096)).prefix
    assert len(prefix) == readout.timing.prefix_tokens and engine.cache.has(prefix)
    for row, got in zip(rows, readout.rows, strict=True):
        logits, _, _ = plain_forward(engine, state, row.question, row.descriptions)
        assert max(abs(a - b) for a, b in zip(got.option_logits, logits, strict=True)) <= TOL
