"""Contract dtype names (``export.contract``) -> torch dtypes: the one table.

The exporter, the runtime's backends and executor, and the engine checks all
look dtypes up here. It lives apart from ``contract`` because the contract is
pure data (no torch), and apart from the model modules so that the runtime
can import it without the PyTorch model stack.
"""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
