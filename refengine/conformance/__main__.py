"""``python -m refengine.conformance HOST:PORT [--rules G1,G2,ENC] [--json out.json]``."""

from __future__ import annotations

import argparse
import json
import sys

from refengine.conformance.registry import Status
from refengine.conformance.release import RELEASE
from refengine.conformance.runner import Result, format_matrix, run, to_json
from refengine.conformance.target import Options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refengine.conformance",
                                     description=f"Check an {RELEASE} server against contract/RULES.md "
                                     "and the draft profiles of docs/profiles/.")
    parser.add_argument("address", help="HOST:PORT of the server")
    parser.add_argument("--rules", default="", help="comma-separated rule ids or sections (e.g. G1,G14,L,ENC)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--model", default="", help="model to test (default: the first supported model)")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of one Generate stream, s")
    parser.add_argument("--slow-reader-seconds", type=float, default=0.0,
                        help="X1/X3: stall one stream this long (above the server's stall timeout) to provoke "
                        "a failure after acceptance (default 0: not tried)")
    parser.add_argument("--slow-reader-extra", default="{}", metavar="JSON",
                        help="GenerateRequest.extra (a JSON object) of the stalled stream, e.g. to tighten the "
                        "server's stall timeout")
    parser.add_argument("--known-extra-keys", default="{}", metavar="JSON",
                        help='G8: known extra keys and their JSON types, e.g. {"my.knob": "number"}')
    parser.add_argument("--prefill", default="", metavar="HOST:PORT",
                        help="K4-K10: a PREFILL server, checked together with --decode (default: K checks skip)")
    parser.add_argument("--decode", default="", metavar="HOST:PORT", help="K4-K10: a DECODE server (with --prefill)")
    parser.add_argument("--lora-dir", default="", metavar="DIR",
                        help="R1-R7: a directory shared with the server (inside its LoRA root) where the checks "
                        "write small PEFT adapters (default: the R checks that need adapters skip)")
    parser.add_argument("--lora-model-config", default="", metavar="FILE",
                        help="R1-R7: the served model's Hugging Face config.json (shapes of those adapters)")
    parser.add_argument("--media-placeholder-token-id", type=int, default=None, metavar="N",
                        help="D9/G19: the model's image placeholder token id; prompts with real images are then "
                        "sent as token ids holding N once per image (default: those media checks skip)")
    parser.add_argument("--encoder", default="", metavar="HOST:PORT",
                        help="ENC1-ENC15 (draft profile encoder): an encoder server (refengine: serve --role encoder) "
                        "whose embedding handles the target consumes; with --media-placeholder-token-id the "
                        "consumer checks run too (default: the target itself when it is an encoder; the checks "
                        "needing one skip)")
    parser.add_argument("--quiet", action="store_true", help="no per-check progress lines")
    args = parser.parse_args(argv)

    def progress(r: Result) -> None:
        if not args.quiet:
            print(f"{r.status.value:4}  {r.name:45} {r.seconds:6.2f}s  {r.message[:100]}", file=sys.stderr,
                  flush=True)

    options = Options(model=args.model, stream_timeout_s=args.timeout, slow_reader_s=args.slow_reader_seconds,
                      slow_reader_extra=json.loads(args.slow_reader_extra),
                      known_extra_keys=json.loads(args.known_extra_keys), prefill_address=args.prefill,
                      decode_address=args.decode, lora_dir=args.lora_dir,
                      lora_model_config=args.lora_model_config,
                      media_placeholder_token_id=args.media_placeholder_token_id,
                      encoder_address=args.encoder)
    rules = [r for r in args.rules.split(",") if r.strip()] or None
    try:
        results = run(args.address, rules, options, on_result=progress)
    except ValueError as err:
        parser.error(str(err))
    print(format_matrix(results))
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(results, args.address))
    return 1 if any(r.status is Status.FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
