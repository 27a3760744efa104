"""CPU AdamW for Fuyou: the reference oracle, the fused numba kernel, the worker.

``adamw_step`` (numba, fast) and ``adamw_step_reference`` (torch ops, readable) share one signature
and give bit-identical results; ``AdamWorker`` runs per-layer updates on a thread. The per-layer
state layout the engine streams (flat master/m/v per block, in chunks) is
``fuyou.models.store_layout.ModelLayout``.
"""

from fuyou.optim.adam_numba import adamw_int8_step, adamw_split_step, adamw_step
from fuyou.optim.args import AdamWHyper, StepCoefficients, step_coefficients
from fuyou.optim.buffers import OptimBufferError, check_int8_buffers
from fuyou.optim.numba_kernel import DEFAULT_CHUNK
from fuyou.optim.quant8 import adamw_int8_step_reference, int8_from_fp32
from fuyou.optim.reference import adamw_step_reference
from fuyou.optim.split import adamw_split_step_reference, split_decode, split_encode
from fuyou.optim.worker import AdamJob, AdamWorker, AdamWorkerError

__all__ = [
    "DEFAULT_CHUNK",
    "AdamJob",
    "AdamWHyper",
    "AdamWorker",
    "AdamWorkerError",
    "OptimBufferError",
    "StepCoefficients",
    "adamw_int8_step",
    "adamw_int8_step_reference",
    "adamw_split_step",
    "adamw_split_step_reference",
    "adamw_step",
    "adamw_step_reference",
    "check_int8_buffers",
    "int8_from_fp32",
    "split_decode",
    "split_encode",
    "step_coefficients",
]
