"""Swapped activations between the device and host memory, on the copy streams.

Forward's saved-tensor pack hook copies each saved tensor off the device on the device-to-host
stream, ordered after the compute that wrote it, into host staging (pinned on CUDA): the training
thread does not wait for the copy. Backward copies it back on the host-to-device stream into memory
handed out for that stream (the FSDP pattern, as the weights), started one micro-batch ahead
(``upload``) so the copy overlaps the compute before it; compute waits only for the copy's event.
Tensors that come back from SSD (``activation_files``) get their device memory when backward asks
for them a micro-batch ahead (``reserve``), whatever the read's timing, so the device's peak does not
depend on how fast the SSD answered; their copy back starts from host staging once the read landed.

Each copy is timed by the device on the timeline (``d2h`` off, ``h2d`` back, labelled with what the
caller names); compute's wait for a copy back is a ``gap`` in the compute span around it, not compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuyou.device.base import Backend, Event
from fuyou.timeline import Timeline


@dataclass(eq=False)
class HostCopy:
    """One saved tensor off the device: its host copy, the event after that copy (None: filled on the
    host, nothing to wait for), its device memory once reserved, and the event after its copy back."""

    host: torch.Tensor
    landed: Event | None
    back: torch.Tensor | None = None
    ready: Event | None = None


class ActivationCopies:
    """Copies saved tensors off the device and back, on two copy streams; see the module docstring."""

    def __init__(self, backend: Backend, timeline: Timeline) -> None:
        self.backend, self.timeline = backend, timeline
        self.d2h, self.h2d = backend.new_stream(), backend.new_stream()
        self.compute = backend.current_stream()

    def off(self, t: torch.Tensor, what: str = "activation") -> HostCopy:
        """Start copying device tensor ``t`` to host staging; ``t`` may be dropped at once. ``what``
        labels the copy on the timeline."""
        host = self.backend.host_staging(tuple(t.shape), t.dtype)
        self.backend.record().wait(self.d2h)  # hazard: copying t before compute finished writing it
        with self.timeline.device_span("d2h", what, self.backend, self.d2h, _nbytes(t)):
            landed = self.backend.copy(host, t, self.d2h)
        self.backend.keep_alive(t, self.d2h)  # hazard: t's memory reused while the copy still reads it
        return HostCopy(host, landed)

    def reserve(self, host: torch.Tensor, what: str) -> HostCopy:
        """Device memory for ``host`` (filled on the host, maybe later: no copy off the device to wait
        for); ``upload`` starts the copy once ``host`` holds the data. Raises DeviceMemoryError naming
        ``what`` past the capacity."""
        c = HostCopy(host, None)
        self._allocate(c, what)
        return c

    def _allocate(self, c: HostCopy, what: str) -> None:
        if c.back is None:
            c.back = self.backend.device_empty(tuple(c.host.shape), c.host.dtype, what, stream=self.h2d)
            self.backend.keep_alive(c.back, self.compute)  # hazard: the stream's pool refills it while compute reads it

    def upload(self, c: HostCopy, what: str) -> None:
        """Start copying ``c`` back onto the device (idempotent). Raises DeviceMemoryError naming
        ``what`` past the device capacity."""
        if c.ready is not None:
            return
        self._allocate(c, what)
        if c.landed is not None:
            c.landed.wait(self.h2d)  # hazard: copying back host memory the copy off is still filling
        assert c.back is not None  # allocated just now or reserved
        with self.timeline.device_span("h2d", what, self.backend, self.h2d, _nbytes(c.host)):
            c.ready = self.backend.copy(c.back, c.host, self.h2d)

    def take(self, c: HostCopy, what: str) -> torch.Tensor:
        """``c`` on the device, for compute (started now if ``upload`` was not called); the host copy
        is dropped. Taken again after the tensor it gave was dropped, ``c`` is copied back again."""
        if c.back is None and c.ready is not None:  # taken before: copy the host copy back again
            c.ready = None
        self.upload(c, what)
        assert c.ready is not None and c.back is not None  # upload() started the copy back
        with self.timeline.gap(self.compute):  # compute waiting for the copy is not compute
            c.ready.wait(self.compute)  # hazard: compute reads the activation before its copy back landed
        t, c.back = c.back, None
        return t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
