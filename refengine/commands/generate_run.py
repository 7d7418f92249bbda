"""The two ways ``refengine generate`` runs one request: through servers or in-process.

Both take the same ``GenerateOptions`` (``generate_options``) and a printer
(``generate_output``); only the request adapter and the event source differ.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from contextlib import closing
from typing import TYPE_CHECKING

from refengine.commands.generate_options import USAGE_ERROR, GenerateOptions
from refengine.commands.generate_output import JsonPrinter, Printer, TextPrinter
from refengine.commands.generate_request import engine_request, wire_metadata, wire_request

if TYPE_CHECKING:
    from collections.abc import Iterator

    from refengine.client import Metadata, OpenEngineClient, oe

__all__ = ["run_local", "run_remote"]

REFUSED = 1  # a server or the engine refused or failed the request


def _printer(args: argparse.Namespace, options: GenerateOptions) -> Printer:
    if args.json:
        return JsonPrinter()
    return TextPrinter(options.num_sequences or 1, options.logprobs is not None, options.prompt_logprob_start or 0)


def _refused(printer: Printer | None, message: str) -> None:
    """The refusal on stderr, on a line of its own: after streamed text it ends that line first (a
    JSON printer never leaves one open; found by review: a blank line came before every in-stream error)."""
    broke_a_line = printer is not None and printer.mid_line
    print(f"{chr(10) if broke_a_line else ''}refengine generate: {message}", file=sys.stderr)


def run_remote(args: argparse.Namespace, options: GenerateOptions) -> int:
    """Through ``--remote``, or prefill on ``--prefill`` then decode on ``--decode`` (the
    two-hop flow of ``refengine.client.generate_disaggregated``), ``--encoder`` first if given."""
    import grpc

    from refengine.client import GenerationError, OpenEngineClient, PrefillFailed

    prefill_client = OpenEngineClient(args.prefill) if args.prefill else None
    encoder_client = OpenEngineClient(args.encoder) if args.encoder else None
    printer: Printer | None = None
    try:
        with OpenEngineClient(args.remote or args.decode) as client:
            try:
                prompt = _chat(client, options, args.prompt) if args.chat else args.prompt
            except ValueError as exc:  # a model whose chat template this machine lacks
                print(f"refengine generate: error: {exc}", file=sys.stderr)
                return USAGE_ERROR
            request = wire_request(options, prompt, f"cli-{uuid.uuid4().hex}")
            printer = _printer(args, options)
            unfinished = set(range(options.num_sequences or 1))
            # closing(): the hops' cleanup (aborting an unconsumed KV session, releasing media
            # handles) runs now, while their channels are open, not whenever the GC gets to it.
            with closing(_events(client, prefill_client, encoder_client, request, wire_metadata(options))) as events:
                for event in events:
                    printer.wire(event)
                    _raise_if_failed(event, client, args.remote)
                    if event.WhichOneof("event") == "finished":
                        unfinished.discard(event.finished.output_index)
            if unfinished:
                print(f"\nrefengine generate: the stream ended before output(s) {sorted(unfinished)} finished",
                      file=sys.stderr)
                return REFUSED
            printer.close()
    except grpc.RpcError as exc:  # refused before acceptance (a bad regex), or the stream broke
        _refused(printer, f"{exc.code().name}: {exc.details()}")
        return REFUSED
    except (GenerationError, PrefillFailed) as exc:
        _refused(printer, str(exc))
        return REFUSED
    finally:
        for hop in (prefill_client, encoder_client):
            if hop is not None:
                hop.close()
    return 0


def _raise_if_failed(event: oe.GenerateResponse, client: OpenEngineClient, remote: str | None) -> None:
    """An ``EngineError`` ends the run, as does a CANCELLED ``Finished``; so does a ``PrefillReady``,
    which only a prefill server named by ``--remote`` sends here (``generate_disaggregated``
    consumes the ``--prefill`` hop's). Its session is released at once: left alone it held its KV
    blocks until its lease ended."""
    from refengine.client import GenerationError, PrefillFailed, oe, release_kv_session

    kind = event.WhichOneof("event")
    if kind == "error":
        raise GenerationError(event.error)
    if kind == "finished" and event.finished.reason == oe.FINISH_REASON_CANCELLED:
        # an abort (Abort RPC, a drain) cut the output short: exit 1, not a quiet 0 (found by review)
        raise GenerationError(oe.EngineError(code=oe.ERROR_CODE_CANCELLED,
                                             message=event.finished.message or "the server cancelled the request"))
    if kind == "prefill_ready":
        release_kv_session(client, event.prefill_ready.kv_session)
        raise PrefillFailed(f"{remote} is a prefill server (it answered PrefillReady, K4): "
                            f"use --prefill {remote} --decode HOST:PORT")


def _chat(client: OpenEngineClient, options: GenerateOptions, prompt: str) -> str:
    """The prompt in the model's chat template, applied here: OpenEngine v0.1.0 has no chat API."""
    from refengine.model.chat import chat_prompt

    return chat_prompt(options.model or client.default_model(), prompt)


def _events(client: OpenEngineClient, prefill_client: OpenEngineClient | None,
            encoder_client: OpenEngineClient | None, request: oe.GenerateRequest,
            metadata: Metadata) -> Iterator[oe.GenerateResponse]:
    """The hops: [encode →] (aggregated on ``client`` | prefill → decode on ``client``)."""
    from refengine.client import generate_disaggregated

    if encoder_client is not None:
        from refengine.encoder_client import MediaClient, generate_epd

        if prefill_client is None:
            return generate_epd(MediaClient(encoder_client), client, None, request, metadata=metadata)
        return generate_epd(MediaClient(encoder_client), prefill_client, client, request, metadata=metadata)
    if prefill_client is None:
        return client.generate(request, metadata=metadata)
    return generate_disaggregated(prefill_client, client, request, metadata=metadata)


def run_local(args: argparse.Namespace, options: GenerateOptions) -> int:
    """In this process, on an engine built from the engine flags."""
    from refengine.args_config import engine_config_from_args
    from refengine.engine.engine import Engine
    from refengine.model import ModelNotFoundError, UnsupportedModelError
    from refengine.runtime import apply_process_settings
    from refengine.types import RequestError

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"refengine generate: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if config.role != "aggregated":  # found by review: loaded the model, then failed (decode: exit 1)
        print(f"refengine generate: --role {config.role}: generate runs the aggregated role in-process; --role "
              "is for serve (--prefill/--decode drive a disaggregated pair)", file=sys.stderr)
        return USAGE_ERROR
    apply_process_settings(config)
    try:
        engine = Engine.from_config(config)
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as exc:  # ValueError: a role, a model file
        print(f"refengine generate: {exc}", file=sys.stderr)
        return USAGE_ERROR
    prompt = args.prompt
    if args.chat:
        from refengine.model.chat import apply_chat_template

        try:
            prompt = apply_chat_template(engine.tokenizer, config.model, prompt)
        except ValueError as exc:  # no chat template, or one that does not render
            print(f"refengine generate: error: {exc}", file=sys.stderr)
            return USAGE_ERROR
    try:
        stream = engine.add_request(engine_request(options, prompt, "cli"))
    except RequestError as exc:  # refused before acceptance, e.g. a regex that does not compile
        print(f"refengine generate: {exc}", file=sys.stderr)
        return REFUSED
    printer = _printer(args, options)
    while not stream.finished:
        engine.step()
        for out in stream.drain():
            printer.engine(out)
            if out.error is not None:
                print(f"\nrefengine generate: {out.error.code.upper()}: {out.error.message}", file=sys.stderr)
                return REFUSED
    printer.close()
    return 0
