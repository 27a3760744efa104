"""The engine's device-memory admission of a batch shape, by the model the planner predicts with
(``fuyou.schedule.device_memory``): before a step with a new shape allocates anything, its predicted
peak is held against the device's capacity and a shape that cannot fit is refused with one line.

Weights and gradients per block are the layout's own (exact); what a block saves and its transients
come from the model's description (``fuyou.models.description``), which the planner plans with too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fuyou.errors import ConfigError, DeviceMemoryError
from fuyou.models.description import describe_model
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule import device_memory, sizing
from fuyou.schedule.device_memory import DevicePeak
from fuyou.schedule.plan import Plan
from fuyou.units import format_size


def batch_peak(
    config: Any,
    layout: ModelLayout,
    plan: Plan,
    micro_batch: int,
    seq_len: int,
    accum: int,
    adapter_params: int = 0,
    device: str = "cpu",
    capacity: int = 0,
) -> DevicePeak | None:
    """The predicted device peak of a step of ``accum`` micro-batches of ``micro_batch × seq_len``
    tokens under ``plan`` on a device of ``capacity`` bytes (the loss's chunk follows it; 0: none);
    None for a model the planner cannot shape (the allocation itself then decides)."""
    try:
        shape = describe_model(
            config.to_dict(), expert_groups=max(1, plan.expert_groups), vocab_groups=plan.vocab_groups
        )
    except ConfigError:
        return None
    if [b.name for b in shape.blocks] != [b.name for b in layout.blocks]:
        return None
    fp = layout.footprint()
    cb = fp.compute_bytes
    blocks = []
    for b, blk in enumerate(shape.device_blocks(cb, seq_len, micro_batch)):
        own = [b] + [layout.index(o) for o in layout.blocks[b].borrows]
        weights = sum(fp.device_bytes(o) - _grad_device_bytes(fp, o) for o in own)
        grads = sum(_grad_device_bytes(fp, o) for o in own if layout.trains(o) and not plan.lora_base)
        blocks.append(dataclasses.replace(blk, weights=weights, grads=grads))
    run = device_memory.step_run(
        micro_batch, seq_len, accum, shape.hidden, cb, shape.vocab, adapter_params=adapter_params,
        shard_grad_bytes=cb * max(fp.numels) if fp.world > 1 else 0, device=device, device_bytes=capacity,
        held_bytes=shape.held_bytes(cb),
    )  # fmt: skip
    return device_memory.device_peak(blocks, device_memory.block_policies(plan, len(blocks)), run)


def _grad_device_bytes(fp: sizing.Footprint, b: int) -> int:
    """Device bytes of block ``b``'s gradient (gathered with its shard when sharded)."""
    return fp.grad_bytes(b) if fp.world == 1 else (fp.world + 1) * fp.grad_bytes(b)


def admit_batch(peak: DevicePeak | None, capacity: int, micro_batch: int, seq_len: int, accum: int) -> None:
    """Refuse a step whose predicted ``peak`` passes ``capacity`` (bytes): DeviceMemoryError, one
    line, naming the binding budget, the phase and every way out. Nothing is allocated yet."""
    if peak is None or peak.nbytes <= capacity:
        return
    raise DeviceMemoryError(
        f"device memory: a step of {accum} micro-batch{'es' if accum > 1 else ''} of {micro_batch} × {seq_len} tokens "
        f"needs about {format_size(peak.nbytes)} at its peak ({peak.phase}), the device budget is "
        f"{format_size(capacity)}; raise --gpu-memory to ≥ {format_size(peak.nbytes, up=True)}, lower --micro-batch-size "
        "or --seq-len, or keep fewer activations on the device (--activations recompute or swap_cpu)"
    )
