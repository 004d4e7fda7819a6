"""lev's candidate head (Mode B), read from a release and applied to hidden states the batcher read.

A Mode B question is read from the last hidden state of its rows and the last hidden states of
its candidate strings, both rows of the one batcher (`TorchEngine.prepare_ids` with `hidden`):
the head (`mode_b_head.pt`) then scores each candidate over them (`head_scores`), the way lev's
`readout/mode_b.py` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from semif_serve.domain.lev.types import LevReleaseError

HEAD_HEADS = 8  # lev's head has 8 attention heads; the file does not store it (readout/mode_b.py)
CANDIDATE_MAX_TOKENS = 64  # lev truncates each Mode B candidate to 64 tokens (model.py)


def _head_class() -> Any:
    import torch
    from torch import nn

    class LevHead(nn.Module):
        """lev's candidate head: projections, set attention over the candidates, norm, score."""

        def __init__(self, hidden_size: int, proj_dim: int) -> None:
            super().__init__()
            self.question_proj = nn.Linear(hidden_size, proj_dim, bias=False)
            self.candidate_proj = nn.Linear(hidden_size, proj_dim, bias=False)
            self.set_attention = nn.MultiheadAttention(proj_dim, HEAD_HEADS, batch_first=True, dropout=0.0)
            self.norm = nn.LayerNorm(proj_dim)
            self.score = nn.Linear(proj_dim, 1, bias=False)

        def forward(self, question: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
            """Scores (B, K) from a question state (B, H) and candidate states (B, K, H)."""
            q = self.question_proj(question).unsqueeze(1)
            c = self.candidate_proj(candidates)
            attended, _ = self.set_attention(c, c, c)
            return self.score(self.norm(attended + q)).squeeze(-1)

    return LevHead


def load_head(path: Path, hidden_size: int, device: Any = "cpu") -> Any:
    """lev's head from `path` in float32 on `device`, every key and shape checked against the
    head lev builds for `hidden_size` (LevReleaseError naming the file and key otherwise)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise LevReleaseError(str(path), None, f"is not a readable torch state dict ({exc})") from None
    if not isinstance(state, dict):
        raise LevReleaseError(str(path), None, "must hold a state dict")
    proj = state.get("question_proj.weight")
    if proj is None or getattr(proj, "ndim", 0) != 2:
        raise LevReleaseError(str(path), "question_proj.weight", "missing or not a matrix")
    proj_dim, width = (int(d) for d in proj.shape)
    if width != hidden_size:
        raise LevReleaseError(
            str(path), "question_proj.weight", f"reads hidden size {width}; the base's is {hidden_size}"
        )
    if proj_dim % HEAD_HEADS:
        raise LevReleaseError(
            str(path),
            "question_proj.weight",
            f"projection {proj_dim} is not divisible by lev's {HEAD_HEADS} heads",
        )
    head = _head_class()(hidden_size, proj_dim)
    expected = head.state_dict()
    for key in state:
        if key not in expected:
            raise LevReleaseError(str(path), key, "is not a parameter of lev's candidate head")
    for key, tensor in expected.items():
        got = state.get(key)
        if got is None:
            raise LevReleaseError(str(path), key, "missing")
        if tuple(got.shape) != tuple(tensor.shape):
            raise LevReleaseError(str(path), key, f"shape {tuple(got.shape)}, needs {tuple(tensor.shape)}")
        if not bool(got.isfinite().all()):
            raise LevReleaseError(str(path), key, "holds a non-finite value")
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=torch.float32).eval()


def candidate_ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each candidate string's ids as lev encodes them for its head: no special tokens, cut at
    64 tokens (lev pads them into one batch and reads each at its last real token, which a
    right-padded row of its own equals)."""
    encoded = tokenizer(
        list(texts), add_special_tokens=False, truncation=True, max_length=CANDIDATE_MAX_TOKENS
    )
    return [list(ids) for ids in encoded["input_ids"]]


def head_scores(head: Any, question: Any, candidates: Any) -> list[float]:
    """The head's score of every candidate: `question` the row's last hidden state (H,),
    `candidates` the candidates' last hidden states (K, H), both read by the engine."""
    import torch

    with torch.inference_mode():
        device = next(head.parameters()).device
        q = question.to(device=device, dtype=torch.float32).unsqueeze(0)
        c = candidates.to(device=device, dtype=torch.float32).unsqueeze(0)
        return head(q, c)[0].float().tolist()
