"""lev's method over the frozen base (`base_release`, a `method = "lev"` entry without a release):
lev's prompt, codes and orders over the base's own weights, every temperature 1.0; held to the
base's plain forward of each row computed here (transformers' own model, fresh from disk)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from semif_serve.domain.requests import AskedQuestion, Limits
from semif_serve.engine.lev_release import base_release
from semif_serve.engine.state_cache import StateCache
from semif_serve.service.methods import Ask, MethodRegistry
from semif_serve.service.methods.lev import LevMethod
from semif_serve.service.models import load_models
from semif_serve.service.startup import Service
from semif_serve.tools.lev_builder import DEFAULT_BASE_NAME
from tests.engine.test_lev_release import (
    BINARY,
    CHOICE_SUFFIXES,
    DEPT,
    PLAIN_PREFIX,
    STATE,
    URGENT,
    close,
    label_ids,
    softmax_t,
)
from tests.support import make_settings
from tests.support.lev_oracle import lev_on_engine, lev_per_row


@pytest.fixture(scope="module")
def fresh_base(checkpoint):
    """The base as transformers loads it, apart from the engine's copy."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def expected(fresh_base, tok, suffixes, orders, labels):
    """Each order's softmax(label logits) at the row's last token, put back in the caller's order
    and averaged: lev's readout of the base with no calibration (T = 1)."""
    ids = label_ids(tok, labels)
    total = [0.0] * len(labels)
    for suffix, order in zip(suffixes, orders, strict=True):
        row = tok.encode(PLAIN_PREFIX, add_special_tokens=True) + tok.encode(suffix, add_special_tokens=False)
        with torch.no_grad():
            logits = fresh_base(input_ids=torch.tensor([row]), logits_to_keep=1).logits[0, -1]
        for shown, p in enumerate(softmax_t([float(logits[i]) for i in ids], 1.0)):
            total[order[shown]] += p
    return [t / len(suffixes) for t in total]


@pytest.mark.parametrize("path", ["per-row", "engine"])
def test_the_frozen_base_reads_lev_prompts_equal_to_its_plain_forward(path, engine, checkpoint, fresh_base):
    tok = engine.codec.tokenizer
    release = base_release(checkpoint, tok, base_name=DEFAULT_BASE_NAME, noul_readout="binary")
    assert release.frozen_base and release.head is None
    questions = {"dept": DEPT, "urgent": URGENT}
    if path == "per-row":
        reply = lev_per_row(release, engine.model, engine.adapters, STATE, questions)
    else:
        over = engine.with_options(cache=StateCache(16 << 20), keep_state_tokens=0)  # the prefix kept
        reply = lev_on_engine(release, over, STATE, questions)
    dept = expected(fresh_base, tok, CHOICE_SUFFIXES["plain"], [[0, 1, 2], [2, 1, 0]], [" A", " B", " C"])
    close(reply.answers["dept"].probabilities, dept)
    urgent = expected(fresh_base, tok, BINARY["plain"], [[0, 1], [1, 0]], [" A", " B"])
    close(reply.answers["urgent"].distribution, urgent)
    assert reply.answers["urgent"].orders == 2  # uncalibrated: T = 1 whatever the bucket


def test_a_lev_entry_without_a_release_serves_the_base_by_lev_method(
    engine, checkpoint, tmp_path, fresh_base
):
    models = tmp_path / "models.toml"
    models.write_text('[models.lev-base]\nmethod = "lev"\n[aliases]\nlocal = "lev-base"\n', encoding="utf-8")
    entry = load_models(models, "base@x", MethodRegistry.of()).resolve("local")
    assert entry is not None and entry.method == LevMethod.name and entry.directory is None
    assert entry.options == {"noul_readout": "binary"}  # as lev's server reads the frozen base
    service = Service.start(make_settings(checkpoint, models=models), engine=engine)
    assert "lev-base" not in [a.name for a in service.engine.adapters.adapters]  # no adapter loaded
    served = service.models.resolve("local")
    assert served is not None and served.method.name == LevMethod.name
    urgent = AskedQuestion("urgent", "noul", URGENT.instructions, URGENT.criteria)
    ask = Ask(served, STATE, (urgent,), Limits(max_input_tokens=4096, max_options=16, max_rows=64))
    answer = asyncio.run(service.decide(ask)).answers
    assert answer is not None
    want = expected(fresh_base, engine.codec.tokenizer, BINARY["plain"], [[0, 1], [1, 0]], [" A", " B"])
    close(list(answer[0].block.distribution.values()), want)


@pytest.mark.parametrize(
    "table, named",
    [
        ('method = "semif"', "models.lev-base.method"),  # only lev reads the base alone
        ('method = "lev"\nscale = 2', "models.lev-base.scale"),  # no adapter to scale
        ('method = "lev"\nnoul_readout = "both"', "models.lev-base.noul_readout"),
    ],
)
def test_a_bad_lev_base_entry_is_refused_naming_its_key(tmp_path, table, named):
    from semif_serve.domain.types import ConfigurationError

    models = tmp_path / "models.toml"
    models.write_text(f"[models.lev-base]\n{table}\n", encoding="utf-8")
    with pytest.raises(ConfigurationError, match=named.replace(".", r"\.")):
        load_models(models, "base@x", MethodRegistry.of())
