"""The one table from the spec's dtype names (`precision.*`) to torch dtypes.

fp8 is not here on purpose: it is a matmul format (torchao's Float8Linear), never a parameter or reduce dtype.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
