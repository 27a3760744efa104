"""GPU tests share one process-wide allocator: each starts with its cache empty and peaks reset, and
ends uncapped (a capped backend sets torch's per-process memory fraction, which outlives it). fp32 is
IEEE fp32 in them: TF32 off for matmuls and convolutions (``bench/gpu_first_contact.sh`` also sets
``NVIDIA_TF32_OVERRIDE=0``), so a fidelity test on the GPU holds the CPU tests' tolerance."""

import gc
from collections.abc import Iterator

import pytest
import torch


def tf32_off() -> None:
    """Matmuls and cuDNN in IEEE fp32 (torch >= 2.9: the ``fp32_precision`` settings, never mixed with
    the legacy ``allow_tf32`` ones, which torch refuses to read back after a mix; older: ``allow_tf32``)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def uncapped_allocator() -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    tf32_off()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
