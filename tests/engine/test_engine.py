"""The engine against independent computations: a plain transformers forward of the same
checkpoint, the prompt rendered here from SemIf's rules, softmax and SHA-256 computed here.

Every model is loaded for real from a random-weight checkpoint on disk; nothing is mocked.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import normalizers
from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from semif_serve.domain.alphabet import answer_codes
from semif_serve.domain.prompt import PromptCodec, TokenizerContractError
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import (
    AnswerBoundary,
    ConfigurationError,
    DecisionError,
    PromptRow,
    TooManyTokens,
)
from semif_serve.doors.base import refusal_of
from semif_serve.doors.native.api import NATIVE_ERRORS
from semif_serve.engine.loader import CheckpointError, load_model
from semif_serve.engine.runner import TorchEngine
from semif_serve.service.startup import Service, checkpoint_spec, load_engine
from tests.support import make_settings

# Written out from the brief, not imported: the test renders the prompt on its own.
SYSTEM = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
LETTERS = "ABCDEFGHIJKLMNOP"
MAX_TOKENS = 4096  # the native door's default per-call limit
LONG_TEXT = "The service returned errors for ten minutes after the release, then recovered. " * 42

STATES = {
    "short_string": "Health checks passed in all three zones",
    "long_string": LONG_TEXT,
    "nested_object": {"deploy": {"zones": ["eu", "us"], "healthy": True, "errors": None, "ratio": 0.5}},
    "list": ["refund", 3, {"ticket": "billing error"}],
    "non_ascii": "Zürich – 東京",
}

# A state whose prefix does not survive tokenisation with the demo tokenizer: `."` at the
# cut, `.",` in the full prompt.


def descriptions(n: int, tag: str) -> tuple[str, ...]:
    words = [
        "It succeeded.",
        "It failed.",
        "Unclear.",
        "Yes.",
        "No.",
        "A refund request.",
        "A password reset.",
        "The billing queue.",
    ]
    return tuple(f"{words[i % len(words)]} ({tag} {i})" for i in range(n))


def question_rows() -> list[PromptRow]:
    """Questions with 2..16 options and different lengths."""
    return [
        PromptRow("Did the deployment succeed?", descriptions(2, "a")),
        PromptRow("Which queue handles this ticket?", descriptions(3, "b")),
        PromptRow(
            "Is the customer asking for a refund, and how sure is the evidence about it?",
            descriptions(5, "c"),
        ),
        PromptRow("Which option?", descriptions(9, "d")),
        PromptRow("Pick the best of sixteen listed options.", descriptions(16, "e")),
    ]


# -- an independent reading of the same checkpoint --------------------------------------


def render(tokenizer, state, question: str, descs) -> str:
    user = json.dumps(
        {
            "evidence": state,
            "criterion": question,
            "options": [{"letter": LETTERS[i], "description": d} for i, d in enumerate(descs)],
        },
        ensure_ascii=False,
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def softmax_by_hand(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def plain_option_logits(model, tokenizer, ids: list[int], n: int) -> list[float]:
    """A full forward of every position, no cache; the last position at the letter tokens."""
    slots = [tokenizer.convert_tokens_to_ids(letter) for letter in LETTERS[:n]]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
    return [float(logits[0, -1, s]) for s in slots]


@pytest.fixture(scope="module")
def reference(checkpoint, tokenizer):
    model = Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def assert_close(actual, expected, tol: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) <= tol, (actual, expected)


# -- the direct path -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, n",
    [
        ("Health checks passed in all three zones.", 2),
        ({"ticket": "Zürich – 東京", "priority": 2}, 5),
        (["one", "two"], 16),
    ],
    ids=["string_2", "object_5", "list_16"],
)
def test_direct_option_logits_equal_a_plain_full_forward_of_the_prompt_rendered_from_the_rules(
    engine, reference, state, n
) -> None:
    model, tokenizer = reference
    question = "Which option fits the evidence?"
    descs = descriptions(n, "direct")
    text = render(tokenizer, state, question, descs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = plain_option_logits(model, tokenizer, ids, n)

    batch = engine.read(
        RowsRequest.of(state, [PromptRow(question, descs)], shared=False, max_input_tokens=MAX_TOKENS)
    )
    score = batch.rows[0]

    assert batch.shared is False and batch.timing.prefill == "none" and batch.timing.prefix_tokens == 0
    assert_close(score.option_logits, expected, 1e-5)
    assert_close(score.probabilities, softmax_by_hand(score.option_logits), 1e-6)
    assert_close(score.probabilities, softmax_by_hand(expected), 1e-5)
    assert score.prompt_sha256 == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert score.input_tokens == len(ids)
    assert batch.forward_seconds > 0 and batch.total_seconds >= batch.forward_seconds


def test_the_prompt_text_is_the_chat_template_of_the_system_and_user_turns(engine, reference) -> None:
    _, tokenizer = reference
    state, question, descs = {"a": "b"}, "Q?", ("x", "y")
    text = render(tokenizer, state, question, descs)
    prompt = engine.codec.encode_prompt(state, question, descs, MAX_TOKENS)
    assert prompt.text == text
    assert prompt.ids == tokenizer.encode(text, add_special_tokens=False)
    assert (
        '{"evidence": {"a": "b"}, "criterion": "Q?", "options": [{"letter": "A", "description": "x"}' in text
    )
    assert text.endswith("<think>\n\n</think>\n\n")


# -- the shared path -----------------------------------------------------------------------


@pytest.mark.parametrize("state", list(STATES.values()), ids=list(STATES))
def test_shared_rows_equal_a_direct_read_of_each_row(engine, state) -> None:
    rows = question_rows()
    shared = engine.read(RowsRequest.of(state, rows, shared=True, max_input_tokens=MAX_TOKENS))
    direct = [
        engine.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=MAX_TOKENS)).rows[0]
        for row in rows
    ]

    assert shared.shared is True
    for got, want, row in zip(shared.rows, direct, rows, strict=True):
        assert len(got.option_logits) == len(row.descriptions)
        assert_close(got.option_logits, want.option_logits, 1e-5)
        assert_close(got.probabilities, want.probabilities, 1e-5)
        assert got.input_tokens == want.input_tokens
        assert got.prompt_sha256 == want.prompt_sha256

    timing = shared.timing
    assert timing is not None
    prefix = engine.codec.state_prefix(
        state, engine.codec.encode_prompt(state, rows[0].question, rows[0].descriptions, MAX_TOKENS)
    )
    # Rows share everything up to their first differing token (at least the state prefix).
    ids = [engine.codec.encode_prompt(state, r.question, r.descriptions, MAX_TOKENS).ids for r in rows]
    common = 0
    while common < min(map(len, ids)) - 1 and len({i[common] for i in ids}) == 1:
        common += 1
    suffixes = [r.input_tokens - common for r in shared.rows]
    assert timing.prefix_tokens == common >= len(prefix) > 0
    assert timing.batch_size == len(rows)
    assert timing.forward_batches == 1
    assert timing.true_suffix_tokens == sum(suffixes)
    assert timing.padded_suffix_tokens == timing.true_suffix_tokens  # packed end to end: no padding
    for key in ("prefill_seconds", "replicate_seconds", "suffix_forward_seconds"):
        assert getattr(timing, key) >= 0
    assert timing.prefill_seconds > 0 and timing.suffix_forward_seconds > 0
    assert shared.forward_seconds == pytest.approx(
        timing.prefill_seconds + timing.replicate_seconds + timing.suffix_forward_seconds
    )


def test_the_long_state_is_about_six_hundred_tokens(engine) -> None:
    rows = question_rows()
    prompt = engine.codec.encode_prompt(LONG_TEXT, rows[0].question, rows[0].descriptions, MAX_TOKENS)
    assert 600 <= len(engine.codec.state_prefix(LONG_TEXT, prompt)) <= 800


@pytest.mark.parametrize("state", [STATES["long_string"], STATES["nested_object"]], ids=["long", "nested"])
@pytest.mark.parametrize("per_forward, batches", [(1, 5), (2, 3), (4, 2), (5, 1)])
def test_sub_batches_give_the_numbers_of_one_batch_and_are_counted(
    engine, state, per_forward, batches
) -> None:
    rows = question_rows()
    whole = engine.read(RowsRequest.of(state, rows, shared=True, max_input_tokens=MAX_TOKENS))
    # A memory headroom that holds the prefill and exactly `per_forward` rows splits the batch.
    n_prefix = whole.timing.prefix_tokens
    width = max(r.input_tokens for r in whole.rows) - n_prefix
    headroom = engine.estimate.prefill_bytes(n_prefix) + per_forward * engine.estimate.row_bytes(
        n_prefix, width
    )
    split = engine.with_options(headroom_bytes=headroom).read(
        RowsRequest.of(state, rows, shared=True, max_input_tokens=MAX_TOKENS)
    )

    assert split.timing.forward_batches == batches
    assert split.timing.batch_size == len(rows)
    assert split.timing.prefix_tokens == whole.timing.prefix_tokens
    assert split.timing.true_suffix_tokens == whole.timing.true_suffix_tokens
    # One forward packs the rows end to end; the headroom's split pads each forward to its widest.
    assert (
        whole.timing.padded_suffix_tokens
        == whole.timing.true_suffix_tokens
        <= split.timing.padded_suffix_tokens
    )
    for a, b in zip(split.rows, whole.rows, strict=True):
        assert_close(a.option_logits, b.option_logits, 1e-5)
        assert a.prompt_sha256 == b.prompt_sha256


def test_a_single_row_on_the_shared_path_equals_its_direct_read(engine) -> None:
    state, row = STATES["nested_object"], question_rows()[2]
    shared = engine.read(RowsRequest.of(state, [row], shared=True, max_input_tokens=MAX_TOKENS))
    direct = engine.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=MAX_TOKENS))
    assert shared.shared is True and shared.timing.batch_size == 1
    assert_close(shared.rows[0].option_logits, direct.rows[0].option_logits, 1e-5)


def test_identical_rows_in_one_batch_read_the_same(engine) -> None:
    row = question_rows()[1]
    batch = engine.read(
        RowsRequest.of(STATES["list"], [row, row, row], shared=True, max_input_tokens=MAX_TOKENS)
    )
    # Identical rows share all but their last token: the suffix is a one-token decode step.
    assert batch.timing.prefix_tokens == batch.rows[0].input_tokens - 1
    direct = engine.read(
        RowsRequest.of(STATES["list"], [row], shared=False, max_input_tokens=MAX_TOKENS)
    ).rows[0]
    for other in batch.rows:
        assert_close(other.option_logits, direct.option_logits, 1e-5)


# -- the state prefix ----------------------------------------------------------------------


@pytest.mark.parametrize("state", list(STATES.values()), ids=list(STATES))
def test_every_prompt_over_a_state_starts_with_its_state_prefix(engine, reference, state) -> None:
    _, tokenizer = reference
    codec = engine.codec
    prompts = [codec.encode_prompt(state, r.question, r.descriptions, MAX_TOKENS) for r in question_rows()]
    prefix = codec.state_prefix(state, prompts[0])

    # The prefix rendered here: the prompt cut just after `{"evidence": <state>, "criterion": "`,
    # minus its last token.
    text = render(tokenizer, "\x00", "Q", ("a", "b"))
    head = (
        text[: text.index('{"evidence": ')]
        + '{"evidence": '
        + json.dumps(state, ensure_ascii=False)
        + ', "criterion": "'
    )
    assert prefix == tokenizer.encode(head, add_special_tokens=False)[:-1]
    assert len(prefix) > 0
    for prompt in prompts:
        assert prompt.ids[: len(prefix)] == prefix
        assert codec.state_prefix(state, prompt) == prefix  # the same whichever question cut it


def test_a_state_prefix_the_prompts_do_not_start_with_is_cut_back_to_what_they_share(
    engine, monkeypatch
) -> None:
    state, rows = STATES["short_string"], question_rows()[:3]
    prompts = [engine.codec.encode_prompt(state, r.question, r.descriptions, MAX_TOKENS) for r in rows]
    real = engine.codec.state_prefix(state, prompts[0])
    # A tokenizer that merged across the cut would hand back a prefix the prompts do not start with.
    wrong_tail = [t for t in range(50) if t != prompts[0].ids[len(real)]][:2]
    monkeypatch.setattr(engine.codec, "state_prefix", lambda s, p: real + wrong_tail)

    shared = engine.read(RowsRequest.of(state, rows, shared=True, max_input_tokens=MAX_TOKENS))
    assert shared.timing.prefix_tokens == len(real)
    for got, row in zip(shared.rows, rows, strict=True):
        want = engine.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=MAX_TOKENS)).rows[0]
        assert_close(got.option_logits, want.option_logits, 1e-5)


def test_the_shared_token_prefix_is_the_longest_cut_every_prompt_starts_with() -> None:
    from types import SimpleNamespace

    from semif_serve.engine.runner import shared_token_prefix

    def prompts(*ids):
        return [SimpleNamespace(ids=list(i)) for i in ids]

    assert shared_token_prefix([1, 2, 3], prompts([1, 2, 3, 9], [1, 2, 3, 8])) == [1, 2, 3]
    assert shared_token_prefix([1, 2, 3], prompts([1, 2, 7, 9], [1, 2, 3, 8])) == [1, 2]
    assert shared_token_prefix([1, 2, 3], prompts([5, 2, 3, 9])) == []
    # Several rows share whatever they still have in common (the question of one decision's orderings).
    assert shared_token_prefix([1, 2, 3], prompts([1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 8])) == [1, 2, 3, 4, 5]
    # One row keeps the state prefix: its suffix is the question.
    assert shared_token_prefix([1, 2], prompts([1, 2, 3, 4, 5])) == [1, 2]
    # A prompt never gives up its last token to the prefix: the suffix must read a position.
    assert shared_token_prefix([1, 2, 3], prompts([1, 2, 3])) == [1, 2]


# -- the token limit -----------------------------------------------------------------------


def test_a_prompt_over_the_token_limit_is_refused_and_never_truncated(engine) -> None:
    with pytest.raises(TooManyTokens) as caught:
        engine.codec.encode_prompt(LONG_TEXT, "Did it recover?", ("Yes.", "No."), 200)
    error = refusal_of(NATIVE_ERRORS, caught.value, False, ())
    assert (error.status, error.code, error.field) == (422, "too_many_tokens", "state")
    assert "200" in error.message and "truncated" in error.message


def test_a_prompt_of_exactly_the_limit_is_served_whole(engine) -> None:
    tokenizer = engine.codec.tokenizer
    state, question, descs = STATES["list"], "Which?", ("x", "y", "z")
    n = len(tokenizer.encode(render(tokenizer, state, question, descs), add_special_tokens=False))
    assert len(engine.codec.encode_prompt(state, question, descs, n).ids) == n
    with pytest.raises(TooManyTokens) as caught:
        engine.codec.encode_prompt(state, question, descs, n - 1)
    assert refusal_of(NATIVE_ERRORS, caught.value, False, ()).code == "too_many_tokens"


def test_the_engine_refuses_an_over_limit_row_on_both_paths_naming_its_position(engine) -> None:
    short = PromptRow("Did it recover?", ("Yes.", "No."))
    long = PromptRow("Which? " + "the of and to in " * 60, ("Yes.", "No."))
    engine.read(RowsRequest.of("ok", [short], shared=False, max_input_tokens=200))  # under the limit: served
    for rows, shared in (([long], False), ([short, long], True)):
        with pytest.raises(TooManyTokens) as caught:
            engine.read(RowsRequest.of("ok", rows, shared=shared, max_input_tokens=200))
        error = refusal_of(NATIVE_ERRORS, caught.value, True, ())
        assert (error.status, error.code, caught.value.row) == (422, "too_many_tokens", len(rows) - 1)
        assert caught.value.limit == 200


# -- the tokenizer contract ---------------------------------------------------------------


def edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of a checkpoint (or tokenizer) directory whose tokenizer.json is edited by `edit`."""
    shutil.copytree(source, target)
    spec = json.loads((target / "tokenizer.json").read_text(encoding="utf-8"))
    edit(spec)
    (target / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return target


def lowercase(spec: dict) -> None:
    spec["normalizer"] = {"type": "Lowercase"}


def newlines_merge_with_a(spec: dict) -> None:
    """Drop Qwen's split (which keeps "\\n\\n" apart from a letter) and merge "\\n\\n" + "A"."""
    spec["pre_tokenizer"] = next(
        p for p in spec["pre_tokenizer"]["pretokenizers"] if p["type"] == "ByteLevel"
    )
    vocab = spec["model"]["vocab"]
    assert vocab["ĊĊ"] and ["Ċ", "Ċ"] in spec["model"]["merges"]  # Qwen3.5 already merges "\n\n"
    vocab["ĊĊA"] = max(token["id"] for token in spec["added_tokens"]) + 1
    spec["model"]["merges"].append(["ĊĊ", "A"])


@pytest.fixture(scope="module")
def private_tokenizer(tokenizer):
    """A copy of the checkpoint's tokenizer whose normalizer a test may swap, then restore."""
    return copy.deepcopy(tokenizer)


@pytest.mark.parametrize(
    "normalizer, message",
    [
        (
            normalizers.Lowercase(),
            "answer letter 'A' is not one token that decodes back to itself "
            "(encodes to 1 token(s), decodes to 'a')",
        ),
        (
            normalizers.Replace("B", "A"),
            "answer letter 'B' is not one token that decodes back to itself "
            "(encodes to 1 token(s), decodes to 'A')",
        ),
        (
            normalizers.Replace("P", "P P"),
            "answer letter 'P' is not one token that decodes back to itself (encodes to 2 token(s)",
        ),
    ],
    ids=["lowercase", "two_letters_one_token", "letter_two_tokens"],
)
def test_a_tokenizer_whose_answer_slots_are_broken_is_refused(private_tokenizer, normalizer, message) -> None:
    backend = private_tokenizer.backend_tokenizer
    original, backend.normalizer = backend.normalizer, normalizer
    try:
        with pytest.raises(TokenizerContractError, match="^" + re.escape(message)):
            answer_codes(private_tokenizer)
        with pytest.raises(TokenizerContractError):
            PromptCodec(private_tokenizer)
    finally:
        backend.normalizer = original
    assert answer_codes(private_tokenizer).capacity  # restored: the next test starts from the real tokenizer


def test_the_demo_tokenizer_keeps_every_letter_one_distinct_token(reference) -> None:
    _, tokenizer = reference
    slots = list(answer_codes(tokenizer).first(16).token_ids)
    assert slots == [tokenizer.convert_tokens_to_ids(letter) for letter in LETTERS]
    assert len(set(slots)) == 16


@pytest.fixture(scope="module")
def boundary_checkpoint(checkpoint, tmp_path_factory) -> Path:
    return edited_copy(checkpoint, tmp_path_factory.mktemp("boundary") / "ckpt", newlines_merge_with_a)


@pytest.fixture(scope="module")
def boundary_tokenizer(boundary_checkpoint):
    return AutoTokenizer.from_pretrained(str(boundary_checkpoint))


def test_a_letter_that_merges_across_the_answer_boundary_refuses_the_prompt(boundary_tokenizer) -> None:
    tokenizer = boundary_tokenizer
    codec = PromptCodec(tokenizer)  # every letter alone is still one token
    text = render(tokenizer, "ok", "Did it?", ("Yes.", "No."))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text + "A", add_special_tokens=False)[:-1] != ids  # the merge is real

    with pytest.raises(AnswerBoundary) as caught:
        codec.encode_prompt("ok", "Did it?", ("Yes.", "No."), MAX_TOKENS)
    caught.value.question = 3  # the core places it; the door names the field
    error = refusal_of(NATIVE_ERRORS, caught.value, True, ())
    assert (error.status, error.code, error.field) == (422, "answer_boundary", "decisions[3]")
    assert (caught.value.option, caught.value.letter) == (0, "A")
    assert "'A'" in error.message


def test_a_service_whose_tokenizer_breaks_the_answer_boundary_fails_to_start(boundary_checkpoint) -> None:
    with pytest.raises(AnswerBoundary) as caught:
        Service.start(make_settings(boundary_checkpoint))
    assert refusal_of(NATIVE_ERRORS, caught.value, False, ()).code == "answer_boundary"


def test_the_loader_refuses_a_checkpoint_whose_tokenizer_breaks_the_answer_slots(
    checkpoint, tmp_path
) -> None:
    broken = edited_copy(checkpoint, tmp_path / "ckpt", lowercase)
    with pytest.raises(TokenizerContractError, match="answer letter 'A' is not one token"):
        load_engine(make_settings(broken))


# -- the loader ----------------------------------------------------------------------------


def rewrite_weights(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(checkpoint, tmp_path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    broken = rewrite_weights(checkpoint, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing_keys") as caught:
        load_engine(make_settings(broken))
    assert name in str(caught.value)


def test_a_checkpoint_with_a_wrongly_shaped_tensor_is_refused_naming_it(checkpoint, tmp_path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"

    def reshape(tensors):
        tensors[name] = torch.zeros(3, 5)

    broken = rewrite_weights(checkpoint, tmp_path / "ckpt", reshape)
    with pytest.raises(CheckpointError, match="mismatched") as caught:
        load_engine(make_settings(broken))
    assert name in str(caught.value)


def test_extra_tensors_beside_the_text_model_are_skipped_and_counted(checkpoint, tmp_path) -> None:
    def add(tensors):
        tensors["mtp.fc.weight"] = torch.zeros(4, 4)
        tensors["mtp.norm.weight"] = torch.zeros(4)

    extended = rewrite_weights(checkpoint, tmp_path / "ckpt", add)
    assert load_model(checkpoint_spec(make_settings(extended))).skipped_tensors == 2


def test_a_non_qwen35_architecture_is_refused_unless_allowed(checkpoint, tmp_path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "llama"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not a Qwen3.5 text model") as caught:
        load_engine(make_settings(target))
    assert "SEMIF_ALLOW_ANY_ARCHITECTURE" in str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_a_gpu_is_a_configuration_error_before_any_weights_load(
    checkpoint, tmp_path
) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoint, target)
    (target / "model.safetensors").write_bytes(b"not weights")  # loading these would fail differently
    with pytest.raises(ConfigurationError, match="no CUDA device is visible"):
        load_engine(make_settings(target, device="cuda"))


@pytest.mark.parametrize("revision", ["", "   "])
def test_a_missing_revision_is_refused(checkpoint, revision) -> None:
    with pytest.raises(ConfigurationError, match="SEMIF_MODEL_REVISION"):
        load_engine(make_settings(checkpoint, model_revision=revision))


def test_a_missing_model_directory_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="not a directory"):
        load_engine(make_settings(tmp_path / "absent"))


# -- the multimodal checkpoint -------------------------------------------------------------


@pytest.fixture(scope="module")
def multimodal(vision_checkpoint):
    """The session's multimodal demo checkpoint (written once for the suite), loaded here."""
    loaded = load_model(checkpoint_spec(make_settings(vision_checkpoint)))
    return vision_checkpoint, TorchEngine.over(loaded), loaded.skipped_tensors


def test_a_multimodal_checkpoint_loads_as_the_vision_language_model_and_uses_every_tensor(
    multimodal,
) -> None:
    directory, engine, skipped_tensors = multimodal
    with safe_open(str(directory / "model.safetensors"), "pt") as fh:
        names = list(fh.keys())
    visual = sum(1 for n in names if "visual" in n)
    assert visual > 0
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen3_5"
    assert engine.reads_images
    tower = engine.vision.model.model.visual
    assert sum(1 for _ in tower.named_parameters()) == visual
    assert skipped_tensors == 0  # the demo writes no MTP head: nothing is left unread


def test_a_multimodal_checkpoints_option_logits_equal_its_own_text_only_forward(
    multimodal, checkpoint, tokenizer
) -> None:
    directory, engine, _ = multimodal
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the same tokenizer
        assert (directory / name).read_bytes() == (checkpoint / name).read_bytes(), name
    full = Qwen3_5ForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32)
    full.eval()
    state, question, descs = (
        {"zones": 3, "health": "passed"},
        "Did the deployment succeed?",
        descriptions(4, "mm"),
    )
    text = render(tokenizer, state, question, descs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = plain_option_logits(full, tokenizer, ids, len(descs))

    direct = engine.read(
        RowsRequest.of(state, [PromptRow(question, descs)], shared=False, max_input_tokens=MAX_TOKENS)
    ).rows[0]
    assert_close(direct.option_logits, expected, 1e-5)
    assert direct.prompt_sha256 == hashlib.sha256(text.encode("utf-8")).hexdigest()
    shared = engine.read(
        RowsRequest.of(
            state,
            [PromptRow(question, descs), PromptRow("Other?", ("x", "y"))],
            shared=True,
            max_input_tokens=MAX_TOKENS,
        )
    )
    assert shared.timing.prefix_tokens > 0
    assert_close(shared.rows[0].option_logits, expected, 1e-5)


@pytest.mark.parametrize("which", ["good", "broken"])
def test_the_per_tail_boundary_check_agrees_with_re_encoding_every_prompt(which, request) -> None:
    tokenizer = request.getfixturevalue("tokenizer" if which == "good" else "boundary_tokenizer")
    codec = PromptCodec(tokenizer)
    for state in STATES.values():
        for n in (2, 5, 16):
            descs = descriptions(n, "t")
            text = render(tokenizer, state, "Which one?", descs)
            ids = tokenizer.encode(text, add_special_tokens=False)
            full = [
                tokenizer.encode(text + L, add_special_tokens=False) == ids + [s]
                for L, s in zip(LETTERS[:n], codec.slots, strict=False)
            ]
            try:
                codec.encode_prompt(state, "Which one?", descs, MAX_TOKENS)
                refused = False
            except DecisionError as error:
                assert isinstance(error, AnswerBoundary)
                refused = True
            assert refused == (not all(full))
