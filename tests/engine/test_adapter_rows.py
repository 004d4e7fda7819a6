"""Rows of served adapters through the engine: requests of several models merged into one group
read each model's own state in one forward, every row equal to PEFT's plain forward of its whole
prompt under its model (float32, 1e-5); the state cache never serves one model's state for another."""

from __future__ import annotations

import pytest
import torch

from semif_serve.domain.requests import BASE, RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.batching import Group, Part
from semif_serve.engine.loader import CheckpointSpec, load_model
from semif_serve.engine.runner import TorchEngine
from semif_serve.engine.state_cache import StateCache
from tests.engine.test_adapters import LEV_TARGETS, peft_logits, write_adapter

ATOL = 1e-5
STATE = {"ticket": "The payment page times out after the new release; " * 6}
QUESTION = PromptRow("Which queue handles this ticket?", ("billing", "platform", "support"))
REORDERED = PromptRow("Which queue handles this ticket?", ("support", "billing", "platform"))


def triage_and_routing(checkpoint, root, seed: int, suffix: str = "") -> dict:
    """Two PEFT adapters: `triage` (rank 8 on lev's targets) and `routing` (rank 4 on up_proj)."""
    return {
        "triage": write_adapter(
            checkpoint, root / f"triage{suffix}", seed, r=8, lora_alpha=16, target_modules=LEV_TARGETS
        ),
        "routing": write_adapter(
            checkpoint, root / f"routing{suffix}", seed + 1, r=4, lora_alpha=8, target_modules=["up_proj"]
        ),
    }


@pytest.fixture(scope="module")
def adapter_dirs(checkpoint, tmp_path_factory):
    return triage_and_routing(checkpoint, tmp_path_factory.mktemp("served-adapters"), 11)


@pytest.fixture(scope="module")
def engine(checkpoint, adapter_dirs):
    loaded = load_model(CheckpointSpec(checkpoint, "test", "test/base", "float32", "cpu"))
    bank = AdapterBank(loaded.model)
    for name, directory in adapter_dirs.items():
        bank.add(name, directory)
    yield TorchEngine.over(loaded, bank).with_options(cache=StateCache(256 << 20))
    bank.close()


def request(engine, model: str | None, rows=(QUESTION, REORDERED), shared: bool = True) -> RowsRequest:
    """The rows read by the served adapter `model` (None: the base), resolved in the engine's bank."""
    adapter = BASE if model is None else engine.adapters.index(model)
    return RowsRequest.of(STATE, list(rows), shared=shared, max_input_tokens=4096, adapter=adapter)


def reference(engine, checkpoint, adapter_dirs, model: str | None, ids: list[int], n: int) -> torch.Tensor:
    """PEFT's own forward of the whole prompt under `model`, read at the answer slots."""
    logits = peft_logits(checkpoint, adapter_dirs[model] if model else None, torch.tensor([ids]))[0, -1]
    return logits[engine.slot_ids[:n]].float()


def merged_group(engine, requests):
    """The requests prepared, and their rows as ONE group (what the batcher builds for jobs over
    one state)."""
    prepared = [engine.prepare(r) for r in requests]
    jobs = [p.job(i) for i, p in enumerate(prepared)]
    assert len({job.prefix_key for job in jobs}) == 1  # one state, whatever the model
    group = Group(
        jobs[0].prefix_key, jobs[0].prefix_tokens, tuple(Part(j, 0, len(j.row_tokens)) for j in jobs)
    )
    return prepared, group


def run_merged(engine, requests):
    """The requests' rows run as ONE group; their readouts."""
    prepared, group = merged_group(engine, requests)
    results = engine.run_group(group)
    return prepared, [engine.readout(p, results[i]) for i, p in enumerate(prepared)]


def test_requests_of_three_models_share_one_forward_and_each_row_equals_its_model_alone(
    engine, checkpoint, adapter_dirs
):
    models = ["triage", None, "routing", "triage"]
    prepared, readouts = run_merged(engine, [request(engine, m) for m in models])
    for model, prep, readout in zip(models, prepared, readouts, strict=True):
        assert readout.timing.merged_requests == len(models)
        assert readout.timing.forward_batches == 1
        for prompt, row in zip(prep.prompts, readout.rows, strict=True):
            expected = reference(engine, checkpoint, adapter_dirs, model, prompt.ids, 3)
            torch.testing.assert_close(torch.tensor(row.option_logits), expected, atol=ATOL, rtol=0)
    base, triage = readouts[1].rows[0].option_logits, readouts[0].rows[0].option_logits
    assert max(abs(a - b) for a, b in zip(base, triage, strict=True)) > 1e-3  # the adapter is read


def test_a_group_over_one_new_state_costs_the_budget_the_state_once_per_model_and_each_row_once(engine):
    # The forward computes the state once for each model reading it (its own weights), so the
    # token budget counts it so: not once per request, not once for all models.
    engine.cache.clear()
    models = ["triage", None, "routing", "triage"]
    prepared, group = merged_group(engine, [request(engine, m) for m in models])
    state = len(prepared[0].prefix)
    rows = sum(len(prompt.ids) - state for p in prepared for prompt in p.prompts)
    assert engine.forward_cost(group) == 3 * state + rows
    engine.run_group(group)  # keeps the state under each model
    assert engine.forward_cost(group) == rows


def test_a_state_cached_under_one_model_is_never_served_for_another(engine, checkpoint, adapter_dirs):
    engine.cache.clear()
    engine.read(request(engine, None))
    again = engine.read(request(engine, None))
    assert again.timing.prefill == "cached"
    other = engine.read(request(engine, "routing"))
    assert other.timing.prefill == "fresh"  # the base's state is not the adapter's
    prompts = engine.prepare(request(engine, "routing")).prompts
    for prompt, row in zip(prompts, other.rows, strict=True):
        expected = reference(engine, checkpoint, adapter_dirs, "routing", prompt.ids, 3)
        torch.testing.assert_close(torch.tensor(row.option_logits), expected, atol=ATOL, rtol=0)
    assert engine.read(request(engine, "routing")).timing.prefill == "cached"


def test_lone_rows_of_different_models_each_equal_the_plain_forward(engine, checkpoint, adapter_dirs):
    engine.cache.clear()
    models = ["routing", None, "triage"]
    lone = [request(engine, m, rows=(QUESTION,), shared=False) for m in models]
    prepared, readouts = run_merged(engine, lone)
    for model, prep, readout in zip(models, prepared, readouts, strict=True):
        assert not readout.shared
        expected = reference(engine, checkpoint, adapter_dirs, model, prep.prompts[0].ids, 3)
        torch.testing.assert_close(torch.tensor(readout.rows[0].option_logits), expected, atol=ATOL, rtol=0)


def test_an_unknown_adapter_is_refused_by_the_bank(engine):
    with pytest.raises(KeyError):
        engine.adapters.index("nobody")
    unserved = len(engine.adapters.adapters)
    with pytest.raises(IndexError):
        engine.read(RowsRequest.of(STATE, [QUESTION], shared=True, max_input_tokens=4096, adapter=unserved))


def test_a_state_prefilled_in_steps_under_an_adapter_equals_its_plain_forward(
    engine, checkpoint, adapter_dirs
):
    stepped = engine.with_options(cache=StateCache(256 << 20), prefill_chunk_tokens=16)
    readout = stepped.read(request(engine, "triage"))
    assert readout.timing.prefill == "fresh" and readout.timing.prefix_tokens > 32  # several steps
    for prompt, row in zip(stepped.prepare(request(engine, "triage")).prompts, readout.rows, strict=True):
        expected = reference(engine, checkpoint, adapter_dirs, "triage", prompt.ids, 3)
        torch.testing.assert_close(torch.tensor(row.option_logits), expected, atol=ATOL, rtol=0)
    # The adapter's steps are not the base's.
    assert stepped.read(request(engine, None)).timing.prefill == "fresh"
