"""What a prefill or decode engine accepts (D7, K5, K6), checked before acceptance.

Choices where the contract is silent (ref):
- both disaggregated roles take ``num_sequences`` = 1 only: a session carries one
  output's first token (fan out on the decode side instead, with one session each);
- prompt logprobs are computed (and sent, before ``PrefillReady``) by the prefill engine;
  a decode engine refuses them, as it never computes the prompt;
- the server's health probe (``GenerationRequest.health_probe``, H2) runs on a decode engine
  without a session, its prompt computed locally: the role's own path needs a prefill engine;
- a decode request's session is checked against this engine and this prompt: schema,
  model fingerprint, block size, KV dtype and layout, block bytes, prompt length and
  prompt hash (media identities included), block count, a backend this engine has, and the
  ``transfer`` attributes that backend reads (NIXL: agent, regions of the same block bytes,
  block ids), and the options that shaped the first token (``first_token_options.py``). Any
  mismatch is INVALID_ARGUMENT naming the attribute, before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refengine.engine.first_token_options import first_option_differing, first_token_options
from refengine.engine.kv_sources import SourcePolicy
from refengine.kv.transfer.attributes import SessionAttributes, prompt_hash
from refengine.kv.transfer.base import BlockStore, KvTransferBackend
from refengine.types import GenerationRequest, InvalidRequestError, KvSessionSpec


class RoleCheck:
    def __init__(self, role: str, fingerprint: str, block_size: int, store: BlockStore,
                 backends: Mapping[str, KvTransferBackend], vocab_size: int,
                 allowed_sources: tuple[str, ...], default_guided_backend: str) -> None:
        self.role = role
        self.default_guided_backend = default_guided_backend
        self.sources = SourcePolicy(allowed_sources)  # where sessions and handles may be pulled from
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.store = store
        self.backends = backends
        self.vocab_size = vocab_size

    def check(self, params: GenerationRequest, prompt_ids: list[int], media: tuple[tuple[int, str], ...] = (),
              adapter: str = "") -> None:
        """``media``: (first position, identity) of each media item in the expanded prompt;
        ``adapter``: the request's LoRA adapter's cache key ("" for the base model)."""
        session = params.kv.session
        if session is not None and self.role != "decode":
            article = "an" if self.role[0] in "aeiou" else "a"
            raise InvalidRequestError(f"role mismatch: this is {article} {self.role} engine; only a decode engine "
                                      "takes kv.session")
        if self.role == "aggregated":
            return
        if params.sampling.num_sequences != 1:
            raise InvalidRequestError(f"sampling.num_sequences must be 1 on a {self.role} engine: a KV session "
                                      "carries one output's first token")
        if self.role == "decode":
            if session is None and params.health_probe:
                return  # H2: the probe is computed here, prompt and all (the server makes it, not a client)
            if session is None:
                raise InvalidRequestError("role mismatch: a decode engine needs kv.session (a prefill engine's "
                                          "PrefillReady.kv_session)")
            if params.logprobs.prompt_logprobs or params.logprobs.prompt_candidates is not None:
                raise InvalidRequestError("prompt logprobs are computed by the prefill engine: ask it for them")
            options = first_token_options(params, self.default_guided_backend)
            self._check_session(session, prompt_ids, media, adapter, options)

    def _check_session(self, session: KvSessionSpec, prompt_ids: list[int],
                       media: tuple[tuple[int, str], ...], adapter: str, options: dict[str, Any]) -> None:
        if session.transfer_backend not in self.backends:
            raise InvalidRequestError(f"kv.session.transfer_backend {session.transfer_backend!r} is not one this "
                                      f"engine has: {list(self.backends)}")
        self.sources.check(session.endpoints, "kv.session")
        try:
            attrs = SessionAttributes.from_json(session.attributes)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        # The layout facts first: the fingerprint also covers --dtype and --kv-cache-dtype
        # (loader.model_fingerprint), so checked first it would name itself for a KV dtype mismatch.
        expected = {
            "block_size": self.block_size,
            "kv_dtype": self.store.dtype,
            "kv_layout": self.store.layout,
            "block_nbytes": self.store.block_nbytes,
            "model_fingerprint": self.fingerprint,
            "num_prompt_tokens": len(prompt_ids),
            "prompt_hash": prompt_hash(prompt_ids, media, adapter),
            "num_blocks": -(-len(prompt_ids) // self.block_size),
        }
        for key, want in expected.items():
            got = getattr(attrs, key)
            if got != want:
                raise InvalidRequestError(f"kv.session.attributes_struct.{key} is {got!r}, this engine and prompt "
                                          f"need {want!r}: the session was prefilled for another model, dtype, "
                                          "layout, prompt or LoRA adapter")
        if key := first_option_differing(dict(attrs.first_token_options), options):
            recorded = attrs.first_token_options.get(key)
            raise InvalidRequestError(f"kv.session.attributes_struct.first_token_options.{key} is {recorded!r}, "
                                      f"this request asks for {options[key]!r}: the session's first token was sampled "
                                      "(with its logprob and candidates) under the prefill request's options; send "
                                      "the decode request with the same")
        if problem := self.backends[session.transfer_backend].source_problem(attrs.transfer, attrs.num_blocks):
            raise InvalidRequestError(f"kv.session.attributes_struct.transfer is unusable by the "
                                      f"{session.transfer_backend!r} backend: {problem}")
        ids = [("token_id", attrs.first_token.token_id)]
        ids += [(f"candidates[{i}] token id", c[0]) for i, c in enumerate(attrs.first_token.candidates)]
        for what, token_id in ids:  # a candidate's text is decoded on the step thread: out of range, it failed all
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(f"kv.session.attributes_struct.first_token.{what} {token_id} is "
                                          "outside the vocabulary")
