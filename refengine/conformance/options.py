"""The knobs of a conformance run (:class:`Options`), shared by the target, the runner and the
command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The longest timeout the command line accepts (~116 days): gRPC turns a deadline into a time_t,
#: and one of inf or 1e12 s overflows it (an error) or expires at once (DEADLINE_EXCEEDED). The
#: suite checks any server, so it keeps its own copy of refengine.client's limit.
MAX_DEADLINE_SECONDS = 1e7

#: How long a KV-event wait lasts with nothing arriving: for the batch a finished request caused,
#: a snapshot, a stream's end. RULES set no latency bound; this is the suite's patience.
EVENT_WAIT_S = 10.0


@dataclass(frozen=True)
class Options:
    """Knobs of a conformance run. ``model`` empty = the first supported model."""

    model: str = ""
    rpc_timeout_s: float = 10.0  # unary RPCs
    stream_timeout_s: float = 60.0  # one whole Generate stream
    idle_timeout_s: float = 20.0  # waiting for GetLoad to return to idle
    # E: a KV-event wait lasts this long with nothing arriving (counted from the last response,
    # at most 4 times this in all: kv_subscriber.STILL_ARRIVING); raise it for a loaded server.
    event_wait_s: float = EVENT_WAIT_S
    prompt: str = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
    max_long_prompt: int = 4096  # longest prompt a check may send to reach the context limit
    # E3: the eviction check fills the prefix cache with fresh prompts; it skips when the cache
    # (total_kv_blocks x kv_block_size) holds more tokens than this (it sends up to twice that).
    eviction_budget_tokens: int = 16384
    # E1: before replaying from batch 1, the expiry check has the server publish batches (fresh
    # requests) until this batch number; a server retaining more skips it.
    replay_budget_batches: int = 32
    # X1/X3: stall a stream this long without reading (0 = don't); set it above the server's
    # own stall timeout to see a failure after acceptance (refengine: --stall-timeout-seconds).
    slow_reader_s: float = 0.0
    slow_reader_extra: dict[str, Any] = field(default_factory=dict)  # GenerateRequest.extra of that stream
    # G8: known ``extra`` keys -> JSON type ("number", "string", "bool", "list", "struct"), when the
    # server does not advertise them in ModelInfo.extra["generate_extra_keys"].
    known_extra_keys: dict[str, str] = field(default_factory=dict)
    # K4–K10: a disaggregated pair (HOST:PORT of a PREFILL and a DECODE server); the K checks
    # that need it skip without it. K10 compares the pair with the target when that is AGGREGATED.
    prefill_address: str = ""
    decode_address: str = ""
    # The target's Control service, when it listens apart from Inference (refengine: --control-port);
    # "" = the target's own address. Only the target's: a server named with --prefill/--decode/--encoder
    # serves both on its address.
    control_address: str = ""
    # R1–R7: a directory the target can read (inside its LoRA root, e.g. refengine's --lora-root)
    # where the checks write small PEFT adapters, and the served model's Hugging Face config.json
    # (their shapes); the R checks that need adapter files skip without both.
    lora_dir: str = ""
    lora_model_config: str = ""
    # D9/G19: the served model's image placeholder token id. With it (and supports_multimodal =
    # true) prompts are sent as token ids holding it once per image, so real images can be
    # checked: accepted and completed, and a mismatched or undecodable item refused before
    # acceptance. Without it those checks skip (no model's placeholder is known to the suite).
    media_placeholder_token_id: int | None = None
    # ENC1–ENC15 (draft profile "encoder", docs/profiles/encoder.md): HOST:PORT of an encoder
    # server (refengine: ``serve --role encoder``) whose embedding handles the target consumes.
    # Empty: the target itself when it lists side "encoder"; else the checks that need an
    # encoder skip. The consumer checks also need media_placeholder_token_id.
    encoder_address: str = ""
