"""The decoder's last layer computes only the rows a request reads, for every model the engine
serves: the base (SemIf), a PEFT adapter (SemIf) and a lev release (lev's rows, read as hidden
states and label logits). Each request's answers still equal an independent computation: a plain
forward of the base, PEFT's own LoRA forward, lev's own per-row forwards; and so do they when one
request of each model, each over its own new state, shares one packed forward."""

from __future__ import annotations

import pytest
import torch

from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.batching import Group, Part
from semif_serve.engine.lev_release import load_lev_release
from semif_serve.engine.runner import TorchEngine
from semif_serve.engine.state_cache import StateCache
from semif_serve.service.lev_core import LevEncoder, lev_answers, lev_jobs, lev_rows
from semif_serve.tools.lev_builder import DEFAULT_BASE_NAME, write_lev_release
from tests.engine.test_adapters import write_adapter
from tests.engine.test_lev_preamble import QUESTIONS, assert_levs_own_answers
from tests.support.lev_oracle import lev_on_engine
from tests.support.peft_oracle import fresh_base, peft_last, peft_model

TOL = 1e-5
STATE = "The nightly backup of the billing database failed at 02:14 with a full disk."
ROWS = [
    PromptRow("Did the backup succeed?", ("Yes.", "No.")),
    PromptRow("Which team owns it?", ("Billing.", "Platform.", "Nobody.")),
]


@pytest.fixture(scope="module")
def models(base, bank, checkpoint, tmp_path_factory):
    """The adapter index and the independent model each kind of served model is compared with."""
    root = tmp_path_factory.mktemp("last-layer")
    lora = write_adapter(
        checkpoint, root / "lora", 11, r=4, lora_alpha=8, target_modules=["up_proj", "o_proj"]
    )
    release = load_lev_release(
        write_lev_release(root / "lev", checkpoint, prompt_style="chat", seed=6),
        bank,
        base.codec.tokenizer,
        name="lev",
        base_name=DEFAULT_BASE_NAME,
        base_directory=checkpoint,
    )
    return {
        "base": (-1, fresh_base(checkpoint)),
        "adapter": (bank.add("lora-last", lora), peft_model(checkpoint, lora)),
        "lev release": (release.adapter, release),
    }


def last_logits(kind: str, reference, ids) -> torch.Tensor:
    """The logits after `ids`: a plain forward of the base, or PEFT's own through the adapter."""
    if kind == "adapter":
        return peft_last(reference, ids)[0]
    with torch.no_grad():
        return reference(input_ids=torch.tensor([list(ids)]), logits_to_keep=1).logits[0, -1]


@pytest.fixture
def last_mlp_rows(base) -> list[int]:
    """The rows each forward's last MLP computed (its gate projection's input rows)."""
    seen: list[int] = []
    handle = (
        base.model.get_decoder()
        .layers[-1]
        .mlp.gate_proj.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    )
    yield seen
    handle.remove()


@pytest.mark.parametrize("kind", ["base", "adapter", "lev release"])
def test_every_models_request_runs_its_last_layer_over_the_rows_it_reads_alone(
    kind, base, bank, models, last_mlp_rows, forwards
):
    adapter, reference = models[kind]
    engine = TorchEngine.over(base, bank).with_options(cache=StateCache(64 << 20), keep_state_tokens=0)

    if kind == "lev release":
        reply = lev_on_engine(reference, engine, STATE, QUESTIONS)
    else:
        request = RowsRequest.of(STATE, ROWS, shared=True, max_input_tokens=4096, adapter=adapter)
        prepared = engine.prepare(request)
        readout = engine.read_prepared(prepared)
    ran = list(last_mlp_rows)  # before lev's own forwards, which run the same model

    assert forwards  # every request ran packed
    read = [sum(s.read for s in segments) for segments in forwards]
    computed = [sum(len(s.ids) for s in segments) for segments in forwards]
    assert ran == [n for n in read if n]  # a forward that reads nothing never runs it
    assert all(n < tokens for n, tokens in zip(read, computed, strict=True))
    if kind == "lev release":
        assert_levs_own_answers(reply, reference, base, bank, STATE)
        return
    slots = engine.codec.slots
    for prompt, row, options in zip(prepared.prompts, readout.rows, ROWS, strict=True):
        want = last_logits(kind, reference, prompt.ids)[slots[: len(options.descriptions)]]
        assert torch.allclose(torch.tensor(row.option_logits), want, atol=TOL)


def test_a_request_of_each_model_over_its_own_new_state_shares_one_forward_answered_as_alone(
    base, bank, models, forwards
):
    engine = TorchEngine.over(base, bank).with_options(cache=StateCache(64 << 20), keep_state_tokens=0)
    states = {kind: f"{kind.capitalize()} report. {STATE}" for kind in models}
    semif = {
        kind: engine.prepare(
            RowsRequest.of(states[kind], ROWS, shared=True, max_input_tokens=4096, adapter=models[kind][0])
        )
        for kind in ("base", "adapter")
    }
    release = models["lev release"][1]
    lev_plan = lev_rows(release, LevEncoder(release.tokenizer), states["lev release"], QUESTIONS, None)
    lev_prepared = [job() for job in lev_jobs(lev_plan, engine, release.adapter)]
    everything = [*semif.values(), *lev_prepared]
    jobs = [p.job(("mixed", n)) for n, p in enumerate(everything)]
    groups = [Group(job.prefix_key, job.prefix_tokens, (Part(job, 0, len(job.row_tokens)),)) for job in jobs]

    outcomes = engine.run_groups(groups)

    assert len(forwards) == 1  # three models, three new states, one forward
    adapters_read = {s.adapter for s in forwards[0] if s.read}
    assert adapters_read == {-1, models["adapter"][0], release.adapter}
    readouts = [
        engine.readout(p, outcome[job.id]) for p, job, outcome in zip(everything, jobs, outcomes, strict=True)
    ]
    slots = engine.codec.slots
    for kind, readout in zip(semif, readouts, strict=False):
        for prompt, row, options in zip(semif[kind].prompts, readout.rows, ROWS, strict=True):
            want = last_logits(kind, models[kind][1], prompt.ids)[slots[: len(options.descriptions)]]
            assert torch.allclose(torch.tensor(row.option_logits), want, atol=TOL), kind
    reply = lev_answers(release, lev_plan, readouts[len(semif) :])
    assert_levs_own_answers(reply, release, base, bank, states["lev release"])
