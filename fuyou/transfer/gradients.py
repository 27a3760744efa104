"""Finished block gradients device → host buffer, on the device-to-host copy stream.

Backward leaves each block's gradient as one flat device tensor; ``GradientOffload.offload`` copies
it into a pool buffer (class ``grads``: two buffers of the largest block's gradient, or a parked
gradient's own ``park/<b>`` buffer) and returns the buffer with the copy's event. The Adam stage
updates from that buffer; ``grad_park`` parks it in RAM or writes it on to SSD.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fuyou.device.base import Backend, Event
from fuyou.models.store_layout import ModelLayout
from fuyou.schedule.sizing import GRADS
from fuyou.timeline import Timeline
from fuyou.transfer.host_pool import HostBuffer, HostBufferPool


class GradientOffload:
    """Copies finished device gradients into host buffers; see the module docstring."""

    def __init__(
        self, backend: Backend, pool: HostBufferPool, layout: ModelLayout, timeline: Timeline, d2h_stream: object
    ) -> None:
        self.backend, self.pool, self.layout = backend, pool, layout
        self.timeline, self.stream = timeline, d2h_stream

    def offload(
        self, b: int, grad: torch.Tensor, cls: str = GRADS, after: Event | None = None
    ) -> tuple[HostBuffer, Event]:
        """Copy block ``b``'s flat device gradient into a host buffer of class ``cls``; ``after``: an
        event the gradient's last writer besides compute recorded (the ranks' reduce-scatter)."""
        buf = self.pool.acquire(cls)
        n = grad.numel()
        self.backend.record().wait(self.stream)  # hazard: copying the gradient before backward finished writing it
        if after is not None:
            after.wait(self.stream)  # hazard: copying the shard before the reduce-scatter wrote it
        with self.timeline.device_span(
            "d2h", self.layout.blocks[b].name, self.backend, self.stream, n * grad.element_size()
        ):
            copied = self.backend.copy(buf.view(grad.dtype, n), grad, self.stream)
            self.backend.keep_alive(grad, self.stream)  # hazard: the caller frees grad while the copy still reads it
        return buf, copied


class Offloads(Protocol):
    """Whatever copies gradients off the device: a ``GradientOffload``, or the Adam stage (which
    delegates to its own)."""

    def offload(
        self, b: int, grad: torch.Tensor, cls: str = GRADS, after: Event | None = None
    ) -> tuple[HostBuffer, Event]:
        """See ``GradientOffload.offload``."""
        ...
