"""Incremental detokenization: what streaming text costs per token, against one decode of the whole output.

An engine streams text as tokens come (``IncrementalDetokenizer``), holding back text that may
still change (a piece of a character), and checks stop strings on it, also on the held text
(``stop_checker.process_token``). Held text must not be decoded, joined or compared again for
every token: a long held run would cost O(n²) on the step thread. Each workload below streams
its output through ``process_token`` as the engine does, with a stop string that never matches,
and again with ``min_tokens`` 4 (the held run then starts among the first tokens, whose
characters a stop string may not end in); the **baseline**, in the same run, is one
``tokenizer.decode`` of the whole output (the least any detokenizer can do). Reports µs per token
at each ``--tokens`` length: a cost per token that grows with the length is the quadratic cost.

Workloads: English prose (SmolLM2, byte-level BPE); literal U+FFFD tokens (SmolLM2's token for
the character U+FFFD itself, bytes EF BF BD: a decoded text ending in it looks like a piece); a
space plus the first 3 bytes of an emoji, repeated (pieces that never complete a character:
the run is held to the end); emoji as SentencePiece byte-fallback tokens (a tiny Llama-style
tokenizer from the tests: the whole run is held until it ends).

    python benchmarks/detokenize.py                       # 2,000, 8,000 and 32,000 tokens, ~1 min
    python benchmarks/detokenize.py --tokens 2000 8000    # a quicker run
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
from refengine.engine.stop_checker import StopChecker, process_token  # noqa: E402
from refengine.types import StoppingParams  # noqa: E402
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer, smollm2_tokenizer  # noqa: E402

PROSE = ("The scheduler admits requests while the token budget lasts; each step runs prefill chunks and "
         "decode rows together, and the KV cache hands out blocks of sixteen tokens. ")
MIN_TOKENS = 4
NEVER = "\x00never"  # a stop string no workload contains


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


def stream(tokenizer: object, prompt: list[int], output: list[int], min_tokens: int) -> str:
    """The output's text as ``process_token`` emits it, token by token (the last one ends it: LENGTH)."""
    stopping = StoppingParams(stop_strings=(NEVER,), min_tokens=min_tokens)
    stop = StopChecker(stopping, [tokenizer.eos_token_id], len(output))  # type: ignore[attr-defined]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)  # type: ignore[arg-type]
    text = []
    for count, token_id in enumerate(output, 1):
        text.append(process_token(stop, detokenizer, token_id, count).text)
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
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 32000],
                        help="output lengths, tokens per workload (default 2000 8000 32000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, the fastest kept (default 3)")
    args = parser.parse_args()
    lengths = sorted(args.tokens)
    rows: dict[str, list[float]] = {}
    for num_tokens in lengths:
        for name, (tokenizer, prompt, output) in workloads(num_tokens).items():
            whole = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]  # type: ignore[attr-defined]
            for min_tokens in (0, MIN_TOKENS):
                streamed = stream(tokenizer, prompt, output, min_tokens)
                assert streamed == whole, f"{name}: the streamed text differs from the decode"
                seconds = best_of(args.repeats, lambda: stream(tokenizer, prompt, output, min_tokens))  # noqa: B023
                label = f"{name}{', min_tokens' if min_tokens else ''}"
                rows.setdefault(label, []).append(seconds / len(output) * 1e6)
            decode = best_of(args.repeats, lambda: tokenizer.decode(prompt + output))  # type: ignore[attr-defined]  # noqa: B023
            rows.setdefault(f"{name}: one decode", []).append(decode / len(output) * 1e6)
    print(f"µs per token at each length (fastest of {args.repeats}); growth: the longest against the shortest")
    print(f"{'workload':50}" + "".join(f"{n:>10}" for n in lengths) + f"{'growth':>8}")
    for label, per_token in rows.items():
        print(f"{label:50}" + "".join(f"{t:10.2f}" for t in per_token) + f"{per_token[-1] / per_token[0]:8.2f}")


if __name__ == "__main__":
    main()
