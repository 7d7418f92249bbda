"""A decode request's session, checked before acceptance (found by review; each test failed
before its fix): what a client forwards can be edited, and an edit the decode engine can tell
must fail that request alone, with INVALID_ARGUMENT. A session id or NIXL block ids swapped for
another prompt's fail the pull instead (tests/integration/test_disagg_grpc.py).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import pytest

from refengine.protocol import oe
from refengine.server.metadata import RequestMetadata
from refengine.server.validation import Rejection, check_role
from refengine.types import InvalidRequestError, KvEndpointSpec, KvParams
from tests.unit.test_disagg_engine import PROMPTS, request, run, tiny, trio  # noqa: F401


def test_a_candidate_outside_the_vocabulary_is_refused_and_fails_nothing_else(trio) -> None:  # noqa: F811
    """K5: first_token.candidates were not range-checked; 2**40 (a Struct's double carries it)
    raised inside the step when its text was decoded, and the engine failed every request."""
    _, prefill, decode, _ = trio
    victim_params = request("victim", PROMPTS[4], None, 0.0, max_tokens=60)
    victim_session = run(prefill, victim_params).prefill
    bad_params = request("bad", PROMPTS[2], None, 0.0)
    attributes = copy.deepcopy(dict(run(prefill, bad_params).prefill.attributes))
    attributes["first_token"]["candidates"] = [[2**40, -1.0, 1]]
    victim = decode.add_request(replace(victim_params, kv=KvParams(session=victim_session)))
    time.sleep(0.05)
    session = replace(victim_session, attributes=attributes)
    with pytest.raises(InvalidRequestError, match=r"candidates\[0\] token id 1099511627776 is outside"):
        decode.add_request(replace(bad_params, kv=KvParams(session=session)))
    assert victim.result(30).error is None


@pytest.mark.parametrize("edit", ["empty", "outside", "no metadata"])
def test_malformed_nixl_block_ids_are_refused_before_acceptance(trio, edit: str) -> None:  # noqa: F811
    """K5: too few block ids, ids past the source's regions, or no agent metadata were accepted
    and failed after acceptance (KV_TRANSFER_FAILED, not retryable)."""
    pytest.importorskip("nixl", reason="the nixl extra is not installed")
    _, prefill, decode, _ = trio
    params = request("n", PROMPTS[3], None, 0.0)
    session = run(prefill, params).prefill
    attributes = copy.deepcopy(dict(session.attributes))
    regions = [[str(r.address), r.num_blocks, r.block_nbytes] for r in decode.block_io.regions]
    count = attributes["num_blocks"]
    ids = {"empty": [], "outside": [10**6 + i for i in range(count)], "no metadata": list(range(count))}[edit]
    attributes["transfer"] = {"nixl_agent_name": "someone", "nixl_agent_metadata": "" if edit == "no metadata"
                              else "bWV0YQ==", "nixl_regions": regions, "nixl_block_ids": ids}
    bad = replace(session, transfer_backend="nixl", attributes=attributes)
    with pytest.raises(InvalidRequestError, match="unusable by the 'nixl' backend"):
        decode.add_request(replace(params, kv=KvParams(session=bad)))


@pytest.mark.parametrize("host", ["10.9.9.9", "attacker.example", "169.254.169.254", "0.0.0.0"])
def test_a_session_naming_a_source_not_allowed_is_refused_before_acceptance(trio, host: str) -> None:  # noqa: F811
    """K5 (ref), found by review: a session's attributes can be copied from a real one, and the
    source it names sent whatever rows it liked, which entered the decode engine's prefix cache
    under the prompt for later hand-overs of it. Sources are --kv-source-allow's (loopback by
    default); the request is refused naming the endpoint, and nothing is dialed."""
    _, prefill, decode, _ = trio
    params = request("src", PROMPTS[1], None, 0.0)
    session = run(prefill, params).prefill
    forged = replace(session, endpoints=(KvEndpointSpec(host, 7000, "grpc"),))  # the server adds them
    with pytest.raises(InvalidRequestError, match=rf"kv.session: endpoint {host}:7000 is not a source this server"):
        decode.add_request(replace(params, kv=KvParams(session=forged)))
    local = replace(session, endpoints=(KvEndpointSpec("127.0.0.1", 7000, "grpc"),))
    assert decode.add_request(replace(params, request_id="src-ok", kv=KvParams(session=local))).result(30).error \
        is None


@pytest.mark.parametrize("protocol", ["tcp", ""])
def test_a_session_without_a_pullable_endpoint_is_refused_before_acceptance(protocol: str) -> None:
    """K5: an endpoint of another protocol passed, then the pull failed ('names no grpc endpoint')."""
    req = oe.GenerateRequest(request_id="r", prompt="hi")
    req.kv.session.session_id = "s1"
    req.kv.session.transfer_backend = "grpc"
    req.kv.session.endpoints.add(host="127.0.0.1", port=5555, protocol=protocol)
    with pytest.raises(Rejection, match="none has a protocol this engine pulls with"):
        check_role(req, "decode", RequestMetadata(), ("grpc", "nixl"))



def test_the_prompt_hash_tying_pulled_kv_to_its_prompt_is_256_bits() -> None:
    """Found by review: a 64-bit hash let a client choosing both prompts find two with equal
    hashes in about 2^32 tries (a birthday search), then have a decode server pull one prompt's KV
    and cache it under the other's keys. A 256-bit hash is below 2^64 with probability 2^-192:
    every one of 64 random prompts' hashes is above it; a 64-bit hash never is."""
    import random

    from refengine.kv.transfer.attributes import prompt_hash

    rng = random.Random(0)
    hashes = {prompt_hash([rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]) for _ in range(64)}
    assert len(hashes) == 64 and all(2**64 <= h < 2**256 for h in hashes)
