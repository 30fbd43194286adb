"""Whether a kernel launch may use PDL (programmatic dependent launch), shared by every kernel family."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PDL_MIN_CAPABILITY = 9  # griddepcontrol needs sm90+


def pdl_supported(device: torch.device) -> bool:
    """PDL needs a CUDA tensor on sm90+, a Triton with gdc_wait, and no interpreter (it cannot run GDC)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= PDL_MIN_CAPABILITY
