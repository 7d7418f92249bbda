"""The batched sampler: one call per step turns ``logits [n, V]`` into one token per row.

Pipeline, per row (each stage skipped for rows that do not use it):

0. grammar mask (``guided/``): a guided row keeps only the tokens its grammar allows next;
1. penalties (``penalties.py``): repetition over prompt + output, then frequency/presence
   over the output;
2. suppression: ``suppressed_token_ids`` -> ``-inf`` (min_tokens keeps EOS/stop ids out; a
   guided row with ``ignore_eos`` keeps EOS out);
3. temperature: ``logits / clamp(T, 1e-6, 1e30)`` (finite: penalties keep a logit within
   ``penalties.LOGIT_LIMIT``). Greedy rows (``T == 0``) take the argmax of the logits after 0-2 (ties -> lowest id) and
   skip everything below;
4. truncation (``truncation.py``), on the tempered distribution: top-k (0 or -1 = off; ties at the k-th value
   are kept, as HF), then top-p renormalized over the top-k set (the smallest prefix, in
   descending order, whose mass reaches ``top_p``; tokens tied with its last token are kept;
   never fewer than one token), then min-p (drop ``p < min_p * p_max``);
5. sampling by inverse CDF: one uniform ``u`` per row, token = the first ``i`` whose
   cumulative kept probability exceeds ``u * total`` -- probability ``p_i / sum(kept p)``.
   (One draw per row instead of an exponential race's V draws: ~4x cheaper on CPU.)

Non-finite logits (a NaN, a +inf, or every token at -inf) give a row no token: its id is
``vocab_size``, greedy or sampled, nothing is reported for it, and the engine fails that
request alone (the batch's other rows are unaffected).

Logprobs (RULES L5, L6, ref): ``log_softmax`` of the logits after 0-3 (greedy rows use T = 1),
*before* truncation: the distribution the token was drawn from, so a grammar-masked or
suppressed token reports ``-inf`` and a sampled token's logprob is always finite.

Reproducibility (RULES G17, G18): a row's token depends only on its own logits, parameters
and generator. No step mixes rows (no cross-row reduction); the only reductions inside a row
are ones whose result does not depend on how the row is split across threads (max, argmax,
topk, integer counts, and sequential cumsums instead of float sums). A sampled row with its
own ``generator`` draws exactly one float64 uniform from it per step; sampled rows without one
draw, together, from the sampler's shared generator; greedy rows draw nothing, even with a
generator. All of this holds on CPU. On CUDA torch's scan
splits a row into chunks sized by the batch's shape, so a cumsum may round differently with
other rows present (summing in 32-element chunks instead moved 1 top-p decision in 20,000
random rows), and cuBLAS GEMMs are not batch-invariant either: there G17 and G18 hold only
where no near-tie meets that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refengine.sampling.guided.bitmask import apply_bitmask
from refengine.sampling.logprobs import CandidateTuple, batch_logprob_info, prompt_logprobs
from refengine.sampling.penalties import apply_penalties
from refengine.sampling.truncation import truncation_thresholds
from refengine.types import CandidateSpec, SamplingParams

# prompt_logprobs is re-exported: the engine imports everything it samples with from here.
__all__ = [
    "SampledToken",
    "Sampler",
    "SamplingRow",
    "prompt_logprobs",
]

MIN_TEMPERATURE = 1e-6  # a smaller positive temperature is raised to this: logits / T stays finite
#: A larger temperature is lowered to this. Temperatures are float32 tensors, where 1e300 would be
#: inf and a masked token's -inf / inf NaN; at 1e30 any logit within ``LOGIT_LIMIT`` is below 34.
MAX_TEMPERATURE = 1e30


GREEDY_BLOCK = 1024  # logits per block of the CPU greedy argmax (``row_max``)


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(-1)``: each row's maximum and the lowest id holding it. On CPU torch's max with
    indices is a scalar loop (measured on Zen 4: ~21 µs per 49,152-logit row, ``amax`` ~1 µs), so
    there the maxima of blocks of ``GREEDY_BLOCK`` come first (``amax``), then the indexed max
    runs inside the first block holding the row's maximum only: the same ids, ties included.
    Measured with 1 thread: 64 rows of 49,152 in 0.43 ms against 2.76 (32,000: 0.33 against
    1.78); one row stays on ``max``, whose ~45 µs the extra calls would match. (A row whose
    maximum is NaN or infinite gets some id: the sampler gives it none anyway.)"""
    num_rows, width = logits.shape
    if logits.device.type != "cpu" or num_rows < 2 or width <= GREEDY_BLOCK:
        return logits.max(-1)
    full = width - width % GREEDY_BLOCK
    block_max = logits[:, :full].reshape(num_rows, full // GREEDY_BLOCK, GREEDY_BLOCK).amax(-1)
    if full < width:
        block_max = torch.cat([block_max, logits[:, full:].amax(-1, keepdim=True)], 1)
    best = block_max.amax(-1)
    first_block = (block_max == best[:, None]).to(torch.uint8).argmax(-1)
    columns = (first_block * GREEDY_BLOCK)[:, None] + torch.arange(GREEDY_BLOCK)
    columns = columns.clamp_max(width - 1)  # the last block may be short: repeats come after its end
    in_block = logits.gather(1, columns).max(-1).indices
    return best, columns.gather(1, in_block[:, None])[:, 0]


@dataclass
class SamplingRow:
    """One row of the logits: one sequence that needs its next token."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # the request's seeded generator; None -> the shared one
    suppressed_token_ids: Sequence[int] = ()  # -inf before sampling (StopChecker.suppressed_token_ids)
    want_logprob: bool = False  # report the sampled token's logprob and rank
    candidates: CandidateSpec | None = None  # top_n / token_ids / all


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    rank: int | None
    candidates: tuple[CandidateTuple, ...]  # (token_id, logprob, rank); the engine adds text


class Sampler:
    """Samples one token per row; see the module docstring for the exact semantics.

    ``vocab_size`` is the number of real tokens: logits may be wider (a padded LM head), the
    extra columns are dropped and never sampled or reported. ``seed`` seeds the shared
    generator used by rows without their own. One engine loop calls it (not thread-safe).
    """

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        # float64 CDF scratch, reused across steps: a fresh 25 MB tensor per step costs up to 5x
        # the cumsum itself in page faults on CPU. Grows to the largest batch seen.
        self._cdf_buffers: dict[torch.device, torch.Tensor] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """``[len(rows), 1]`` float64 uniforms in [0, 1): a row with a generator draws its one
        value from it alone; the other rows share one batched draw from the shared generator."""
        uniforms = torch.empty(len(rows), 1, dtype=torch.float64, device=device)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if shared:
            gen = self.shared_generator(device)
            draw = torch.rand(len(shared), 1, dtype=torch.float64, generator=gen, device=device)
            uniforms[torch.tensor(shared, device=device)] = draw
        for j, row in enumerate(rows):
            if row.generator is not None:  # drawn on the generator's own device (the engine's: CPU)
                draw = torch.rand(1, dtype=torch.float64, generator=row.generator, device=row.generator.device)
                uniforms[j] = draw.to(device)
        return uniforms

    def _cdf_buffer(self, probs: torch.Tensor) -> torch.Tensor:
        rows, device = probs.shape[0], probs.device
        buffer = self._cdf_buffers.get(device)
        if buffer is None or buffer.shape[0] < rows:
            buffer = torch.empty(rows, self.vocab_size, dtype=torch.float64, device=device)
            self._cdf_buffers[device] = buffer
        return buffer[:rows]

    @staticmethod
    def _suppress(logits: torch.Tensor, rows: Sequence[SamplingRow], masked_rows: Sequence[int]) -> torch.Tensor:
        """Step 2 (min_tokens; a guided row's ignored EOS). A grammar-constrained row whose grammar
        allows only tokens that are suppressed keeps them: the grammar wins (ref), so a row never
        has no token left."""
        suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppressed_token_ids]
        if not suppress:
            return logits
        device = logits.device
        row_idx, tok_idx = torch.tensor(suppress, dtype=torch.long, device=device).T
        suppressed = logits.index_put((row_idx, tok_idx), torch.tensor(float("-inf"), device=device))
        if masked_rows:
            guided = torch.tensor(list(masked_rows), device=device)
            dead = guided[torch.isneginf(suppressed[guided]).all(-1)]
            if dead.numel():
                suppressed[dead] = logits[dead]
        return suppressed

    def _greedy(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """Argmax per row, or ``vocab_size``: the maximum propagates NaN, so one reduction also
        finds a NaN, a +inf or an all -inf row."""
        best, ids = row_max(logits)
        return torch.where(torch.isfinite(best), ids, self.vocab_size).tolist()

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """Tokens for non-greedy rows; ``logits`` ``[s, V]`` are penalized and tempered.

        Inverse-CDF draw: token = the first ``i`` with ``cdf[i] > u * cdf[-1]``, the CDF a
        float64 sequential cumsum of the kept probabilities (exact per row, batch invariant).
        A removed token has a zero-width interval, so it can never be drawn. A row whose
        probabilities are not finite (NaN logits) draws ``vocab_size``, no token: the engine
        fails that request alone.
        """
        probs = torch.softmax(logits, dim=-1)
        thresholds = truncation_thresholds(logits, probs, [r.params for r in rows])
        if thresholds is not None:
            cut, floor = thresholds
            probs = torch.where((logits >= cut[:, None]) & (probs >= floor[:, None]), probs, 0.0)
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64, out=self._cdf_buffer(probs))
        total = cdf[:, -1:].contiguous()
        ids = torch.searchsorted(cdf, self._uniforms(rows, logits.device) * total, right=True)
        # u * total can round up to total itself: fall back to the last token with p > 0.
        ids = torch.minimum(ids, torch.searchsorted(cdf, total))
        # Judged on the logits, not the CDF: truncation turns a NaN row's probabilities into zeros
        # (NaN >= floor is false), which drew token 0; a min_p row's NaN floor did the same to a
        # non-finite row next to it. amax is exact, so this keeps every row batch invariant.
        finite = torch.isfinite(logits.amax(-1, keepdim=True))
        return torch.where(finite, ids, self.vocab_size)[:, 0].tolist()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: torch.Tensor | None = None,
                 masked_rows: Sequence[int] = ()) -> list[SampledToken]:
        """One token per row of ``logits`` ``[len(rows), >= vocab_size]``. Never modifies ``logits``.

        ``masked_rows`` (grammar-constrained rows) keep only the tokens their row of
        ``token_bitmask`` allows, before anything else (step 0 of the module docstring)."""
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {n} rows x vocab {self.vocab_size}")
        if n == 0:
            return []
        device = logits.device
        logits = logits[:, : self.vocab_size].float()
        if masked_rows:
            assert token_bitmask is not None, "masked rows without a bitmask"
            logits = logits.clone()  # the caller's logits stay untouched
            apply_bitmask(logits, token_bitmask, list(masked_rows))
        params = [r.params for r in rows]
        logits = apply_penalties(logits, params, [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows])
        logits = self._suppress(logits, rows, masked_rows)
        temperatures = [1.0 if p.greedy else min(max(p.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
                        for p in params]
        if any(t != 1.0 for t in temperatures):
            logits_t = logits / torch.tensor(temperatures, device=device)[:, None]
        else:
            logits_t = logits

        token_ids = [0] * n
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        for subset, pick in ((greedy, self._greedy), (sampled, self._sample)):
            if not subset:
                continue
            part = logits_t if len(subset) == n else logits_t[torch.tensor(subset, device=device)]
            for i, token_id in zip(subset, pick(part, [rows[i] for i in subset]), strict=True):
                token_ids[i] = token_id

        return self._report(logits_t, rows, token_ids)

    def _report(self, logits_t: torch.Tensor, rows: Sequence[SamplingRow], token_ids: list[int]) -> list[SampledToken]:
        """The chosen tokens, with the logprob, rank and candidates their rows asked for, from the
        tempered logits (L6: the distribution the token was drawn from)."""
        n = len(rows)
        infos = [(None, None, ())] * n
        # A row with non-finite logits got no token (``vocab_size``): nothing to report, and its
        # request fails alone, while the batch's other rows report as usual.
        reporting = [i for i, r in enumerate(rows)
                     if (r.want_logprob or r.candidates is not None) and token_ids[i] < self.vocab_size]
        if reporting:
            part = logits_t if len(reporting) == n else logits_t[torch.tensor(reporting, device=logits_t.device)]
            found = batch_logprob_info(
                torch.log_softmax(part, dim=-1),
                [token_ids[i] for i in reporting],
                [rows[i].want_logprob for i in reporting],
                [rows[i].candidates for i in reporting],
            )
            for i, info in zip(reporting, found, strict=True):
                infos[i] = info
        return [
            SampledToken(token_id=t, logprob=lp, rank=rk, candidates=c)
            for t, (lp, rk, c) in zip(token_ids, infos, strict=True)
        ]
