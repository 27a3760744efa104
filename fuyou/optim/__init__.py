"""CPU AdamW for Fuyou: the reference oracle, the fused numba kernel, per-layer state, the worker.

``adamw_step`` (numba, fast) and ``adamw_step_reference`` (torch ops, readable) share one signature
and give bit-identical results; ``AdamWorker`` runs per-layer updates on a thread; ``layer_layout``
describes how a layer's flat buffers and state extent are laid out.
"""

from fuyou.optim.adam_numba import adamw_step
from fuyou.optim.numba_kernel import DEFAULT_CHUNK
from fuyou.optim.args import AdamWHyper, StepCoefficients, step_coefficients
from fuyou.optim.buffers import OptimBufferError
from fuyou.optim.reference import adamw_step_reference
from fuyou.optim.state import (
    ALIGN_BYTES,
    ALIGN_ELEMS,
    LayerStateLayout,
    ParamSlot,
    init_state_extent,
    layer_layout,
)
from fuyou.optim.worker import AdamJob, AdamWorker, AdamWorkerError

__all__ = [
    "ALIGN_BYTES",
    "ALIGN_ELEMS",
    "DEFAULT_CHUNK",
    "AdamJob",
    "AdamWHyper",
    "AdamWorker",
    "AdamWorkerError",
    "LayerStateLayout",
    "OptimBufferError",
    "ParamSlot",
    "StepCoefficients",
    "adamw_step",
    "adamw_step_reference",
    "init_state_extent",
    "layer_layout",
    "step_coefficients",
]
