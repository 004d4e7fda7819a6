"""Forward lanes (engine/lanes.py) against independent computations: a forward split into shares
that run at once, each on a thread of its own, answers every row as one plain forward of its whole
sequence alone (transformers' own classes, loaded fresh) and a PEFT adapter's rows as PEFT's own
forward, keeps each state as transformers' own prefill of its tokens, and splits only where it pays;
a sequence split across the lanes (its head handing its state to its tail layer by layer) answers
and keeps its state as one plain forward of it, and a failing lane on either side never hangs the other."""

from __future__ import annotations

import threading

import pytest
import torch

from semif_serve.domain.requests import BASE
from semif_serve.engine import lanes as lanes_module
from semif_serve.engine.forwards import head_logits
from semif_serve.engine.lanes import HANDOVER_AT, MOST_SHARE, ForwardLanes, lone_split_tokens, shares
from semif_serve.engine.packed import Handover, HandoverFailed, Segment
from semif_serve.engine.state_cache import StoredState
from tests.engine.test_packed import COLUMNS, TOLERANCE, alone, ids, packed_logits, stored
from tests.support.peft_oracle import fresh_base, peft_last, peft_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    return fresh_base(checkpoint)


@pytest.fixture
def two_threads():
    """The engine thread's intra-op threads at two (what a 2-core machine's forwards get)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lanes():
    running = ForwardLanes(2)
    yield running
    running.close()


def segment(n: int, **fields) -> Segment:
    return Segment(tuple(range(1000, 1000 + n)), **fields)


def origins(segments: list[Segment], lanes: int) -> list[list[int | None]] | None:
    split = shares(segments, lanes)
    return None if split is None else [share.origins for share in split]


def tokens(share) -> int:
    return sum(len(s.ids) for s in share.segments)


def test_a_forward_splits_into_whole_chains_balanced_by_tokens(reference):
    state = stored(reference, ids(50, 20))
    segments = [
        segment(300, keep=True),  # a new state ...
        segment(10, parent=0, read=True),  # ... and its rows
        segment(20, parent=0, read=True),
        segment(250, read=True),  # a new sequence alone
        segment(120, start=state, read=True),  # two rows over one stored state: each a chain
        segment(100, start=state, read=True),
    ]
    assert origins(segments, 2) == [[0, 1, 2, 5], [3, 4]]  # 430 tokens against 370: close enough
    assert origins(segments, 3) == [[0, 1, 2], [3], [4, 5]]
    heavier_second = [segment(300, read=True), segment(160, read=True), segment(160, read=True)]
    assert origins(heavier_second, 2) == [[1, 2], [0]]  # the heaviest share first: the engine thread's


def test_shares_far_apart_hand_the_tail_of_the_heavier_ones_longest_sequence_to_the_lighter():
    split = shares([segment(300, read=True), segment(250, read=True), segment(200, read=True)], 2)
    assert split is not None and [share.origins for share in split] == [[None, 2], [0, 1]]
    head, tail = split[0].segments[0], split[1].segments[1]
    assert head.ids == tuple(range(1000, 1175)) and not head.read and not head.keep
    assert tail.ids == tuple(range(1175, 1250)) and tail.read and tail.start is head.hand_to
    assert head.hand_to is not None and head.hand_to.ids == head.ids and split[0].handovers == [head.hand_to]
    assert tokens(split[0]) == tokens(split[1]) == 375


def test_a_handed_over_tail_takes_the_rows_continuing_its_sequence_with_it():
    state = segment(400, keep=True)
    split = shares([state, segment(20, parent=0, read=True), segment(200, read=True)], 2)
    assert split is not None and [share.origins for share in split] == [[None], [2, 0, 1]]
    _, tail, row = split[1].segments
    assert tail.keep and len(tail.ids) == 90 and tail.start is split[0].segments[0].hand_to
    assert row.parent == 1  # renumbered onto the tail
    assert tokens(split[0]) == tokens(split[1]) == 310


def unsplittable(n: int) -> list[Segment]:
    """A chain of n tokens no handover can halve: a short state and its long row."""
    short = lanes_module.MIN_PART_TOKENS
    return [segment(short, keep=True), segment(n - short, parent=0, read=True)]


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda: [segment(100, read=True), segment(200, read=True)], "shares under the minimum even halved"),
        (
            lambda: [*unsplittable(700), segment(300, read=True)],
            "one share over the most, no sequence to hand",
        ),
        (lambda: [segment(2000, read=True)], "one chain"),
        (
            lambda: [segment(1000, read=True), segment(10, read=True)],
            "the lighter share has too little of its own",
        ),
    ],
)
def test_a_forward_that_would_not_gain_from_lanes_is_not_split(build, why):
    assert shares(build(), 2) is None, why
    assert shares([segment(400, read=True), segment(400, read=True)], 1) is None  # one lane: whole


def test_a_lone_chain_from_the_threshold_splits_its_sequence_the_head_keeping_the_balance_of_its_layers():
    state, row = segment(580, keep=True), segment(20, parent=0, read=True)
    split = shares([state, row], 2, lone_at=600, layers=8)
    # 8 layers: the head 8/15 of the chain's 600 tokens, the tail a layer behind ends with it
    assert split is not None and [share.origins for share in split] == [[None], [0, 1]]
    (head,), (tail, moved) = split[0].segments, split[1].segments
    assert len(head.ids) == 320 and not head.keep and not head.read and head.hand_to is tail.start
    assert tail.keep and tail.ids == state.ids[320:] and moved.parent == 0 and moved.read
    assert shares([state, row], 2, lone_at=601, layers=8) is None  # under the threshold: whole
    assert shares(unsplittable(900), 2, lone_at=600, layers=8) is None  # no sequence to hand
    assert shares([state, row], 1, lone_at=600, layers=8) is None  # one lane


def test_the_threshold_for_a_lone_chain_is_lower_in_bf16_where_the_split_gains_sooner():
    assert lone_split_tokens(torch.bfloat16) < lone_split_tokens(torch.float32)


def test_a_lone_request_past_the_threshold_runs_in_two_lanes_answering_and_keeping_its_state_as_alone(
    over_a_past, two_threads, lanes
):
    engine, reference, before, start = over_a_past
    state, row = ids(lone_split_tokens(engine.model.dtype), 95), ids(20, 96)
    segments = [Segment(tuple(state), start=start, keep=True), Segment(tuple(row), parent=0, read=True)]
    packed = lanes.forward(engine.model, segments)
    assert packed.lanes == 2 and lanes.split_forwards == 1
    want = alone(reference, before + state + row)
    assert torch.allclose(packed_logits(engine, packed, 1), want, atol=TOLERANCE, rtol=0)
    kept, own = StoredState(before + state, packed.caches[0]), stored(reference, before + state)
    for layer in range(len(engine.model.get_decoder().layers)):
        for got, want in zip(kept.layer_state(layer), own.layer_state(layer), strict=True):
            assert torch.allclose(got.float(), want.float(), atol=TOLERANCE), layer
    short = [Segment(tuple(ids(lone_split_tokens(engine.model.dtype) - 21, 97)), read=True)]
    assert lanes.forward(engine.model, short).lanes == 1 and lanes.split_forwards == 1


def test_a_share_may_take_up_to_the_most_a_lane_takes():
    most = int(1000 * MOST_SHARE)
    assert origins([*unsplittable(most), segment(1000 - most, read=True)], 2) == [[0, 1], [2]]


def test_shares_closer_than_the_handover_threshold_keep_their_chains_whole():
    assert origins([segment(400, read=True), segment(400 - HANDOVER_AT + 1, read=True)], 2) == [[0], [1]]


def test_a_handed_over_state_is_waited_for_layer_by_layer_and_a_failure_wakes_every_waiter():
    handover = Handover((1, 2, 3))
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(handover.layer_state(1)))
    waiting.start()
    handover.publish(0, ("conv", "state"))
    handover.publish(1, ("keys", "values"))
    waiting.join(10)
    assert not waiting.is_alive() and got == [("keys", "values")] and len(handover) == 3
    handover.fail(RuntimeError("the producer failed"))
    assert handover.layer_state(0) == ("conv", "state")  # what was published stays readable
    with pytest.raises(HandoverFailed, match="no layer 2"):
        handover.layer_state(2)


def test_a_split_forward_runs_its_shares_at_once_on_two_threads_and_every_row_equals_its_plain_forward(
    engine, reference, two_threads, lanes
):
    new_state, old_state = ids(300, 21), ids(90, 22)
    rows = [ids(n, 30 + n) for n in (7, 33)]
    cached = stored(reference, old_state)
    segments = [Segment(tuple(new_state), keep=True)]
    segments += [Segment(tuple(r), parent=0, read=True) for r in rows]
    segments += [Segment(tuple(ids(260, 23)), read=True)]
    segments += [Segment(tuple(ids(n, 40 + n)), start=cached, read=True) for n in (100, 110)]
    seen: set[tuple[int, int]] = set()
    norm = engine.model.get_decoder().layers[0].input_layernorm
    handle = norm.register_forward_hook(lambda *_: seen.add((threading.get_ident(), torch.get_num_threads())))
    try:
        packed = lanes.forward(engine.model, segments)
    finally:
        handle.remove()
    assert packed.lanes == 2 and lanes.split_forwards == 1
    assert len(seen) == 2 and {count for _, count in seen} == {1}  # two threads, one intra-op thread each
    assert torch.get_num_threads() == 2  # the engine thread's own count is back
    for n, row in enumerate(rows):
        want = alone(reference, new_state + row)
        assert torch.allclose(packed_logits(engine, packed, 1 + n), want, atol=TOLERANCE, rtol=0)
    assert torch.allclose(packed_logits(engine, packed, 3), alone(reference, segments[3].ids), atol=TOLERANCE)
    for at in (4, 5):
        want = alone(reference, old_state + list(segments[at].ids))
        assert torch.allclose(packed_logits(engine, packed, at), want, atol=TOLERANCE, rtol=0)
    kept, own = StoredState(new_state, packed.caches[0]), stored(reference, new_state)
    for layer in range(len(engine.model.get_decoder().layers)):
        for got, want in zip(kept.layer_state(layer), own.layer_state(layer), strict=True):
            assert torch.allclose(got.float(), want.float(), atol=TOLERANCE), layer


@pytest.mark.parametrize(
    ("tuned_tokens", "handed_over"),
    [(280, False), (430, True)],
    ids=["whole sequences", "the adapter's sequence handed over between the lanes"],
)
def test_an_adapters_rows_in_one_lane_and_the_bases_in_the_other_equal_peft_and_the_base(
    engine, reference, checkpoint, tmp_path, two_threads, lanes, tuned_tokens, handed_over
):
    from semif_serve.engine.adapters import AdapterBank
    from tests.engine.test_adapters import write_adapter

    targets = ["q_proj", "in_proj_qkv", "in_proj_z", "up_proj", "down_proj"]
    directory = write_adapter(checkpoint, tmp_path / "lora", 11, r=4, lora_alpha=8, target_modules=targets)
    bank = AdapterBank(engine.model)
    try:
        adapter = bank.add("lora", directory)
        tuned, plain = ids(tuned_tokens, 51), ids(260, 52)
        segments = [Segment(tuple(tuned), adapter=adapter, read=True), Segment(tuple(plain), read=True)]
        split = shares(segments, 2)
        assert split is not None and bool(split[0].handovers) == handed_over
        assert split[-1].segments[-1].adapter == (adapter if handed_over else BASE)  # a tail keeps it
        packed = lanes.forward(engine.model, segments, bank)
        with torch.inference_mode(), bank.rows([adapter, BASE]):
            got = head_logits(engine.model, torch.stack([packed.hidden[0], packed.hidden[1]]), COLUMNS)
    finally:
        bank.close()
    assert packed.lanes == 2
    want = peft_last(peft_model(checkpoint, directory), tuned)[0][COLUMNS]
    assert torch.allclose(got[0], want, atol=TOLERANCE)
    assert torch.allclose(got[1], alone(reference, plain), atol=TOLERANCE)


def test_each_thread_selects_its_own_adapter_rows(engine):
    from semif_serve.engine.adapters import AdapterBank

    bank = AdapterBank(engine.model)
    entered, release = threading.Event(), threading.Event()
    selected_elsewhere: list[object] = []

    def other() -> None:
        with bank.rows([BASE, BASE]):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert entered.wait(10)
        selected_elsewhere.append(bank._selection)
        with bank.rows([BASE]):  # another thread's selection is not this one's
            pass
    finally:
        release.set()
        thread.join()
        bank.close()
    assert selected_elsewhere == [None]


@pytest.mark.parametrize("failing", ["the other lane", "the engine thread's lane"])
def test_a_lane_that_fails_fails_its_forward_after_every_lane_is_done_and_the_next_forward_splits(
    engine, two_threads, lanes, failing
):
    from semif_serve.engine.adapters import AdapterBank

    bank = AdapterBank(engine.model)  # no adapter served: a row reading adapter 3 fails its lane
    # The larger share runs on the engine thread, the other on the lane's own.
    broken_length, fine_length = (320, 260) if failing == "the engine thread's lane" else (260, 320)
    broken = Segment(tuple(ids(broken_length, 61)), adapter=3, read=True)
    fine = Segment(tuple(ids(fine_length, 62)), read=True)
    try:
        with pytest.raises(IndexError, match="no adapter 3"):
            lanes.forward(engine.model, [fine, broken], bank)
        assert lanes.split_forwards == 0
        assert torch.get_num_threads() == 2
        packed = lanes.forward(engine.model, [fine, Segment(broken.ids, read=True)], bank)
    finally:
        bank.close()
    assert packed.lanes == 2 and lanes.split_forwards == 1 and sorted(packed.hidden) == [0, 1]


def test_a_forward_with_an_image_runs_whole(engine, two_threads, lanes):
    class NoImage:  # a segment's images: the forward holds one, whatever its tokens
        def positions(self, ids):
            raise AssertionError("no image token here")

        def embeddings(self, embed, ids, start, stop):
            raise AssertionError("no image token here")

    with_image = Segment(tuple(ids(300, 71)), read=True, images=NoImage())
    segments = [with_image, Segment(tuple(ids(300, 72)), read=True)]
    assert shares(segments, 2) is not None
    assert lanes.forward(engine.model, segments).lanes == 1 and lanes.split_forwards == 0


@pytest.mark.parametrize("threads", [1, 4], ids=["one thread", "more threads than lanes"])
def test_a_forward_on_one_thread_or_on_more_threads_than_lanes_runs_whole(engine, lanes, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = lanes.forward(engine.model, [Segment(tuple(ids(300, 80 + n)), read=True) for n in range(2)])
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert packed.lanes == 1 and lanes.split_forwards == 0


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    """An engine and transformers' own model over an 8-layer checkpoint: a full-attention layer
    (the fourth) before the last, so a handed-over tail attends over handed keys mid-decoder."""
    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import CheckpointShape, write_checkpoint
    from tests.support import make_settings

    directory = write_checkpoint(
        tmp_path_factory.mktemp("eight"), CheckpointShape(num_hidden_layers=8), seed=5
    )
    return load_engine(make_settings(directory)), fresh_base(directory)


@pytest.fixture(
    params=[(False, 4), (True, 4), (False, 8), (True, 8)],
    ids=[
        "4 layers-a new state",
        "4 layers-a state over a stored one",
        "8 layers-a new state",
        "8 layers-a state over a stored one",
    ],
)
def over_a_past(request, engine, reference, eight_layers):
    """An engine, transformers' own model beside it (4 layers, or 8 with full attention
    mid-decoder), and what a split sequence continues: nothing, or 60 tokens' stored state."""
    over_stored, depth = request.param
    if depth == 8:
        engine, reference = eight_layers
    before = ids(60, 90) if over_stored else []
    return engine, reference, before, stored(reference, before) if over_stored else None


def test_a_sequence_split_across_the_lanes_answers_and_keeps_its_state_as_one_plain_forward(
    over_a_past, two_threads, lanes
):
    engine, reference, before, start = over_a_past
    state, row, other = ids(420, 91), ids(20, 92), ids(200, 93)
    segments = [Segment(tuple(state), start=start, keep=True), Segment(tuple(row), parent=0, read=True)]
    segments += [Segment(tuple(other), read=True)]
    split = shares(segments, 2)
    assert split is not None and split[0].handovers  # the state's head hands over to its tail
    assert split[0].handovers[0].ids[: len(before)] == tuple(before)
    packed = lanes.forward(engine.model, segments)
    assert packed.lanes == 2 and sorted(packed.hidden) == [1, 2] and sorted(packed.caches) == [0]
    for at, sequence in ((1, before + state + row), (2, other)):
        want = alone(reference, sequence)
        assert torch.allclose(packed_logits(engine, packed, at), want, atol=TOLERANCE, rtol=0), at
    kept, own = StoredState(before + state, packed.caches[0]), stored(reference, before + state)
    for layer in range(len(engine.model.get_decoder().layers)):
        for got, want in zip(kept.layer_state(layer), own.layer_state(layer), strict=True):
            assert got.shape == want.shape, layer
            assert torch.allclose(got.float(), want.float(), atol=TOLERANCE), layer


def test_the_tail_reads_each_layer_of_the_heads_state_while_the_head_is_still_running(
    engine, two_threads, lanes, monkeypatch
):
    read_first_layer = threading.Event()
    real_state = Handover.layer_state

    def layer_state(handover, layer):
        state = real_state(handover, layer)
        if layer == 0:
            read_first_layer.set()
        return state

    monkeypatch.setattr(Handover, "layer_state", layer_state)
    engine_thread = threading.get_ident()
    waited: list[bool] = []

    def before_second_layer(*_):  # the head (the engine thread's share) holds here until the tail read
        if threading.get_ident() == engine_thread and not waited:
            waited.append(read_first_layer.wait(60))

    norm = engine.model.get_decoder().layers[1].input_layernorm
    handle = norm.register_forward_pre_hook(before_second_layer)
    try:
        segments = [Segment(tuple(ids(420, 98)), read=True), Segment(tuple(ids(200, 99)), read=True)]
        assert shares(segments, 2)[0].handovers
        assert lanes.forward(engine.model, segments).lanes == 2
    finally:
        handle.remove()
    assert waited == [True], "the tail could read the head's first layer only after the head went on"


@pytest.mark.parametrize("failing", ["the lane handing its state over", "the lane waiting for it"])
def test_a_failing_lane_on_either_side_of_a_handover_fails_the_forward_and_never_hangs_the_other(
    engine, two_threads, lanes, monkeypatch, failing
):
    real = lanes_module.packed_forward

    def failing_forward(model, segments, adapters=None):
        hands = any(s.hand_to is not None for s in segments)
        if hands == (failing == "the lane handing its state over"):
            raise RuntimeError("this lane failed")
        return real(model, segments, adapters)

    monkeypatch.setattr(lanes_module, "packed_forward", failing_forward)
    segments = [Segment(tuple(ids(420, 94)), read=True), Segment(tuple(ids(200, 95)), read=True)]
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            lanes.forward(engine.model, segments)
        except BaseException as failure:  # noqa: BLE001 - the test reads it below
            outcome.append(failure)

    running = threading.Thread(target=run)
    running.start()
    running.join(120)
    assert not running.is_alive(), "a lane waited for a state its failed neighbour never gave"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "this lane failed" in str(outcome[0]) or isinstance(outcome[0].__cause__, RuntimeError)
    monkeypatch.setattr(lanes_module, "packed_forward", real)
    assert lanes.forward(engine.model, segments).lanes == 2  # the lanes still run
