"""The torch reference backend keeps a step's plan on the step's device.

Found on the first GPU run (2026-12-04, benchmarks/README.md): the decode rows' mask and a
chunk's context mask were built on the CPU, while the runner passes the block tables on the
model's device (model/runner.py), so every CUDA step with a decode row or a chunk after cached
context failed ("expected self and mask to be on the same device"), and with it the Triton and
CUDA-graph tests that take this backend as their reference. The meta device stands in for CUDA
here: a plan tensor made without the step's device lands on the CPU, and the test sees it.
The runner also makes its GPU current on the step thread (Triton launches on the current device).
"""

from __future__ import annotations

import threading

import torch

from refengine.kernels.attention import AttentionMetadata, TorchReferenceBackend


def test_the_plans_live_on_the_block_tables_device() -> None:
    # A chunk of 4 new tokens after 6 cached (a context mask), and two decode rows of different lengths.
    meta = AttentionMetadata(query_start_loc=[0, 4, 5, 6], seq_lens=[10, 9, 20],
                             block_tables=torch.zeros(3, 2, dtype=torch.int64, device="meta"),
                             slot_mapping=torch.zeros(6, dtype=torch.int64, device="meta"), block_size=16)
    backend = TorchReferenceBackend()
    backend.prepare(meta)
    prefills, decodes = backend._prefills, backend._decodes  # noqa: SLF001 - the plans are what is checked
    assert [plan.mask is not None for plan in prefills] == [True]
    tensors = [plan.mask for plan in prefills] + [plan.block_ids for plan in prefills]
    tensors += [t for plan in decodes for t in (plan.query_rows, plan.block_ids, plan.mask) if t is not None]
    assert len(tensors) >= 5
    assert {t.device.type for t in tensors} == {"meta"}


def test_the_runner_makes_its_gpu_current_on_each_thread_that_steps(monkeypatch) -> None:
    """Triton launches on the thread's current CUDA device, not on its tensors': on ``cuda:1`` the
    step thread must switch to it (it stayed on GPU 0, found by review; the building thread
    switches before its first GPU work, which needs a GPU to see). No GPU here:
    ``torch.cuda.set_device`` is recorded, and a CPU runner never calls it."""
    from refengine.config import EngineConfig
    from refengine.engine.engine import Engine
    from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
    from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

    calls: list[tuple[str, torch.device]] = []  # (thread, device)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((threading.current_thread().name,
                                                                                torch.device(device))))
    tokenizer = byte_fallback_tokenizer()
    model = make_tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=64)

    def run_briefly(device: str) -> None:
        engine = Engine(EngineConfig(max_model_len=64), model_config_from_hf(model), hf_weights(model), tokenizer,
                        model_fingerprint="tiny")
        engine.core.runner.device = device  # what a runner built for that device holds
        engine.start()
        engine.shutdown()

    run_briefly("cpu")
    assert calls == [], "a CPU runner switches no CUDA device"
    run_briefly("cuda:1")
    assert calls == [("refengine-step-loop", torch.device("cuda:1"))]
