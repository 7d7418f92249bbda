"""The dtype names configuration uses (``EngineConfig.dtype``), as torch dtypes."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
