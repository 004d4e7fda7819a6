"""lev's release read exactly as lev reads it: every answer against an independent computation.

The release is built in lev's on-disk format over the tiny random Qwen3.5 checkpoint (PEFT saves
the adapter; the head and calibration are written as lev writes them). The expected prompts are
written out here by hand in lev's format; the reference forward is transformers + PEFT's own
LoRA (`tests/support/peft_oracle.py`: `PeftModel.from_pretrained`, the scale through `rescale_adapter_scale`); the softmax with
temperature, the order averaging and the head's attention are written out below.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import string
from pathlib import Path

import pytest
import torch

from semif_serve.domain.lev.release import serving_options
from semif_serve.domain.lev.types import LevChoice, LevNoul, LevReleaseError, LevScore, ModeBUnavailable
from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.lev_release import load_lev_release
from semif_serve.engine.runner import TorchEngine
from semif_serve.engine.state_cache import StateCache
from semif_serve.tools.lev_builder import DEFAULT_BASE_NAME, DEFAULT_TEMPERATURES, write_lev_release
from tests.support.lev_oracle import lev_on_engine, lev_per_row
from tests.support.peft_oracle import peft_last, peft_model

TOL = 1e-5
STATE = {"ticket": "Ça ne marche pas", "id": 7}
STATE_JSON = '{"id": 7, "ticket": "Ça ne marche pas"}'
PLAIN_PREFIX = f"Context:\n{STATE_JSON}\n\n"
CHAT_PREFIX = (
    "<|im_start|>system\nYou are a System One decision model. You read the Evidence and answer each "
    "Criterion by choosing exactly one of the listed options. You never explain. You answer with the "
    f"single option label only.<|im_end|>\n<|im_start|>user\n# Evidence\n{STATE_JSON}\n\n"
)
CHAT_TAIL = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
SALES = '{"a": "\\u00e9", "z": 1}'
DEPT = LevChoice(
    {"billing": "money matters", "tech": None, "sales": {"z": 1, "a": "é"}}, instructions="Which team?"
)
FRUSTRATION = LevScore(
    ("calm", "annoyed", {"level": "furious"}), instructions={"question": "How upset?", "data": 3}
)
URGENT = LevNoul(criteria={"true": "needs action today", "false": None})
NINE = list("ABCDEFGHI")


@pytest.fixture(scope="module")
def release_dirs(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lev")
    return {
        "plain": write_lev_release(root / "plain", checkpoint, prompt_style="plain", seed=3),
        "chat": write_lev_release(root / "chat", checkpoint, prompt_style="chat", seed=4),
    }


@pytest.fixture(scope="module")
def releases(base, bank, release_dirs, checkpoint):
    tok = base.codec.tokenizer
    return {
        style: load_lev_release(
            path, bank, tok, name=style, base_name=DEFAULT_BASE_NAME, base_directory=checkpoint
        )
        for style, path in release_dirs.items()
    }


@pytest.fixture(scope="module")
def references(checkpoint, release_dirs):
    """PEFT's own LoRA over a fresh copy of the base, one per release."""
    return {style: peft_model(checkpoint, path) for style, path in release_dirs.items()}


@pytest.fixture(scope="module", params=["per-row", "engine, whole rows", "engine, kept prefix"])
def score(request, base, bank):
    """A release's answers as lev computes them row by row (`lev_per_row`), or through the serving
    engine's jobs over the same bank (`lev_on_engine`): short prefixes as whole rows in one
    forward, or every prefix prefilled once into the state cache and the rows over it."""
    if request.param == "per-row":
        return lambda release, state, questions: lev_per_row(release, base.model, bank, state, questions)
    keep = 10**6 if request.param == "engine, whole rows" else 0
    engine = TorchEngine.over(base, bank).with_options(cache=StateCache(64 << 20), keep_state_tokens=keep)
    return lambda release, state, questions: lev_on_engine(release, engine, state, questions)


@pytest.fixture
def spare_bank(base):
    """A bank of its own for a release read once by a test (closed after: the base is plain again)."""
    bank = AdapterBank(base.model)
    yield bank
    bank.close()


def with_options(release, **changes):
    return dataclasses.replace(release, options=dataclasses.replace(release.options, **changes))


# -- the independent computation -------------------------------------------------------------


def reference_last(reference, tok, prefix: str, suffix: str, scale: float):
    """Logits and final hidden state at the last token: prefix and suffix encoded apart, joined."""
    ids = tok.encode(prefix, add_special_tokens=True) + tok.encode(suffix, add_special_tokens=False)
    return peft_last(reference, ids, scale)


def softmax_t(scores, temperature):
    scaled = [s / temperature for s in scores]
    top = max(scaled)
    exps = [math.exp(s - top) for s in scaled]
    return [e / sum(exps) for e in exps]


def label_ids(tok, labels):
    ids = [tok.encode(label, add_special_tokens=False) for label in labels]
    assert all(len(i) == 1 for i in ids), labels
    return [i[0] for i in ids]


def expected_probs(reference, tok, prefix, suffixes, orders, labels, temperature, scale=0.25):
    """Each order's softmax(label logits / T) put back in the caller's order, averaged."""
    ids = label_ids(tok, labels)
    total = [0.0] * len(labels)
    for suffix, order in zip(suffixes, orders, strict=True):
        logits, _ = reference_last(reference, tok, prefix, suffix, scale)
        probs = softmax_t([float(logits[i]) for i in ids], temperature)
        for shown, p in enumerate(probs):
            total[order[shown]] += p
    return [t / len(suffixes) for t in total]


def close(got, want):
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL, (got, want)


def tokens_of(tok, prefix, suffixes):
    return len(tok.encode(prefix)) + sum(len(tok.encode(s, add_special_tokens=False)) for s in suffixes)


# -- Mode A, each type, both styles ----------------------------------------------------------

CHOICE_SUFFIXES = {
    "plain": [
        f"Question: Which team?\nOptions:\n  A: billing - money matters\n  B: tech\n  C: sales - {SALES}\nAnswer:",
        f"Question: Which team?\nOptions:\n  A: sales - {SALES}\n  B: tech\n  C: billing - money matters\nAnswer:",
    ],
    "chat": [
        f"# Criterion\nWhich team?\n\n# Options\nA. billing: money matters\nB. tech\nC. sales: {SALES}\n\n"
        f"Respond with only the letter of the best option.{CHAT_TAIL}",
        f"# Criterion\nWhich team?\n\n# Options\nA. sales: {SALES}\nB. tech\nC. billing: money matters\n\n"
        f"Respond with only the letter of the best option.{CHAT_TAIL}",
    ],
}


def prefix_of(style):
    return PLAIN_PREFIX if style == "plain" else CHAT_PREFIX


def labels_of(style, codes):
    return [(" " if style == "plain" else "") + c for c in codes]


@pytest.mark.parametrize("style", ["plain", "chat"])
def test_choice_two_orders_small_band(score, style, base, releases, references):
    tok = base.codec.tokenizer
    reply = score(releases[style], STATE, {"dept": DEPT})
    answer = reply.answers["dept"]
    want = expected_probs(
        references[style], tok, prefix_of(style), CHOICE_SUFFIXES[style], [[0, 1, 2], [2, 1, 0]],
        labels_of(style, "ABC"), DEFAULT_TEMPERATURES["choice:A:small"],
    )  # fmt: skip
    close(answer.probabilities, want)
    assert answer.value == ["billing", "tech", "sales"][want.index(max(want))]
    assert (answer.bucket, answer.orders, answer.mode) == ("choice:A:small", 2, "A")
    assert reply.input_tokens == tokens_of(tok, prefix_of(style), CHOICE_SUFFIXES[style])
    assert reply.cached_input_tokens == len(tok.encode(prefix_of(style)))


SCORE_PLAIN = "Question: {'question': 'How upset?', 'data': 3}\nLevels:\n  A: %s\n  B: %s\n  C: %s\nAnswer:"
SCORE_CHAT = (
    "# Criterion\n{'question': 'How upset?', 'data': 3}\n\n# Options\nA. (level %d of 2) %s\n"
    "B. (level %d of 2) %s\nC. (level %d of 2) %s\n\nRespond with only the letter of the level that best matches."
    + CHAT_TAIL
)
LEVELS = ["calm", "annoyed", '{"level": "furious"}']


def score_suffix(style, order):
    if style == "plain":
        return SCORE_PLAIN % tuple(LEVELS[i] for i in order)
    return SCORE_CHAT % tuple(x for i in order for x in (i, LEVELS[i]))


@pytest.mark.parametrize("style", ["plain", "chat"])
@pytest.mark.parametrize(
    "setting, orders",
    [
        ("none", [[0, 1, 2]]),
        ("reversal", [[0, 1, 2], [2, 1, 0]]),
        ("rotations", [[0, 1, 2], [1, 2, 0], [2, 0, 1]]),
    ],
)
def test_score_orders(score, style, setting, orders, base, releases, references):
    tok = base.codec.tokenizer
    release = with_options(releases[style], score_order_average=setting)
    answer = score(release, STATE, {"frustration": FRUSTRATION}).answers["frustration"]
    suffixes = [score_suffix(style, order) for order in orders]
    want = expected_probs(
        references[style], tok, prefix_of(style), suffixes, orders, labels_of(style, "ABC"),
        DEFAULT_TEMPERATURES["score:A"],
    )  # fmt: skip
    close(answer.probabilities, want)
    assert abs(answer.value - sum(i * p for i, p in enumerate(want))) < TOL
    assert answer.orders == len(orders)


@pytest.mark.parametrize(
    "lev_name, ours", [("off", "none"), ("reversed", "reversal"), ("cyclic", "rotations")]
)
def test_levs_own_score_order_names_are_stored_as_the_one_orderings_vocabulary(lev_name, ours, releases):
    manifest = releases["plain"].manifest
    assert serving_options(manifest, score_order_average=lev_name).score_order_average == ours


RATING = {
    "plain": "Question: urgent\nRate 0-8 how strongly this is true (0 = certainly no, 8 = certainly yes).\n"
    "  true: needs action today\nAnswer:",
    "chat": "# Criterion\nurgent\n\n# Scale\n0 = certainly no ... 8 = certainly yes\nyes: needs action today\n\n"
    "Respond with only a digit from 0 to 8." + CHAT_TAIL,
}


@pytest.mark.parametrize("style", ["plain", "chat"])
def test_rating_noul_read_once_from_nine_codes(score, style, base, releases, references):
    tok = base.codec.tokenizer
    answer = score(releases[style], STATE, {"urgent": URGENT}).answers["urgent"]
    want = expected_probs(
        references[style], tok, prefix_of(style), [RATING[style]], [list(range(9))], labels_of(style, NINE),
        DEFAULT_TEMPERATURES["noul:A"],
    )  # fmt: skip
    close(answer.probabilities, want)
    assert abs(answer.value - sum(i / 8 * p for i, p in enumerate(want))) < TOL
    assert (answer.bucket, answer.orders) == ("noul:A", 1)


BINARY = {
    "plain": [
        "Question: urgent\nOptions:\n  A: yes - needs action today\n  B: no\nAnswer:",
        "Question: urgent\nOptions:\n  A: no\n  B: yes - needs action today\nAnswer:",
    ],
    "chat": [
        "# Criterion\nurgent\n\n# Options\nA. yes: needs action today\nB. no: the statement is false\n\n"
        "Respond with only the letter of the best option." + CHAT_TAIL,
        "# Criterion\nurgent\n\n# Options\nA. no: the statement is false\nB. yes: needs action today\n\n"
        "Respond with only the letter of the best option." + CHAT_TAIL,
    ],
}


@pytest.mark.parametrize("style", ["plain", "chat"])
def test_binary_noul_two_orders(score, style, base, releases, references):
    tok = base.codec.tokenizer
    release = with_options(releases[style], noul_readout="binary")
    answer = score(release, STATE, {"urgent": URGENT}).answers["urgent"]
    want = expected_probs(
        references[style], tok, prefix_of(style), BINARY[style], [[0, 1], [1, 0]], labels_of(style, "AB"),
        DEFAULT_TEMPERATURES["noul_binary:A"],
    )  # fmt: skip
    assert answer.probabilities is None
    close(answer.distribution, want)
    assert abs(answer.value - want[0]) < TOL
    assert (answer.bucket, answer.orders) == ("noul_binary:A", 2)


@pytest.mark.parametrize(
    "count, bucket",
    [(10, "choice:A:mid"), (30, "choice:A")],  # 30 is "large": no such bucket, so the unbanded one
)
def test_choice_bands_and_fallback(score, count, bucket, base, releases, references):
    tok = base.codec.tokenizer
    names = [f"opt{i}" for i in range(count)]
    codes = (list(string.ascii_uppercase) + ["AA", "AB", "AC", "AD"])[:count]
    question = LevChoice(dict.fromkeys(names))
    order = list(range(count))
    suffixes = [
        "Question: many\nOptions:\n" + "\n".join(f"  {c}: {names[i]}" for c, i in zip(codes, o, strict=True))
        + "\nAnswer:"
        for o in (order, order[::-1])
    ]  # fmt: skip
    answer = score(releases["plain"], STATE, {"many": question}).answers["many"]
    want = expected_probs(
        references["plain"], tok, PLAIN_PREFIX, suffixes, [order, order[::-1]], labels_of("plain", codes),
        DEFAULT_TEMPERATURES[bucket],
    )  # fmt: skip
    close(answer.probabilities, want)
    assert answer.bucket == bucket


def test_uncalibrated_bucket_reads_temperature_one(score, base, releases, references):
    tok = base.codec.tokenizer
    release = with_options(releases["plain"], score_order_average="none")
    release = dataclasses.replace(
        release, calibration=dataclasses.replace(release.calibration, temperatures={})
    )
    answer = score(release, STATE, {"frustration": FRUSTRATION}).answers["frustration"]
    want = expected_probs(
        references["plain"], tok, PLAIN_PREFIX, [score_suffix("plain", [0, 1, 2])], [[0, 1, 2]],
        labels_of("plain", "ABC"), 1.0,
    )  # fmt: skip
    close(answer.probabilities, want)
    assert (answer.bucket, answer.temperature) == ("default", 1.0)


# -- Mode B: the candidate head --------------------------------------------------------------


def head_scores(state: dict, question_state, candidate_states):
    """lev's head written out: projections, 8-head self-attention over the candidates, the
    residual with the question, LayerNorm (eps 1e-5), one score each."""
    q = state["question_proj.weight"] @ question_state
    c = candidate_states @ state["candidate_proj.weight"].T  # (K, P)
    p = c.shape[1]
    w, b = state["set_attention.in_proj_weight"], state["set_attention.in_proj_bias"]
    queries, keys, values = (c @ w[i * p : (i + 1) * p].T + b[i * p : (i + 1) * p] for i in range(3))
    heads, d = 8, p // 8
    outputs = []
    for h in range(heads):
        part = slice(h * d, (h + 1) * d)
        weights = torch.softmax(queries[:, part] @ keys[:, part].T / math.sqrt(d), dim=-1)
        outputs.append(weights @ values[:, part])
    attended = (
        torch.cat(outputs, dim=1) @ state["set_attention.out_proj.weight"].T
        + state["set_attention.out_proj.bias"]
    )
    x = attended + q
    mean = x.mean(dim=1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=1, keepdim=True)
    normed = (x - mean) / torch.sqrt(var + 1e-5) * state["norm.weight"] + state["norm.bias"]
    return (normed @ state["score.weight"].T).squeeze(-1).tolist()


def candidate_state(reference, tok, text, scale=0.25):
    return peft_last(reference, tok.encode(text, add_special_tokens=False)[:64], scale)[1]


MODE_B = {
    "plain": {
        "dept": "Question: Which team?\nChoose the best of the 3 candidates given.\nAnswer:",
        "frustration": "Question: {'question': 'How upset?', 'data': 3}\nChoose the best of the 3 levels given.\nAnswer:",
        "urgent": RATING["plain"],
    },
    "chat": {
        "dept": "# Criterion\nWhich team?\n\nChoose the best of the 3 candidates given." + CHAT_TAIL,
        "frustration": "# Criterion\n{'question': 'How upset?', 'data': 3}\n\nChoose the best of the 3 levels given."
        + CHAT_TAIL,
        "urgent": RATING["chat"],
    },
}
CANDIDATES = {
    "dept": ["billing", "tech", "sales"],
    "frustration": LEVELS,
    "urgent": [str(i) for i in range(9)],
}


@pytest.mark.parametrize("style", ["plain", "chat"])
def test_candidate_head_under_a_label_cap(score, style, base, releases, references, release_dirs):
    tok = base.codec.tokenizer
    release = with_options(releases[style], max_label_options=2)
    questions = {"dept": DEPT, "frustration": FRUSTRATION, "urgent": URGENT}
    reply = score(release, STATE, questions)
    state = torch.load(release_dirs[style] / "mode_b_head.pt", weights_only=True)
    temperatures = {"dept": DEFAULT_TEMPERATURES["choice:B"], "frustration": 1.0, "urgent": 1.0}
    for qid, suffix in MODE_B[style].items():
        _, hidden = reference_last(references[style], tok, prefix_of(style), suffix, 0.25)
        cands = torch.stack([candidate_state(references[style], tok, t) for t in CANDIDATES[qid]])
        want = softmax_t(head_scores(state, hidden, cands), temperatures[qid])
        answer = reply.answers[qid]
        close(answer.distribution, want)
        assert (answer.mode, answer.orders) == ("B", 1)
    assert (
        abs(
            reply.answers["urgent"].value
            - sum(i / 8 * p for i, p in enumerate(reply.answers["urgent"].distribution))
        )
        < TOL
    )
    # Every candidate is a row of its own: its ids count beside the head rows' suffixes.
    shown = sum(len(tok.encode(t, add_special_tokens=False)) for qid in CANDIDATES for t in CANDIDATES[qid])
    assert reply.input_tokens == tokens_of(tok, prefix_of(style), list(MODE_B[style].values())) + shown


def test_mode_b_without_a_head_is_refused(score, base, releases):
    release = dataclasses.replace(with_options(releases["plain"], max_label_options=2), head=None)
    with pytest.raises(ModeBUnavailable, match="^question 'b' needs .*mode_b_head.pt$") as caught:
        score(release, STATE, {"a": LevScore(("x", "y")), "b": DEPT})
    assert caught.value.question is None  # its message names the question: read whole, not placed


def test_adapter_scale_is_applied(score, base, releases, references):
    """The release's 0.25 against the adapter at full strength: the reference at 0.25 agrees, at 1.0 not."""
    tok = base.codec.tokenizer
    got = score(releases["plain"], STATE, {"dept": DEPT}).answers["dept"].probabilities
    args = (references["plain"], tok, PLAIN_PREFIX, CHOICE_SUFFIXES["plain"], [[0, 1, 2], [2, 1, 0]])
    full = expected_probs(*args, labels_of("plain", "ABC"), 0.7, scale=1.0)
    assert max(abs(a - b) for a, b in zip(got, full, strict=True)) > 100 * TOL
    assert releases["plain"].adapter_scale == 0.25


def test_base_is_untouched_after_scoring(score, base, releases, checkpoint):
    """The adapter is applied for the call only: the base's own forward is the checkpoint's."""
    from transformers import Qwen3_5ForCausalLM

    score(releases["plain"], STATE, {"dept": DEPT})
    fresh = Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor([base.codec.tokenizer.encode(PLAIN_PREFIX)])
    with torch.no_grad():
        assert torch.allclose(base.model(input_ids=ids).logits, fresh(input_ids=ids).logits, atol=1e-6)


def test_release_tokenizer_loaded_when_not_the_bases(base, release_dirs, spare_bank):
    release = load_lev_release(release_dirs["chat"], spare_bank, base.codec.tokenizer)
    assert release.tokenizer is not base.codec.tokenizer
    assert release.codes.capacity == 1716  # bare codes after a chat turn; " " + code gives 1864
    assert release.options.prompt_style == "chat"


# -- refused releases: the file and the key named --------------------------------------------


def broken(release_dirs, tmp_path, change):
    target = tmp_path / "release"
    shutil.copytree(release_dirs["plain"], target)
    change(target)
    return target


def edit_json(path: Path, **updates):
    data = json.loads(path.read_text())
    for key, value in updates.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def edit_tensors(path: Path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def edit_head(path: Path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def unlisted(directory: Path, name: str):
    """Remove a file and its `files` entry, so the check under test is the one that fires."""
    (directory / name).unlink()
    files = json.loads((directory / "lev_release.json").read_text())["files"]
    edit_json(directory / "lev_release.json", files=[f for f in files if f != name])


def _rename_first_a(t):
    key = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
    t[key.replace("layers.3.", "layers.99.")] = t.pop(key)
    t[key.replace("layers.3.", "layers.99.").replace("lora_A", "lora_B")] = t.pop(
        key.replace("lora_A", "lora_B")
    )


LA = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
BAD = [
    ("no manifest", lambda d: (d / "lev_release.json").unlink(), "lev_release.json", "missing"),
    (
        "no base",
        lambda d: edit_json(d / "lev_release.json", base_model=None),
        "lev_release.json",
        "base_model",
    ),
    (
        "another base",
        lambda d: (
            edit_json(d / "lev_release.json", base_model="Qwen/Qwen3-8B"),
            edit_json(d / "adapter_config.json", base_model_name_or_path="Qwen/Qwen3-8B"),
        ),
        "lev_release.json",
        "base_model: the release is for 'Qwen/Qwen3-8B'",
    ),
    (
        "manifest and adapter disagree",
        lambda d: edit_json(d / "adapter_config.json", base_model_name_or_path="Qwen/Qwen3-8B"),
        "adapter_config.json",
        "base_model_name_or_path",
    ),
    (
        "bad style",
        lambda d: edit_json(d / "lev_release.json", prompt_style="markdown"),
        "lev_release.json",
        "prompt_style",
    ),
    (
        "bad scale",
        lambda d: edit_json(d / "lev_release.json", adapter_scale=-1),
        "lev_release.json",
        "adapter_scale",
    ),
    ("rank", lambda d: edit_json(d / "lev_release.json", lora_rank=16), "lev_release.json", "lora_rank"),
    (
        "listed file missing",
        lambda d: (d / "tokenizer_config.json").unlink(),
        "lev_release.json",
        "files[",
    ),
    ("head promised", lambda d: unlisted(d, "mode_b_head.pt"), "lev_release.json", "mode_b_head: is true"),
    (
        "no adapter",
        lambda d: unlisted(d, "adapter_model.safetensors"),
        "adapter_model.safetensors",
        ": missing",
    ),
    (
        "dora",
        lambda d: edit_json(d / "adapter_config.json", use_dora=True),
        "adapter_config.json",
        "use_dora",
    ),
    (
        "not lora",
        lambda d: edit_json(d / "adapter_config.json", peft_type="IA3"),
        "adapter_config.json",
        "peft_type",
    ),
    (
        "rank pattern",
        lambda d: edit_json(d / "adapter_config.json", rank_pattern={"q_proj": 8}),
        "adapter_config.json",
        "rank_pattern",
    ),
    (
        "wrong shape",
        lambda d: edit_tensors(d / "adapter_model.safetensors", lambda t: t.update({LA: torch.zeros(4, 7)})),
        "adapter_model.safetensors",
        LA,
    ),
    (
        "module the base lacks",
        lambda d: edit_tensors(d / "adapter_model.safetensors", _rename_first_a),
        "adapter_model.safetensors",
        "layers.99.self_attn.q_proj",
    ),
    (
        "B missing",
        lambda d: edit_tensors(
            d / "adapter_model.safetensors", lambda t: t.pop(LA.replace("lora_A", "lora_B"))
        ),
        "adapter_model.safetensors",
        "lora_B.weight: missing",
    ),
    (
        "not a lora key",
        lambda d: edit_tensors(
            d / "adapter_model.safetensors", lambda t: t.update({"extra.weight": torch.zeros(2)})
        ),
        "adapter_model.safetensors",
        "extra.weight",
    ),
    (
        "head for another width",
        lambda d: edit_head(
            d / "mode_b_head.pt", lambda s: s.update({"question_proj.weight": torch.zeros(32, 99)})
        ),
        "mode_b_head.pt",
        "question_proj.weight",
    ),
    (
        "head key missing",
        lambda d: edit_head(d / "mode_b_head.pt", lambda s: s.pop("norm.bias")),
        "mode_b_head.pt",
        "norm.bias: missing",
    ),
    (
        "head key unknown",
        lambda d: edit_head(d / "mode_b_head.pt", lambda s: s.update({"gate.weight": torch.zeros(1)})),
        "mode_b_head.pt",
        "gate.weight",
    ),
    (
        "zero temperature",
        lambda d: edit_json(d / "calibration.json", temperatures={"choice:A": 0}),
        "calibration.json",
        "temperatures.choice:A",
    ),
    (
        "unknown bucket",
        lambda d: edit_json(d / "calibration.json", temperatures={"choice:C": 1.2}),
        "calibration.json",
        "temperatures.choice:C",
    ),
    (
        "no temperatures",
        lambda d: edit_json(d / "calibration.json", temperatures=None),
        "calibration.json",
        "temperatures",
    ),
    (
        "calibration promised",
        lambda d: unlisted(d, "calibration.json"),
        "lev_release.json",
        "calibrated: is true",
    ),
]


@pytest.mark.parametrize("label, change, file, key", BAD, ids=[b[0] for b in BAD])
def test_bad_release_refused_naming_file_and_key(
    label, change, file, key, base, release_dirs, tmp_path, checkpoint, spare_bank
):
    path = broken(release_dirs, tmp_path, change)
    with pytest.raises(LevReleaseError) as caught:
        load_lev_release(
            path, spare_bank, base.codec.tokenizer, base_name=DEFAULT_BASE_NAME, base_directory=checkpoint
        )
    message = str(caught.value)
    assert file in message and key in message, message


def test_operator_style_contradicting_the_manifest_is_refused(base, release_dirs, spare_bank):
    with pytest.raises(
        LevReleaseError, match="models.toml: prompt_style: 'chat' contradicts lev_release.json"
    ):
        load_lev_release(
            release_dirs["plain"],
            spare_bank,
            base.codec.tokenizer,
            prompt_style="chat",
            settings_source="models.toml",
        )
