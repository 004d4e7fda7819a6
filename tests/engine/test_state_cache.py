"""The state cache on the real Qwen3.5 architecture (tiny random weights, fp32 CPU): a cached
state scores exactly like a fresh prefill and like a plain full forward, survives reuse
unchanged, extends to longer prefixes, and is evicted least-recently-used under its budget."""

from __future__ import annotations

import pytest
import torch

from semif_serve.engine.forwards import prefill, suffix_logits
from semif_serve.engine.state_cache import (
    StateCache,
    StoredState,
    fork_cache,
    prefix_digest,
    state_bytes,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def model(engine):
    return engine.model


@pytest.fixture(scope="module")
def pad_id(engine):
    return engine.pad_id


def token_ids(n: int, seed: int) -> list[int]:
    """Deterministic pseudo-random ids away from the special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    """The independent reference: a plain forward of the whole prompt, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].float()


def snapshot(state: StoredState) -> list[torch.Tensor]:
    return [t.clone() for t in state.tensors()]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).abs().max().item() <= TOL


def test_a_prefilled_state_holds_keys_values_and_linear_attention_states_at_the_prefix_boundary(model):
    prefix = token_ids(23, 1)
    cache = prefill(model, prefix)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert kinds == {"DynamicLayer", "LinearAttentionLayer"}
    full = [layer for layer in cache.layers if type(layer).__name__ == "DynamicLayer"]
    linear = [layer for layer in cache.layers if type(layer).__name__ == "LinearAttentionLayer"]
    assert all(layer.keys.shape[-2] == 23 for layer in full)
    assert all(layer.conv_states[0] is not None and layer.recurrent_states[0] is not None for layer in linear)
    expected = sum(layer.keys.numel() * 2 * layer.keys.element_size() for layer in full) + sum(
        (layer.conv_states[0].numel() + layer.recurrent_states[0].numel()) * 4 for layer in linear
    )
    assert state_bytes(cache) == expected


def test_scoring_over_a_cached_state_equals_a_fresh_prefill_and_a_plain_full_forward(model, pad_id):
    prefix, suffix = token_ids(40, 2), token_ids(7, 3)
    cache = StateCache(budget_bytes=10**9)
    cache.put(prefix, prefill(model, prefix))
    hit = cache.get(prefix)
    assert hit is not None
    cached = suffix_logits(model, hit, [suffix], pad_id)[0]
    fresh = suffix_logits(model, StoredState(prefix, prefill(model, prefix)), [suffix], pad_id)[0]
    assert_close(cached, fresh)
    assert_close(cached, full_forward_logits(model, prefix + suffix))


def test_a_cached_state_reused_by_right_padded_rows_of_different_lengths_scores_each_row_exactly(
    model, pad_id
):
    prefix = token_ids(31, 4)
    suffixes = [token_ids(n, 10 + n) for n in (1, 9, 4, 13)]
    cache = StateCache(budget_bytes=10**9)
    state = cache.put(prefix, prefill(model, prefix))
    batched = suffix_logits(model, state, suffixes, pad_id)
    for row, suffix in zip(batched, suffixes, strict=True):
        assert_close(row, full_forward_logits(model, prefix + suffix))


def test_a_stored_state_reused_three_times_stays_bit_unchanged_and_scores_the_same_each_time(model, pad_id):
    prefix = token_ids(29, 5)
    state = StateCache(budget_bytes=10**9).put(prefix, prefill(model, prefix))
    before = snapshot(state)
    rows = [[token_ids(5, 6), token_ids(3, 7)], [token_ids(11, 8)], [token_ids(2, 9)] * 3]
    for suffixes in rows:
        got = suffix_logits(model, state, suffixes, pad_id)
        for row, suffix in zip(got, suffixes, strict=True):
            assert_close(row, full_forward_logits(model, prefix + suffix))
    # A one-token forward takes the in-place causal_conv1d_update path; an extension prefills on top.
    suffix_logits(model, state, [[42]], pad_id)
    prefill(model, prefix + token_ids(6, 10), start=state)
    after = state.tensors()
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_fork_shares_the_attention_keys_and_owns_its_linear_attention_states(model):
    state = StoredState(token_ids(12, 11), prefill(model, token_ids(12, 11)))
    twin = fork_cache(state._cache, rows=3)
    for original, forked in zip(state._cache.layers, twin.layers, strict=True):
        if type(original).__name__ == "DynamicLayer":
            assert forked.keys.shape[0] == 3
            assert forked.keys.untyped_storage().data_ptr() == original.keys.untyped_storage().data_ptr()
        else:
            assert forked.conv_states[0].shape[0] == 3
            assert forked.conv_states[0].data_ptr() != original.conv_states[0].data_ptr()
            assert forked.has_previous_state is not original.has_previous_state


def test_chunked_prefill_equals_one_shot_prefill_on_the_next_token_logits(model, pad_id):
    ids = token_ids(150, 12)
    one_shot = StoredState(ids, prefill(model, ids))
    for chunk in (1, 7, 64, 149):
        chunked = StoredState(ids, prefill(model, ids, chunk_tokens=chunk))
        assert chunked.nbytes == one_shot.nbytes
        next_token = [token_ids(1, 13)]
        assert_close(
            suffix_logits(model, chunked, next_token, pad_id)[0],
            suffix_logits(model, one_shot, next_token, pad_id)[0],
        )


def test_a_state_extended_from_a_cached_shorter_prefix_equals_a_fresh_prefill_of_the_longer(model, pad_id):
    short = token_ids(35, 14)
    longer = short + token_ids(20, 15)
    cache = StateCache(budget_bytes=10**9)
    cache.put(short, prefill(model, short))
    start = cache.longest_prefix(longer)
    assert start is not None and start.ids == tuple(short)
    extended = cache.put(longer, prefill(model, longer, start=start, chunk_tokens=8))
    suffix = token_ids(6, 16)
    assert_close(
        suffix_logits(model, extended, [suffix], pad_id)[0], full_forward_logits(model, longer + suffix)
    )
    assert cache.longest_prefix(longer + [5]).ids == tuple(longer)


def test_prefill_refuses_a_start_state_that_is_not_a_prefix_of_the_ids(model):
    start = StoredState([11, 12, 13], prefill(model, [11, 12, 13]))
    with pytest.raises(ValueError, match="prefix"):
        prefill(model, [11, 99, 13, 14], start=start)


def fake_state(n_bytes: int):
    """A one-layer cache whose keys and values together hold `n_bytes` (for the bookkeeping tests)."""
    from transformers.cache_utils import Cache, DynamicLayer

    layer = DynamicLayer()
    half = torch.zeros((1, 1, n_bytes // 8, 1), dtype=torch.float32)
    layer.update(half, half.clone())
    return Cache(layers=[layer])


def test_the_least_recently_used_state_is_evicted_when_a_new_one_does_not_fit_the_budget():
    cache = StateCache(budget_bytes=1000)
    cache.put([0], fake_state(400))
    cache.put([1], fake_state(400))
    assert cache.stats().bytes == 800
    assert cache.get([0]) is not None  # [1] is now the least recently used
    cache.put([2], fake_state(400))
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 800, 1)
    assert cache.get([1]) is None
    assert cache.get([0]) is not None and cache.get([2]) is not None
    assert (cache.stats().hits, cache.stats().misses) == (3, 1)


def test_a_state_larger_than_the_whole_budget_is_returned_usable_but_never_stored():
    cache = StateCache(budget_bytes=100)
    state = cache.put([7], fake_state(400))
    assert state.nbytes == 400
    assert cache.stats().entries == 0 and cache.stats().refused == 1
    assert cache.get([7]) is None


def test_shrink_to_and_clear_release_least_recently_used_states_first_and_report_the_bytes_freed():
    cache = StateCache(budget_bytes=10_000)
    for i in range(4):
        cache.put([i], fake_state(800))
    cache.get([0])
    assert cache.shrink_to(1700) == 1600
    assert cache.get([0]) is not None and cache.get([3]) is not None
    assert cache.get([1]) is None and cache.get([2]) is None
    assert cache.clear() == 1600
    assert cache.stats().bytes == 0 and cache.stats().evictions == 4


def test_storing_the_same_prefix_again_replaces_it_without_double_counting_bytes():
    cache = StateCache(budget_bytes=10_000)
    cache.put([1, 2], fake_state(800))
    cache.put([1, 2], fake_state(800))
    assert (cache.stats().entries, cache.stats().bytes) == (1, 800)


def test_a_digest_collision_is_a_miss_never_another_prefixs_state(monkeypatch):
    import semif_serve.engine.state_cache as module

    cache = StateCache(budget_bytes=10_000)
    monkeypatch.setattr(module, "prefix_digest", lambda ids: "same")
    cache.put([1, 2, 3], fake_state(80))
    assert cache.get([4, 5, 6]) is None
    assert cache.get([1, 2, 3]) is not None


def test_the_digest_depends_on_every_id_and_the_length():
    assert prefix_digest([1, 2, 3]) != prefix_digest([1, 2, 4])
    assert prefix_digest([0]) != prefix_digest([0, 0])
    assert prefix_digest((1, 2)) == prefix_digest([1, 2])


def test_a_states_bytes_match_the_memory_estimates_geometry(engine, model):
    for n in (1, 17, 90):
        ids = token_ids(n, 20 + n)
        expected = engine.estimate.cache_per_token * n + engine.estimate.state_per_row
        assert StoredState(ids, prefill(model, ids)).nbytes == expected
