"""The output head reads only the token ids asked for, and equals the whole projection there."""

from __future__ import annotations

import torch

from semif_serve.engine.forwards import head_logits, logits_over

TOL = 1e-5
SLOTS = [32, 33, 34, 35, 1000, 5]


def whole_prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """The independent reference: transformers' own forward of the prompt, every logit."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].float()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 200, (n,), generator=g).tolist()


def test_right_padded_rows_at_the_slots_equal_each_rows_whole_forward(engine):
    rows = [prompt(9, 2), prompt(17, 3), prompt(4, 4)]
    got = logits_over(engine.model, None, 0, rows, engine.pad_id, columns=SLOTS)
    assert got.shape == (3, len(SLOTS))
    for row, ids in zip(got, rows, strict=True):
        assert (row - whole_prompt_logits(engine.model, ids)[SLOTS]).abs().max().item() <= TOL


def test_a_head_changed_by_a_hook_still_applies_the_change_at_the_slots(engine):
    head = engine.model.get_output_embeddings()
    hidden = torch.randn(2, head.in_features)
    plain = head_logits(engine.model, hidden, SLOTS)

    def shifted(module, args, output):  # how an adapter on the head changes its output
        return output + torch.arange(output.shape[-1], dtype=output.dtype)

    hook = head.register_forward_hook(shifted)
    try:
        with torch.inference_mode():
            got = head_logits(engine.model, hidden, SLOTS)
    finally:
        hook.remove()
    assert (got - plain - torch.tensor(SLOTS, dtype=torch.float32)).abs().max().item() <= 1e-3
