"""Command line: ``refengine serve`` and ``refengine generate``."""

from __future__ import annotations

import argparse
import sys
import time

from refengine.config import ATTENTION_BACKENDS, CacheConfig, EngineConfig, SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d, c, s = EngineConfig(), CacheConfig(), SchedulerConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="manifest name (models/*.toml) or a path to an HF dir "
                   "or a .gguf file; the default is the embedded SmolLM2-135M-Instruct")
    g.add_argument("--served-model-name", default=None, help="name clients use (None: the manifest name)")
    g.add_argument("--served-model-alias", action="append", default=[], metavar="NAME", dest="served_model_aliases",
                   help="a further name clients may use for the model (repeatable; ModelInfo.served_model_aliases)")
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"],
                   help="weight and KV dtype (the native CPU attention and oneDNN projections take float32 only)")
    g.add_argument("--device", default=d.device, help="torch device")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="auto: the native paged kernel for float32 on CPU (built with the machine's C "
                   "compiler on first use), else the torch reference")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (None: the model's)")
    g.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks in the pool (None: sized from --kv-memory-mib)")
    g.add_argument("--kv-memory-mib", type=int, default=c.kv_memory_bytes >> 20,
                   help="KV cache memory budget in MiB")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                   help="per-step token budget")
    g.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs,
                   help="most sequences running at once")
    g.add_argument("--max-num-sequences", type=int, default=d.max_num_sequences,
                   help="most outputs one request may ask for")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the shared sampling generator")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (None: one per core); 1 is faster on a busy machine")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        served_model_aliases=tuple(args.served_model_aliases),
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_sequences=args.max_num_sequences,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            kv_memory_bytes=args.kv_memory_mib << 20,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs),
    )


def _generate(args: argparse.Namespace) -> int:
    from refengine.engine.types import GenerationRequest, SamplingParams, StoppingParams

    if args.remote:
        from refengine.client import stream_text

        for piece in stream_text(args.remote, args.prompt, model=args.model_name or "",
                                 max_tokens=args.max_tokens, temperature=args.temperature, chat=args.chat):
            print(piece, end="", flush=True)
        print()
        return 0
    from refengine.engine.engine import Engine

    engine = Engine.from_config(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    request = GenerationRequest(
        request_id="cli",
        prompt=prompt,
        sampling=SamplingParams(temperature=args.temperature, seed=args.sampling_seed),
        stopping=StoppingParams(max_tokens=args.max_tokens),
    )
    stream = engine.add_request(request)
    start = time.perf_counter()
    while not stream.finished:
        engine.step()
        for out in stream.drain():
            for delta in out.deltas:
                print(delta.text, end="", flush=True)
    print(flush=True)
    usage = stream.result().usage
    elapsed = time.perf_counter() - start
    print(f"[{usage.completion_tokens} tokens in {elapsed:.2f} s, "
          f"{usage.completion_tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve OpenEngine v0.1.0 over gRPC",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(serve)
    try:
        from refengine.server.app import add_server_args
    except ImportError:  # the server package is optional for a core-only checkout
        add_server_args = None
    if add_server_args is not None:
        add_server_args(serve)

    gen = sub.add_parser("generate", help="generate text for one prompt",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--remote", metavar="HOST:PORT", help="generate through a running server")
    gen.add_argument("--model-name", default=None, help="model to ask a remote server for")
    add_engine_args(gen)

    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    from refengine.server.app import serve_from_args

    return serve_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
