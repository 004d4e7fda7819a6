"""Every forward the engine runs, in one place: a prefill (in chunks) into a cache, suffix rows
right-padded over a cache, rows that hold image tokens (embeddings and 3-D positions), SemIf's
plain forward of one whole prompt, and the readout of the answer slots.

Each returns float32 logits only at the positions read (the last real one of each row), so
only those hidden states go through the vocabulary projection; given the token ids read (the
answer slots, lev's label codes), only those rows of the projection are computed, never the
vocabulary (on a CPU the whole projection is a read of the head's every weight per forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from semif_serve.engine.state_cache import StoredState


class RowImages(Protocol):
    """What a forward over rows with image tokens needs (engine.vision.ImageSet provides it)."""

    def positions(self, ids: Sequence[int]) -> Any:
        """The 3-D rotary positions `[3, len(ids)]` of a row from position 0."""
        ...

    def embeddings(self, embed: Any, ids: Sequence[int], start: int, stop: int) -> Any:
        """The input embeddings `[stop - start, hidden]` of `ids[start:stop]`."""
        ...


def prefill(
    model: Any,
    ids: Sequence[int],
    start: StoredState | None = None,
    chunk_tokens: int | None = None,
    images: RowImages | None = None,
):
    """The one-row cache after `ids`, continuing from `start` (a state over a prefix of `ids`)
    and feeding the remaining tokens in chunks of at most `chunk_tokens` (bounds activation
    memory on long states; None: one chunk). Returns a fresh cache, ready for `StateCache.put`.

    `ids` holding image tokens need `images`: those chunks are fed as embeddings (the images'
    features in place) at the model's 3-D positions; a chunk may split an image."""
    import torch
    from transformers import DynamicCache

    decoder = model.get_decoder()
    device = next(decoder.parameters()).device
    done = 0
    if start is not None:
        if tuple(ids[: len(start)]) != start.ids:
            raise ValueError("start is not a state over a prefix of ids")
        done = len(start)
        cache = start.fork(1)
    else:
        cache = DynamicCache(config=decoder.config)
    if done == len(ids):
        return cache
    step = chunk_tokens or len(ids)
    if step < 1:
        raise ValueError("chunk_tokens must be >= 1")
    multimodal = images is not None and any(t < 0 for t in ids)
    rows = list(ids) if multimodal else ids
    axes = images.positions(rows) if images is not None and multimodal else None
    with torch.inference_mode():
        while done < len(ids):
            stop = min(len(ids), done + step)
            if images is not None and axes is not None:
                feed = {
                    "inputs_embeds": images.embeddings(model.get_input_embeddings(), rows, done, stop)[None],
                    "position_ids": axes[:, None, done:stop].to(device),
                }
            else:
                feed = {
                    "input_ids": torch.tensor([list(ids[done:stop])], device=device),
                    "position_ids": torch.arange(done, stop, device=device)[None],
                }
            decoder(**feed, past_key_values=cache, use_cache=True)
            done = stop
    return cache


def padded_suffixes(suffixes: Sequence[Sequence[int]], n_prefix: int, pad_id: int) -> tuple[Any, Any]:
    """Suffix rows right-padded to the widest, and the attention mask over prefix + suffix."""
    import torch

    width = max(len(s) for s in suffixes)
    input_ids = torch.full((len(suffixes), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(suffixes), n_prefix + width), dtype=torch.long)
    mask[:, :n_prefix] = 1
    for i, suffix in enumerate(suffixes):
        input_ids[i, : len(suffix)] = torch.tensor(list(suffix), dtype=torch.long)
        mask[i, n_prefix : n_prefix + len(suffix)] = 1
    return input_ids, mask


def suffix_logits(
    model: Any,
    state: StoredState | None,
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    chunk_tokens: int | None = None,
):
    """Float32 full-vocabulary logits `[rows, vocab]` at each row's last real position, running
    every suffix over `state` (None: no prefix) in one right-padded forward (or, past
    `chunk_tokens`, in column chunks: see `logits_over`)."""
    import torch

    with torch.inference_mode():
        cache = state.fork(len(suffixes)) if state is not None else None
        n_prefix = len(state) if state is not None else 0
        return logits_over(model, cache, n_prefix, suffixes, pad_id, chunk_tokens)


def logits_over(
    model: Any,
    cache: Any,
    n_prefix: int,
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    chunk_tokens: int | None = None,
    images: RowImages | None = None,
    prefix: Sequence[int] = (),
    hidden_out: bool = False,
    columns: Any | None = None,
):
    """`suffix_logits` over an already forked cache of `n_prefix` tokens (None: no prefix), which
    the forward consumes: attention mask over prefix + suffix, explicit positions, only the read
    positions through the vocabulary head.

    Suffixes wider than `chunk_tokens` (None: never) run `chunk_tokens` columns per forward
    over the growing cache, like a chunked prefill, so a long question's activations are
    bounded like a long state's; each row is read in the chunk that holds its last position.

    Where the `prefix` (its ids) or a suffix holds image tokens, `images` gives the rows'
    embeddings and 3-D positions (`image_rows`). `hidden_out`: the last hidden states themselves
    (`[rows, hidden]`, the decoder's dtype), not their logits. `columns` (token ids): only those
    logits, `[rows, len(columns)]` (`head_logits`).
    """
    import torch

    decoder = model.get_decoder()
    device = next(decoder.parameters()).device
    lengths = [len(s) for s in suffixes]
    if not suffixes or min(lengths) < 1:
        raise ValueError("every row needs at least one suffix token")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    width = max(lengths)
    input_ids, mask = padded_suffixes(suffixes, n_prefix, pad_id)
    embeds = None
    if images is not None and any(t < 0 for row in (prefix, *suffixes) for t in row):
        embeds, positions = image_rows(model, images, prefix, suffixes, pad_id, width)
    else:
        positions = (torch.arange(width, dtype=torch.long) + n_prefix).expand(len(suffixes), width)
    last = [n - 1 for n in lengths]
    step = min(width, chunk_tokens or width)
    with torch.inference_mode():
        if step < width and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=decoder.config)
        reads: list[Any] = [None] * len(suffixes)
        for start in range(0, width, step):
            stop = min(width, start + step)
            feed = (
                {"inputs_embeds": embeds[:, start:stop]}
                if embeds is not None
                else {"input_ids": input_ids[:, start:stop].to(device)}
            )
            hidden = decoder(
                **feed,
                attention_mask=mask[:, : n_prefix + stop].to(device),
                position_ids=positions[..., start:stop].to(device),
                past_key_values=cache,
                use_cache=cache is not None,
            ).last_hidden_state
            for i, at in enumerate(last):
                if start <= at < stop:
                    reads[i] = hidden[i, at - start]
            del hidden
        if hidden_out:
            return torch.stack(reads)
        return head_logits(model, torch.stack(reads), columns)


def head_logits(model: Any, hidden: Any, columns: Any | None = None) -> Any:
    """Float32 logits `[rows, len(columns)]` of hidden states `[rows, hidden]` at the token ids
    `columns` (None: the whole vocabulary): the output head's rows for those ids alone, equal to
    the whole projection's columns. A head an adapter hooks (or that is no plain Linear) runs
    whole, then is indexed, so its adapter still applies."""
    import torch

    head = model.get_output_embeddings()
    if columns is None:
        return head(hidden).float()
    index = torch.as_tensor(columns, dtype=torch.long, device=hidden.device)
    if type(head) is not torch.nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return head(hidden)[:, index].float()
    bias = head.bias[index] if head.bias is not None else None
    return torch.nn.functional.linear(hidden, head.weight[index], bias).float()


def image_rows(
    model: Any,
    images: RowImages,
    prefix: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    width: int,
) -> tuple[Any, Any]:
    """Suffix rows after `prefix` as embeddings `[rows, width, hidden]` (right-padded with the
    pad token's) and 3-D positions `[3, rows, width]`: a text-only suffix continues one past
    the prefix's highest position; a suffix with its own images is placed over the whole row."""
    import torch

    embed = model.get_input_embeddings()
    n = len(prefix)
    after = int(images.positions(list(prefix)).max()) + 1 if n else 0
    with torch.inference_mode():
        embeds = embed(torch.full((len(suffixes), width), pad_id, device=embed.weight.device))
        positions = torch.zeros((3, len(suffixes), width), dtype=torch.long)
        for i, suffix in enumerate(suffixes):
            if any(t < 0 for t in suffix):
                row = [*prefix, *suffix]
                embeds[i, : len(suffix)] = images.embeddings(embed, row, n, len(row))
                positions[:, i, : len(suffix)] = images.positions(row)[:, n:]
                tail = int(positions[:, i, : len(suffix)].max()) + 1
            else:
                embeds[i, : len(suffix)] = embed(torch.tensor(list(suffix), device=embed.weight.device))
                positions[:, i, : len(suffix)] = torch.arange(after, after + len(suffix))
                tail = after + len(suffix)
            positions[:, i, len(suffix) :] = torch.arange(tail, tail + width - len(suffix))
    return embeds, positions


def read_slots(slot_logits: Any, n_options: int) -> tuple[list[float], list[float]]:
    """One position's answer-slot logits (`head_logits` at the slots) -> (the first `n_options`
    slots' logits in float32, their softmax)."""
    import torch

    option = slot_logits[:n_options].float()
    return option.tolist(), torch.softmax(option, dim=-1).tolist()
