"""lev's answers computed two ways for the tests: as lev's own server computes them (one full
forward per row, the candidates as one padded batch), and through the serving engine's own
pieces run synchronously (`lev_rows`, `lev_jobs`, `TorchEngine.read_prepared`, `lev_answers`),
so a test holds both to PEFT's forward and to each other without a worker or an event loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from semif_serve.domain.lev.prompt import candidate_texts
from semif_serve.domain.lev.readout import plan_request, read_plan
from semif_serve.domain.lev.types import LevQuestion
from semif_serve.engine.lev_head import CANDIDATE_MAX_TOKENS
from semif_serve.service.lev_core import LevEncoder, LevReply, lev_answers, lev_jobs, lev_rows


def lev_per_row(release: Any, model: Any, bank: Any, state: Any, questions: Mapping[str, LevQuestion]) -> Any:
    """lev's server's computation: the prefix encoded with special tokens, each suffix without,
    joined; one full forward per row with the release's adapter (`bank` rows of its model); the
    label logits at the last token, or the head over it and the candidates' last real tokens."""
    plan = plan_request(state, questions, release.codes, release.options, has_head=release.head is not None)
    tokenizer = release.tokenizer
    prefix_ids = tokenizer.encode(plan.prefix, add_special_tokens=True)
    suffixes = [tokenizer.encode(row.suffix, add_special_tokens=False) for row in plan.rows]
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    scores: list[list[float]] = []
    shown_tokens = 0  # semif-serve counts each candidate, a row of its own, where lev counts none
    with torch.no_grad(), bank.rows(release.adapter):
        candidates = {}
        for qid, question in plan.questions.items():
            if plan.routes[qid].mode != "B":
                continue
            encoded = tokenizer(
                list(candidate_texts(question)),
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=CANDIDATE_MAX_TOKENS,
                add_special_tokens=False,
            )
            hidden = decoder(**encoded, use_cache=False).last_hidden_state
            shown_tokens += int(encoded["attention_mask"].sum())
            last = encoded["attention_mask"].sum(dim=1).long() - 1
            candidates[qid] = hidden[torch.arange(hidden.size(0)), last]
        for row, suffix_ids in zip(plan.rows, suffixes, strict=True):
            last = decoder(
                input_ids=torch.tensor([prefix_ids + suffix_ids]), use_cache=False
            ).last_hidden_state[0, -1]
            if row.label_ids is not None:
                scores.append(lm_head(last.unsqueeze(0))[0][list(row.label_ids)].float().tolist())
            else:
                shown = candidates[row.question_id].float().unsqueeze(0)
                scores.append(release.head(last.float().unsqueeze(0), shown)[0].float().tolist())
    answers = read_plan(plan, scores, release.calibration)
    tokens = len(prefix_ids) + sum(len(s) for s in suffixes) + shown_tokens
    return LevReply(answers, tokens, len(prefix_ids), None)  # type: ignore[arg-type]


def lev_on_engine(release: Any, engine: Any, state: Any, questions: Mapping[str, LevQuestion]) -> LevReply:
    """The serving path's answers, its jobs read one after another on this thread."""
    rows = lev_rows(release, LevEncoder(release.tokenizer), state, questions, None)
    readouts = [engine.read_prepared(job()) for job in lev_jobs(rows, engine, release.adapter)]
    return lev_answers(release, rows, readouts)
