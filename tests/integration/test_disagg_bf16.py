"""Disaggregated prefill/decode in bfloat16 between real ``refengine serve`` processes (RULES K10):
the KV blocks a bf16 prefill server computes are read by a bf16 decode server's attention kernel,
and the greedy tokens equal an aggregated bf16 server's. On a CPU with AMX the blocks are in the
AMX attention form's own layout (keys row-major, values transposed: kernels/cpu/paged_attention_amx.h),
which both ends share and name alike in their KV layout strings; elsewhere in the vector forms'.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import json_format

from refengine.client import OpenEngineClient, generate_disaggregated
from refengine.kernels.attention.cpu_paged import amx_form_available
from refengine.kernels.cpu_features import native_bf16
from tests.integration.conftest import ServerProcess, start_server, wait_ready
from tests.integration.test_disagg_grpc import collect, request, wait_idle

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16 (avx512_bf16 / amx_bf16): "
                                                           "--dtype bfloat16 is emulated and slow here")]
COMMON = ("--dtype", "bfloat16", "--max-model-len", "1024", "--num-kv-blocks", "96", "--max-num-seqs", "8")
WORDS = "the a river mountain quiet light over under city small bright stone old new green song".split()


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, OpenEngineClient]]:
    tmp = tmp_path_factory.mktemp("disagg_bf16")
    procs: dict[str, ServerProcess] = {
        "aggregated": start_server(tmp / "aggregated.log", *COMMON, wait_ready=False),
        # its grace period waits for sessions left unpulled: short, so that the teardown ends soon
        "prefill": start_server(tmp / "prefill.log", "--role", "prefill", "--shutdown-grace-seconds", "2", *COMMON,
                                wait_ready=False),
        "decode": start_server(tmp / "decode.log", "--role", "decode", *COMMON, wait_ready=False),
    }
    made: dict[str, OpenEngineClient] = {}
    try:
        for name, proc in procs.items():
            wait_ready(proc)
            made[name] = OpenEngineClient(proc.address)
        yield made
    finally:
        for client in made.values():
            client.close()
        for proc in procs.values():
            proc.stop()


def test_bf16_disaggregated_greedy_equals_aggregated(clients: dict[str, OpenEngineClient]) -> None:
    """Four prompts of 1 to ~8 blocks, greedy, in parallel: the decode server's tokens (from the
    prefill server's bf16 blocks) equal the aggregated server's, and both ends end idle."""
    for client in clients.values():
        path = json_format.MessageToDict(client.server_info().extra).get("cpu_bf16_path", "")
        assert ("AMX tiles" in path) == amx_form_available(), path

    def one(i: int) -> tuple:
        prompt = " ".join(random.Random(i).choice(WORDS) for _ in range(5 + 30 * i))
        req = request(f"bf16-{i}", prompt, max_tokens=8)
        return (collect(generate_disaggregated(clients["prefill"], clients["decode"], req, timeout=120)),
                collect(clients["aggregated"].generate(req, timeout=120)))

    with futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for i, (dis, agg) in enumerate(results):
        assert dis.code == grpc.StatusCode.OK and not dis.of("error"), (i, dis.details, dis.of("error"))
        assert agg.code == grpc.StatusCode.OK, (i, agg.details)
        assert len(dis.tokens()) == 8 and dis.tokens() == agg.tokens(), f"prompt {i}"
    for name in ("prefill", "decode"):
        wait_idle(clients[name])
