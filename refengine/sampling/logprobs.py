"""Logprob, rank and candidates of tokens, read from rows of log-probabilities (RULES L2-L6).

Shared by output tokens (the sampler passes the distribution the token was drawn from) and
prompt tokens (``prompt_logprobs``: the model's raw ``log_softmax``). Nothing here changes
which token is sampled; everything returned is a plain Python value.

Definitions (ref, as vLLM):
- ``rank(t) = 1 + #{tokens whose logprob is strictly greater than t's}``: 1-based, the most
  likely token has rank 1, tied tokens share a rank.
- ``top_n`` candidates: the N most likely tokens ordered by (rank, token id); at a tie across
  the N-th place the lower ids are chosen, so the answer is deterministic.
- ``token_ids`` candidates: exactly the requested ids, in the requested order (repeats kept).
- ``all`` candidates: the whole vocabulary ordered by (rank, token id).
A masked token (logprob ``-inf``) keeps ``-inf``; its rank counts the finite tokens above it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refengine.types import CandidateSpec

CandidateTuple = tuple[int, float, int]  # (token_id, logprob, rank); the engine adds the text
LogprobInfo = tuple[float | None, int | None, tuple[CandidateTuple, ...]]

PROMPT_CHUNK_POSITIONS = 256  # prompt positions per log_softmax: bounds the extra memory to 256 x V
_DIRECT_RANK_MAX_IDS = 64  # up to this many token_ids: rank by direct comparison, else by a sort


def _ranked(values: list[float], ids: list[int]) -> tuple[CandidateTuple, ...]:
    """Candidates from values sorted descending, given that every token with a value greater than
    the last one is present: a token's rank is then 1 + the position of its value's first entry."""
    out: list[CandidateTuple] = []
    rank = 0
    for pos, (value, token_id) in enumerate(zip(values, ids, strict=True)):
        if pos == 0 or value != values[pos - 1]:
            rank = pos + 1
        out.append((token_id, value, rank))
    return tuple(out)


def _top_n_candidates(logprobs: torch.Tensor, top_ns: Sequence[int]) -> list[tuple[CandidateTuple, ...]]:
    """``top_n`` candidates of each row, batched: one ``topk`` over all rows; a row whose N-th
    value is tied with tokens past that prefix falls back to an exact scan of the row."""
    vocab_size = logprobs.shape[1]
    ns = [min(max(n, 0), vocab_size) for n in top_ns]
    n_max = max(ns)
    if n_max == 0:
        return [() for _ in ns]
    size = min(n_max + 1, vocab_size)  # one extra entry tells whether the N-th value's ties end inside
    values, ids = torch.topk(logprobs, size, dim=-1)
    last = torch.tensor([max(n, 1) - 1 for n in ns], device=logprobs.device)
    cut = values.gather(1, last[:, None])  # value of each row's N-th most likely token
    complete = ((values[:, -1:] < cut) | (size == vocab_size))[:, 0].tolist()
    out: list[tuple[CandidateTuple, ...]] = []
    for r, (n, row_values, row_ids, threshold) in enumerate(
        zip(ns, values.tolist(), ids.tolist(), cut[:, 0].tolist(), strict=True)
    ):
        if n == 0:
            out.append(())
            continue
        above = sorted((-v, t) for v, t in zip(row_values, row_ids, strict=True) if v > threshold)
        tied = sorted(t for v, t in zip(row_values, row_ids, strict=True) if v == threshold)
        if not complete[r]:  # tokens tied at the N-th value run past the topk prefix
            tied = torch.nonzero(logprobs[r] == threshold)[:, 0].tolist()  # ascending ids
        chosen = [(-nv, t) for nv, t in above] + [(threshold, t) for t in tied[: n - len(above)]]
        out.append(_ranked([v for v, _ in chosen], [t for _, t in chosen]))
    return out


def _all_candidates(logprobs: torch.Tensor) -> list[tuple[CandidateTuple, ...]]:
    """The full vocabulary of each row, ordered by rank then id (a stable descending sort)."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    positions = torch.arange(1, logprobs.shape[1] + 1, device=logprobs.device).expand_as(ids)
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[:, 1:] = values[:, 1:] != values[:, :-1]
    ranks = torch.cummax(torch.where(starts, positions, 0), dim=-1).values
    return [
        tuple(zip(i, v, k, strict=True)) for i, v, k in zip(ids.tolist(), values.tolist(), ranks.tolist(), strict=True)
    ]


def _token_id_candidates(row: torch.Tensor, token_ids: Sequence[int]) -> tuple[CandidateTuple, ...]:
    """Exactly ``token_ids``, in order, each with its logprob and rank in ``row`` ``[V]``."""
    if not token_ids:
        return ()
    vocab_size = row.shape[0]
    if any(t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"candidate token id out of range [0, {vocab_size})")
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=row.device)
    values = row[ids]
    if len(token_ids) <= _DIRECT_RANK_MAX_IDS:
        greater = (row[None, :] > values[:, None]).sum(-1)
    else:
        ascending = torch.sort(row).values
        greater = vocab_size - torch.searchsorted(ascending, values, right=True)
    return tuple(zip(list(token_ids), values.tolist(), (greater + 1).tolist(), strict=True))


def _select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, without the copy when ``rows`` is every row in order."""
    if rows == list(range(t.shape[0])):
        return t
    return t[torch.tensor(rows, device=t.device)]


def batch_logprob_info(
    logprobs: torch.Tensor,
    token_ids: Sequence[int],
    want_logprob: Sequence[bool],
    candidates: Sequence[CandidateSpec | None],
) -> list[LogprobInfo]:
    """Per row of ``logprobs`` ``[n, V]``: ``(logprob, rank, candidates)`` of ``token_ids[i]``.

    ``logprob`` and ``rank`` are ``None`` unless ``want_logprob[i]``; candidates are ``()``
    unless ``candidates[i]`` is set. Rows are processed together where the work allows it
    (one comparison pass for all ranks, one ``topk`` for all ``top_n`` rows, one sort for all
    ``all`` rows).
    """
    n, vocab_size = logprobs.shape
    if not (len(token_ids) == len(want_logprob) == len(candidates) == n):
        raise ValueError("batch_logprob_info: one token/want/candidates entry per row")
    logprob_out: list[float | None] = [None] * n
    rank_out: list[int | None] = [None] * n
    cand_out: list[tuple[CandidateTuple, ...]] = [()] * n

    want_rows = [i for i in range(n) if want_logprob[i]]
    if want_rows:
        if any(not 0 <= token_ids[i] < vocab_size for i in want_rows):
            raise ValueError(f"token id out of range [0, {vocab_size})")
        rows = _select_rows(logprobs, want_rows)
        tokens = torch.tensor([token_ids[i] for i in want_rows], device=logprobs.device)
        chosen = rows.gather(1, tokens[:, None])
        ranks = (rows > chosen).sum(-1, dtype=torch.int32) + 1  # int32: a faster reduction
        for i, value, rank in zip(want_rows, chosen[:, 0].tolist(), ranks.tolist(), strict=True):
            logprob_out[i], rank_out[i] = value, rank

    by_mode: dict[str, list[int]] = {"top_n": [], "all": [], "token_ids": []}
    for i, spec in enumerate(candidates):
        if spec is not None:
            by_mode[spec.mode].append(i)
    if by_mode["top_n"]:
        rows_idx = by_mode["top_n"]
        found = _top_n_candidates(
            _select_rows(logprobs, rows_idx),
            [candidates[i].top_n for i in rows_idx],  # type: ignore[union-attr]
        )
        for i, cands in zip(rows_idx, found, strict=True):
            cand_out[i] = cands
    if by_mode["all"]:
        rows_idx = by_mode["all"]
        found = _all_candidates(_select_rows(logprobs, rows_idx))
        for i, cands in zip(rows_idx, found, strict=True):
            cand_out[i] = cands
    for i in by_mode["token_ids"]:
        cand_out[i] = _token_id_candidates(logprobs[i], candidates[i].token_ids)  # type: ignore[union-attr]

    return list(zip(logprob_out, rank_out, cand_out, strict=True))


def prompt_logprobs(
    logits: torch.Tensor,
    target_token_ids: Sequence[int],
    want_logprob: bool,
    candidates: CandidateSpec | None,
) -> list[LogprobInfo]:
    """Prompt logprobs: row ``j`` of ``logits`` ``[P, V]`` is the model's prediction for
    ``target_token_ids[j]`` (the caller aligns position ``i-1``'s logits with token ``i``).

    Uses the raw ``log_softmax`` of the model: no temperature, penalties or masking (nothing
    was sampled). Batched over positions, ``PROMPT_CHUNK_POSITIONS`` at a time.
    """
    positions = logits.shape[0]
    if len(target_token_ids) != positions:
        raise ValueError("prompt_logprobs: one target token per logits row")
    if not want_logprob and candidates is None:
        return [(None, None, ())] * positions
    out: list[LogprobInfo] = []
    for start in range(0, positions, PROMPT_CHUNK_POSITIONS):
        end = min(start + PROMPT_CHUNK_POSITIONS, positions)
        chunk = torch.log_softmax(logits[start:end].float(), dim=-1)
        m = end - start
        out.extend(batch_logprob_info(chunk, target_token_ids[start:end], [want_logprob] * m, [candidates] * m))
    return out
