"""GPU tests share one process-wide allocator: each starts with its cache empty and peaks reset, and
ends uncapped (a capped backend sets torch's per-process memory fraction, which outlives it)."""

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def uncapped_allocator() -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
