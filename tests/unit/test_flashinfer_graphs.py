"""The FlashInfer backend's CUDA graph mode (kernels/attention/flashinfer_backend.py), on the CPU
through the fake ``flashinfer`` of test_flashinfer_backend.py, whose graph-mode decode wrapper
behaves as FlashInfer documents it: its batch size is fixed by the buffers it was made over,
``plan`` copies the page table into them and ``run`` reads only them.

What must hold: graph mode computes what the eager decode step computes, reading the fixed
buffers and not the last eager step; ``prepare_for_replay`` plans the wrapper of the step's size
as soon as the signature is known, so neither a recorded run nor a replay plans (a plan inside a
capture would freeze one step's page table into the graph); through ``DecodeGraphs`` the graphed
decode steps of a real (tiny) model give the eager steps' logits. On a GPU these paths have not
run yet (FlashInfer is not on the GPU machine's image).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from refengine.config import CacheConfig, KernelConfig
from refengine.kernels.attention import TorchReferenceBackend
from refengine.kernels.attention.flashinfer_backend import FlashInferBackend
from refengine.model.cuda_graphs import DecodeGraphs
from refengine.model.runner import ModelRunner

# The fixtures ``tiny`` and ``fake_flashinfer`` are shared by import (pytest finds them by these
# names here), hence the F811 marks on the tests that take them.
from tests.unit.test_cuda_graphs import BLOCK, MAX_LEN, NUM_BLOCKS, SCRATCH, mixed_steps, tiny  # noqa: F401
from tests.unit.test_flashinfer_backend import DECODES, RAGGED, fake_flashinfer, num_plans  # noqa: F401
from tests.unit.test_flashinfer_backend import make_step as attention_step


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)], ids=["g1", "g3", "g8"])
def test_graph_mode_computes_the_eager_decode_step(fake_flashinfer, num_heads: int, num_kv_heads: int) -> None:  # noqa: F811
    """The first loaded step is planned by the warm-up's forward (the signature arrives with the
    tensors); the next is planned by ``prepare_for_replay`` and its forward plans nothing. Both
    equal the eager decode step exactly, outputs and cache writes, after a stale eager step."""
    graphed = FlashInferBackend(device="cpu", workspace_bytes=1024)
    graphed.init_cuda_graph_state(8, 16, device="cpu")
    stale = attention_step(RAGGED, num_heads, num_kv_heads, 16, 8, torch.float32, "cpu", seed=9)[0]
    graphed.prepare(stale)
    for seed in (1, 2):
        meta, q, k, v, k_cache, v_cache, scale = attention_step(DECODES, num_heads, num_kv_heads, 16, 8,
                                                                torch.float32, "cpu", seed=seed)
        eager = FlashInferBackend(device="cpu", workspace_bytes=1024)
        eager.prepare(meta)
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        want = eager.forward(q, k, v, eager_k, eager_v, scale)
        plans = num_plans(fake_flashinfer)
        graphed.prepare_for_replay(meta)
        assert num_plans(fake_flashinfer) == plans + (seed == 2), "a known signature is planned at load"
        graphed.prepare_for_capture(len(DECODES))
        got = graphed.forward(q, k, v, k_cache, v_cache, scale)
        assert num_plans(fake_flashinfer) == plans + 1, "one plan per loaded step"
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), "the cache write differs"
        assert torch.equal(got, want)
    tensor_cores = f"tensor_cores={num_heads // num_kv_heads > 4}"
    assert [e for e in fake_flashinfer if e[1] == "plan" and e[0].startswith("decode-graph")] == \
        [("decode-graph-5", "plan", tensor_cores)] * 2


def test_graph_mode_reads_the_slots_from_its_buffer(fake_flashinfer) -> None:  # noqa: F811
    """The KV write of a graphed step takes its slots from the fixed buffer, as a captured write
    must (it cannot see a later step's metadata): what the buffer holds is where the rows land."""
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024)
    backend.init_cuda_graph_state(8, 16, device="cpu")
    meta, q, k, v, k_cache, v_cache, scale = attention_step(DECODES, 4, 2, 16, 8, torch.float32, "cpu", seed=3)
    backend.prepare_for_replay(meta)
    backend.prepare_for_capture(len(DECODES))
    elsewhere = torch.arange(len(DECODES)) + k_cache.shape[0] * 8 - len(DECODES)  # the last block's rows
    assert not bool(torch.isin(elsewhere, meta.slot_mapping).any())
    backend._graph.slot_mapping[: len(DECODES)].copy_(elsewhere)  # what a replay's buffer could hold
    backend.forward(q, k, v, k_cache, v_cache, scale)
    rows = k_cache.view(-1, 2, 16)[elsewhere]
    assert torch.equal(rows, k.reshape(rows.shape))


def test_graph_mode_refuses_a_batch_it_was_not_loaded_with(fake_flashinfer) -> None:  # noqa: F811
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024)
    backend.init_cuda_graph_state(8, 16, device="cpu")
    meta, q, k, v, k_cache, v_cache, scale = attention_step(DECODES, 4, 2, 16, 8, torch.float32, "cpu", seed=5)
    backend.prepare_for_replay(meta)
    backend.prepare_for_capture(4)
    with pytest.raises(AssertionError):
        backend.forward(q[:4], k[:4], v[:4], k_cache, v_cache, scale)
    with pytest.raises(AssertionError, match="decode-only"):
        backend.prepare_for_replay(attention_step(RAGGED, 4, 2, 16, 8, torch.float32, "cpu", seed=5)[0])


class PlanCheckingRecorder:
    """The CUDA graph recorder's stand-in, with its warm-up: "capture" runs the forward twice
    (warm-up, then the "recorded" run, which must not plan), "replay" reruns it into the same
    output, which must not plan either (``prepare_for_replay`` planned the step). ``log``: the
    ``fake_flashinfer`` log, where the plans are counted."""

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log = log
        self.captures = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        forward()
        plans = num_plans(self.log)
        output = forward()
        assert num_plans(self.log) == plans, "the recorded run planned"
        self.captures += 1

        def replay() -> None:
            before = num_plans(self.log)
            output.copy_(forward())
            assert num_plans(self.log) == before, "a replay planned"
        return replay, output


def runner_with(model, attention) -> ModelRunner:  # noqa: ANN001
    model_config, weights = model
    return ModelRunner(model_config, weights, CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS), MAX_LEN,
                       attention=attention, kernels=KernelConfig(native_cpu_kernels=False))


def test_decode_graphs_over_flashinfer_match_the_eager_steps(tiny, fake_flashinfer) -> None:  # noqa: F811
    """Prefills, decode steps of several sizes (padded to 1, 2, 4) and a mixed step through
    ``DecodeGraphs`` with the FlashInfer backend: the decode steps replay, the others run
    eagerly, and every step's logits equal the torch reference's eager run."""
    reference = runner_with(tiny, TorchReferenceBackend())
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024)
    runner = runner_with(tiny, backend)
    backend.init_cuda_graph_state = functools.partial(backend.init_cuda_graph_state, device="cpu")
    recorder = PlanCheckingRecorder(fake_flashinfer)
    graphs = runner.graphs = DecodeGraphs(runner.model, backend, runner.kv_caches, device="cpu", max_num_seqs=4,
                                          max_num_blocks_per_seq=MAX_LEN // BLOCK, block_size=BLOCK,
                                          scratch_block=SCRATCH, recorder=recorder)
    for i, step in enumerate(mixed_steps()):
        want, got = reference.execute(step), runner.execute(step)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"step {i}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {i}"
    assert graphs.num_replays == 4 and recorder.captures == len(graphs.sizes) == 3
    graph_plans = [e[0] for e in fake_flashinfer if e[1] == "plan" and e[0].startswith("decode-graph")]
    # one plan per captured size (its placeholder step), then one per replayed step
    assert graph_plans == ["decode-graph-4", "decode-graph-2", "decode-graph-1",
                           "decode-graph-2", "decode-graph-4", "decode-graph-4", "decode-graph-1"]
