"""The engine's CPU linear-attention kernels give transformers' reference results: the kernels
on their own against transformers' functions, and a model loaded by the production loader
against a fresh transformers model (plain forwards, a prefill continued by suffix rows)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5

from semif_serve.engine import linear_attention_cpu
from semif_serve.engine.loader import load_model
from semif_serve.service.startup import checkpoint_spec
from tests.support import make_settings


def _reference(name: str):
    current = getattr(modeling_qwen3_5, name)
    return getattr(current, "__semif_reference__", current)


# (batch, tokens, with a starting state, dtype, decay scale): tails shorter than a chunk, exact
# chunks, several chunks and a tail, a lone token; mild decays and ones far under exp(-87).
SHAPES = [
    (1, 77, False, torch.float32, 0.05),
    (2, 200, True, torch.float32, 0.05),
    (3, 34, True, torch.float32, 17.0),
    (1, 128, False, torch.float32, 17.0),
    (1, 1, True, torch.float32, 0.05),
    (2, 150, True, torch.bfloat16, 0.05),
]


@pytest.mark.parametrize(("batch", "tokens", "started", "dtype", "decay"), SHAPES)
def test_the_gated_delta_rule_equals_transformers_reference(batch, tokens, started, dtype, decay) -> None:
    generator = torch.Generator().manual_seed(tokens)
    heads, dim = 4, 32

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = (draw(batch, tokens, heads, dim).to(dtype) for _ in range(3))
    g = -torch.rand(batch, tokens, heads, generator=generator) * decay
    beta = torch.rand(batch, tokens, heads, generator=generator).to(dtype)
    state = draw(batch, heads, dim, dim) if started else None
    options = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected, expected_state = _reference("torch_chunk_gated_delta_rule")(q, k, v, **options)
    got, got_state = linear_attention_cpu.gated_delta_rule(q, k, v, **options)
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    # A bfloat16 output may round to the neighbouring value: one bfloat16 step, at most 2**-7 of it.
    rtol = 2**-7 if dtype == torch.bfloat16 else 0
    assert torch.allclose(got.float(), expected.float(), atol=1e-5, rtol=rtol)
    assert torch.allclose(got_state, expected_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("tokens", "dtype"), [(1, torch.float32), (3, torch.float32), (90, torch.float32), (90, torch.bfloat16)]
)
def test_the_causal_convolution_equals_transformers_reference(tokens, dtype) -> None:
    generator = torch.Generator().manual_seed(tokens)
    projected = torch.randn(2, tokens, 48, generator=generator).to(dtype)  # as the projection writes it
    weight = torch.randn(48, 4, generator=generator).to(dtype)
    channels_first = projected.transpose(1, 2)
    expected = _reference("causal_conv1d_fn")(channels_first, weight, None, activation="silu")
    got = linear_attention_cpu.causal_conv1d(channels_first, weight, None, activation="silu")
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.allclose(
        got.float(), expected.float(), atol=1e-5, rtol=1e-3 if dtype == torch.bfloat16 else 0
    )


def test_decays_under_exp_minus_50_are_exactly_zero_so_no_product_of_them_is_subnormal() -> None:
    # One head, one key and value dimension: the state after each token is written out by hand.
    logs = [0.0, -1.0, -49.9, -50.5, -87.0, -1000.0]
    ones = torch.ones(1, len(logs), 1, 1)
    g = torch.tensor(logs).view(1, -1, 1)
    beta = torch.zeros(1, len(logs), 1)  # no writes: the state only decays
    state = torch.ones(1, 1, 1, 1)
    for n in range(1, len(logs) + 1):
        _, final = linear_attention_cpu.gated_delta_rule(
            ones[:, :n],
            ones[:, :n],
            ones[:, :n],
            g=g[:, :n],
            beta=beta[:, :n],
            initial_state=state,
            output_final_state=True,
        )
        kept = [torch.tensor(x).exp() for x in logs[:n] if x >= -50.0]
        expected = torch.stack(kept).prod() if len(kept) == n else torch.tensor(0.0)
        assert torch.allclose(final.view(()), expected, rtol=1e-6, atol=0)
        assert final.view(()) == 0 or final.view(()) > torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("share", [2, 4])
def test_key_heads_shared_by_value_heads_equal_the_reference_given_them_repeated(share) -> None:
    generator = torch.Generator().manual_seed(share)
    batch, tokens, key_heads, dim = 2, 150, 2, 32
    value_heads = key_heads * share
    q, k = (torch.randn(batch, tokens, key_heads, dim, generator=generator) for _ in range(2))
    v = torch.randn(batch, tokens, value_heads, dim, generator=generator)
    g = -torch.rand(batch, tokens, value_heads, generator=generator)
    beta = torch.rand(batch, tokens, value_heads, generator=generator)
    state = torch.randn(batch, value_heads, dim, dim, generator=generator)
    options = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    repeated = (t.repeat_interleave(share, dim=2) for t in (q, k))
    expected, expected_state = _reference("torch_chunk_gated_delta_rule")(*repeated, v, **options)
    got, got_state = linear_attention_cpu.gated_delta_rule(q, k, v, **options)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    assert torch.allclose(got_state, expected_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rule_writes_each_rows_tokens_into_its_packed_rows_rounded_once_and_no_others(dtype) -> None:
    generator = torch.Generator().manual_seed(8)
    lengths, starts, tokens, heads, dim = [40, 5, 17], [0, 45, 60], 40, 4, 32
    q, k, v = (torch.randn(3, tokens, heads, dim, generator=generator) for _ in range(3))
    g = -torch.rand(3, tokens, heads, generator=generator)
    beta = torch.rand(3, tokens, heads, generator=generator)
    state = torch.randn(3, heads, dim, dim, generator=generator)
    options = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, lengths=lengths)
    returned, returned_state = linear_attention_cpu.gated_delta_rule(
        q, k, v, initial_state=state.clone(), **options
    )
    packed = torch.full((80, heads, dim), 7.0, dtype=dtype)
    nothing, written_state = linear_attention_cpu.gated_delta_rule(
        q, k, v, initial_state=state.clone(), into=(packed, starts), **options
    )
    expected = torch.full((80, heads, dim), 7.0, dtype=dtype)
    for row, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        expected[start : start + n] = returned[row, :n].to(dtype)
    assert nothing is None and torch.equal(packed, expected)
    assert torch.equal(written_state, returned_state)


def test_the_rule_writes_only_into_a_contiguous_float32_or_bf16_tensor() -> None:
    q = k = v = torch.randn(1, 3, 2, 8)
    g, beta = -torch.rand(1, 3, 2), torch.rand(1, 3, 2)
    for target in (torch.zeros(3, 2, 8, dtype=torch.float16), torch.zeros(3, 8, 2).transpose(1, 2)):
        with pytest.raises(ValueError, match="contiguous float32 or bf16"):
            linear_attention_cpu.gated_delta_rule(q, k, v, g=g, beta=beta, into=(target, [0]))


def test_each_row_stops_at_its_own_length_with_the_state_at_its_own_end() -> None:
    generator = torch.Generator().manual_seed(7)
    lengths, tokens, heads, dim = [40, 3, 0], 40, 4, 32
    q, k, v = (torch.randn(3, tokens, heads, dim, generator=generator) for _ in range(3))
    g = -torch.rand(3, tokens, heads, generator=generator)
    beta = torch.rand(3, tokens, heads, generator=generator)
    state = torch.randn(3, heads, dim, dim, generator=generator)
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = linear_attention_cpu.gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, lengths=lengths, **options
    )
    reference = _reference("torch_chunk_gated_delta_rule")
    for row, n in enumerate(lengths):
        if n:
            alone = [t[row : row + 1, :n] for t in (q, k, v)]
            expected, expected_state = reference(
                *alone,
                g=g[row : row + 1, :n],
                beta=beta[row : row + 1, :n],
                initial_state=state[row : row + 1],
                **options,
            )
            assert torch.allclose(got[row : row + 1, :n], expected, atol=1e-5, rtol=0)
        else:
            expected_state = state[row : row + 1]
        assert torch.allclose(got_state[row : row + 1], expected_state, atol=1e-5, rtol=0)
        assert torch.equal(got[row, n:], torch.zeros_like(got[row, n:]))


@pytest.fixture(scope="module")
def models(checkpoint):
    loaded = load_model(checkpoint_spec(make_settings(checkpoint)))
    reference = Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return loaded.model, reference


def test_the_loader_runs_the_checkpoint_on_the_own_kernels_and_the_setting_turns_them_off(
    checkpoint, models
) -> None:
    accelerated = models[0].get_decoder()  # the module's model, loaded with the default settings
    reference = load_model(checkpoint_spec(make_settings(checkpoint, cpu_kernels=False))).model.get_decoder()
    assert getattr(accelerated, "__semif_accelerated__", False)
    assert not getattr(reference, "__semif_accelerated__", False)


def test_an_accelerated_model_gives_a_plain_forwards_logits(models) -> None:
    served, reference = models
    ids = torch.randint(0, 2000, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # every position's final state: what the head reads (one vocabulary row each)
        got, expected = (
            served.model(input_ids=ids).last_hidden_state,
            reference.model(input_ids=ids).last_hidden_state,
        )
        last = (
            served(input_ids=ids, logits_to_keep=1).logits,
            reference(input_ids=ids, logits_to_keep=1).logits,
        )
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    assert torch.allclose(*last, atol=1e-5, rtol=0)


def test_a_prefill_continued_by_padded_suffix_rows_gives_the_plain_forwards_logits(models) -> None:
    served, reference = models
    ids = torch.randint(0, 2000, (1, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = DynamicCache(config=served.config)
        served(input_ids=ids[:, :70], past_key_values=cache, use_cache=True)
        rest = served(input_ids=ids[:, 70:], past_key_values=cache, use_cache=True).logits
        expected = reference(input_ids=ids).logits[:, 70:]
    assert torch.allclose(rest, expected, atol=1e-5, rtol=0)


def test_subnormals_are_kept_again_after_an_accelerated_forward(models) -> None:
    served, _ = models
    with torch.no_grad():
        served(input_ids=torch.tensor([[1, 2, 3]]))
    assert (torch.tensor([1e-39]) * 1.0).item() != 0.0


def test_a_forward_that_fails_still_leaves_subnormals_kept_and_the_kernels_switched_back(models) -> None:
    served, _ = models
    with torch.no_grad(), pytest.raises(IndexError):
        served(input_ids=torch.tensor([[10**7]]))  # past the embedding table
    assert (torch.tensor([1e-39]) * 1.0).item() != 0.0
    assert linear_attention_cpu._ACTIVE.get() == 0


def test_a_patch_of_the_decoders_class_forward_still_sees_every_call(models, monkeypatch) -> None:
    served, _ = models
    decoder = served.get_decoder()
    real, seen = type(decoder).forward, []

    def recording(self, *args, **kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(decoder), "forward", recording)
    with torch.no_grad():
        served(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen == [3]


def test_outside_an_accelerated_decoder_the_modeling_code_runs_transformers_kernels(models) -> None:
    served, reference = models
    assert getattr(reference.get_decoder(), "__semif_accelerated__", False) is False
    probe = torch.zeros(1, 8, 3)
    weight = torch.ones(8, 4)
    chosen = modeling_qwen3_5.causal_conv1d_fn
    calls = []
    original = chosen.__semif_reference__

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    chosen_again = linear_attention_cpu._dispatching(counting, linear_attention_cpu.causal_conv1d)
    chosen_again(probe, weight)
    assert calls == [1]


def test_the_rule_gives_the_same_bits_whatever_the_inputs_strides_threads_and_neighbours() -> None:
    # The same request answered twice must read the same: its rows may arrive as views or copies,
    # beside other rows, on one thread or two.
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 100, 2, 32, generator=generator) for _ in range(2))
    v = torch.randn(2, 100, 4, 32, generator=generator)
    g = -torch.rand(2, 100, 4, generator=generator) * 5
    beta = torch.rand(2, 100, 4, generator=generator)
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    whole, _ = linear_attention_cpu.gated_delta_rule(q, k, v, g=g, beta=beta, **options)
    half = [t[:, :50] for t in (q, k, v, g, beta)]  # views with the whole run's strides
    viewed, _ = linear_attention_cpu.gated_delta_rule(*half[:3], g=half[3], beta=half[4], **options)
    copied, _ = linear_attention_cpu.gated_delta_rule(
        *(t.contiguous() for t in half[:3]), g=half[3].contiguous(), beta=half[4].contiguous(), **options
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, _ = linear_attention_cpu.gated_delta_rule(
            *(t[1:] for t in (q, k, v)), g=g[1:], beta=beta[1:], **options
        )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(viewed, whole[:, :50]) and torch.equal(copied, whole[:, :50])
    assert torch.equal(alone[0], whole[1])


def test_a_lone_prompts_rule_runs_on_both_of_the_forwards_threads(monkeypatch) -> None:
    # One ~250-token prompt, 8 value heads: its rows go to more than one part, so a second thread
    # takes some (on one thread the rule was a fifth of a lone forward; docs/packing.md).
    from semif_serve.engine import delta_rule_rows

    taken: list[tuple[int, int]] = []
    split = delta_rule_rows.run_split

    def counted(work, items, threads, min_items):
        taken.append((items, min_items))
        return split(work, items, threads, min_items)

    monkeypatch.setattr(delta_rule_rows, "run_split", counted)
    q, k = (torch.randn(1, 242, 4, 64) for _ in range(2))
    v = torch.randn(1, 242, 8, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        linear_attention_cpu.gated_delta_rule(q, k, v, g=-torch.rand(1, 242, 8), beta=torch.rand(1, 242, 8))
    finally:
        torch.set_num_threads(threads)
    [(rows, least)] = taken
    assert rows == 8 and rows // least >= 2


def test_a_run_continued_from_its_stored_state_gives_the_bits_of_one_unbroken_run() -> None:
    # What the state cache relies on: a follow-up read from a kept state equals the whole prompt run.
    generator = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 90, 2, 32, generator=generator) for _ in range(2))
    v = torch.randn(1, 90, 4, 32, generator=generator)
    g = -torch.rand(1, 90, 4, generator=generator)
    beta = torch.rand(1, 90, 4, generator=generator)
    rule = linear_attention_cpu.gated_delta_rule
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    whole, whole_state = rule(q, k, v, g=g, beta=beta, **options)
    for cut in (1, 37, 64):
        first, kept = rule(q[:, :cut], k[:, :cut], v[:, :cut], g=g[:, :cut], beta=beta[:, :cut], **options)
        rest, state = rule(
            q[:, cut:],
            k[:, cut:],
            v[:, cut:],
            g=g[:, cut:],
            beta=beta[:, cut:],
            initial_state=kept,
            **options,
        )
        assert torch.equal(torch.cat([first, rest], dim=1), whole) and torch.equal(state, whole_state)


def _rule_in_child(queue) -> None:
    # numpy in and out, two parts: one on a worker thread (no torch op, whose OpenMP a fork may hang)
    import numpy as np

    from semif_serve.engine.delta_rule_rows import recurrence

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 600, 4, 32), dtype=np.float32) for _ in range(3))
    g, beta = -rng.random((2, 600, 4), dtype=np.float32), rng.random((2, 600, 4), dtype=np.float32)
    state = np.zeros((2, 4, 32, 32), dtype=np.float32)
    out = recurrence(q, k, v, g, beta, np.array([600, 600]), state, threads=2, normed=True)
    queue.put(float(out.sum()))


def test_a_process_forked_after_the_rule_ran_runs_it_on_workers_of_its_own() -> None:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    _rule_in_child(queue)  # the parent's worker threads exist now
    expected = queue.get(timeout=60)
    child = context.Process(target=_rule_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == expected  # a child that waited on the parent's threads hangs
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_the_bf16_convolution_rounds_its_float32_sum_to_nearest_even_as_torch_does_and_keeps_nan() -> None:
    # Taps (0, 0, 1, 1): each output is x[t] + x[t-1], exact in float32, then rounded once; the
    # sums at t = 1, 2, 3, 5 lie halfway between two bf16 values.
    ones = [1.0, 2**-8, 1 + 2**-7, 2**-8, -1.0, -(2**-8), 3.0, 2**-7]
    nan = [0.5, float("nan"), 0.25, 0.0, 1.0, 1.0, 1.0, 1.0]
    x = torch.tensor([ones, nan]).to(torch.bfloat16)[None]  # [batch, channels, tokens]
    weight = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2).to(torch.bfloat16)
    got = linear_attention_cpu.causal_conv1d(x, weight, None, activation=None)
    exact = x[0, 0].double()
    sums = torch.cat([exact[:1], exact[1:] + exact[:-1]])  # exact in float64 and in float32
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[0, 0], sums.float().to(torch.bfloat16))
    assert torch.equal(got[0, 0, 1:4], torch.tensor([1.0, 1 + 2**-6, 1 + 2**-6]).to(torch.bfloat16))
    # A NaN reaches every output whose window holds it (times a zero tap too), as IEEE has it.
    assert torch.isnan(got[0, 1, 1:5]).all() and not torch.isnan(got[0, 1, [0, 5, 6, 7]]).any()
