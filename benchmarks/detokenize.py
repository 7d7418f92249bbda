"""Incremental detokenization: what streaming text costs per token, against one decode of the whole output.

An engine streams text as tokens come (``IncrementalDetokenizer``), holding back text that may
still change (a piece of a character). Held text must not be decoded again for every token: a
long held run would cost O(n²) on the step thread. Each workload below streams ``--tokens``
tokens through the detokenizer, reading the held text after every token as the stop-string
check does (``peek_final``) and flushing at the end; the **baseline**, in the same run, is one
``tokenizer.decode`` of the whole output (the least any detokenizer can do). Reports µs per token
of each and their ratio; a ratio that grows with ``--tokens`` would be the quadratic cost back.

Workloads: English prose (SmolLM2, byte-level BPE); literal U+FFFD tokens (SmolLM2's token for
the character U+FFFD itself, bytes EF BF BD: a decoded text ending in it looks like a piece); a
space plus the first 3 bytes of an emoji, repeated (pieces that never complete a character);
emoji as SentencePiece byte-fallback tokens (a tiny Llama-style tokenizer from the tests: the
whole run is held until it ends).

    python benchmarks/detokenize.py                 # 8,000 tokens per workload, ~10 s
    python benchmarks/detokenize.py --tokens 2000   # a quicker run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refengine.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer, smollm2_tokenizer  # noqa: E402

PROSE = ("The scheduler admits requests while the token budget lasts; each step runs prefill chunks and "
         "decode rows together, and the KV cache hands out blocks of sixteen tokens. ")


def workloads(num_tokens: int) -> dict[str, tuple[object, list[int], list[int]]]:
    """name -> (tokenizer, prompt ids, output ids of ``num_tokens``)."""
    smol, sentencepiece = smollm2_tokenizer(), byte_fallback_tokenizer()
    prose = smol.encode(PROSE * (num_tokens // 20 + 1), add_special_tokens=False)[:num_tokens]
    literal = smol.encode("\ufffd" * num_tokens, add_special_tokens=False)  # one token per U+FFFD
    pieces = smol.encode(" 😀", add_special_tokens=False)[:1]  # "ĠðŁĺ": a space and 3 of the emoji's 4 bytes
    emoji_bytes = [sentencepiece.convert_tokens_to_ids(f"<0x{b:02X}>") for b in ("😀" * num_tokens).encode()]
    return {
        "prose (SmolLM2)": (smol, smol.encode("Hi", add_special_tokens=False), prose),
        "literal U+FFFD (SmolLM2)": (smol, smol.encode("Hi", add_special_tokens=False), literal[:num_tokens]),
        "emoji pieces (SmolLM2)": (smol, smol.encode("Hi", add_special_tokens=False), pieces * num_tokens),
        "emoji bytes (SentencePiece)": (sentencepiece, sentencepiece.encode("a", add_special_tokens=False),
                                        emoji_bytes[:num_tokens]),
    }


def stream(tokenizer: object, prompt: list[int], output: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)  # type: ignore[arg-type]
    text = []
    for token_id in output:
        text.append(detokenizer.add_token(token_id))
        if detokenizer.holds_text:
            detokenizer.peek_final()  # what a stop-string check reads
    text.append(detokenizer.flush())
    return "".join(text)


def best_of(repeats: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000, help="output tokens per workload (default 8000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, the fastest kept (default 3)")
    args = parser.parse_args()
    print(f"{args.tokens} tokens per workload, fastest of {args.repeats}")
    print(f"{'workload':30} {'stream µs/token':>16} {'one decode µs/token':>20} {'ratio':>7}")
    for name, (tokenizer, prompt, output) in workloads(args.tokens).items():
        streamed = stream(tokenizer, prompt, output)
        whole = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]  # type: ignore[attr-defined]
        assert streamed == whole, f"{name}: the streamed text differs from the decode"
        seconds = best_of(args.repeats, lambda: stream(tokenizer, prompt, output))  # noqa: B023
        baseline = best_of(args.repeats, lambda: tokenizer.decode(prompt + output))  # type: ignore[attr-defined]  # noqa: B023
        per_token, base_per_token = seconds / len(output) * 1e6, baseline / len(output) * 1e6
        print(f"{name:30} {per_token:16.2f} {base_per_token:20.3f} {per_token / base_per_token:7.0f}")


if __name__ == "__main__":
    main()
