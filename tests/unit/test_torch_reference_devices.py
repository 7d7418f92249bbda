"""The torch reference backend keeps a step's plan on the step's device.

Found on the first GPU run (2026-12-04, benchmarks/README.md): the decode rows' mask and a
chunk's context mask were built on the CPU, while the runner passes the block tables on the
model's device (model/runner.py), so every CUDA step with a decode row or a chunk after cached
context failed ("expected self and mask to be on the same device"), and with it the Triton and
CUDA-graph tests that take this backend as their reference. The meta device stands in for CUDA
here: a plan tensor made without the step's device lands on the CPU, and the test sees it.
"""

from __future__ import annotations

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
