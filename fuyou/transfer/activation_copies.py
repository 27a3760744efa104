"""Swapped activations between the device and host memory, on the copy streams.

Forward's saved-tensor pack hook copies each saved tensor off the device on the device-to-host
stream, ordered after the compute that wrote it, into host staging (pinned on CUDA): the training
thread does not wait for the copy. Backward copies it back on the host-to-device stream into memory
handed out for that stream (the FSDP pattern, as the weights), started one micro-batch ahead
(``upload``) so the copy overlaps the compute before it; compute waits only for the copy's event.
Tensors that come back from SSD (``activation_files``) start their copy back from host staging
(``back``) once their read has landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuyou.device.base import Backend, Event


@dataclass(eq=False)
class HostCopy:
    """One saved tensor off the device: its host copy, the event after that copy, and, once started,
    its copy back (the device tensor and the event after it)."""

    host: torch.Tensor
    landed: Event
    back: torch.Tensor | None = None
    ready: Event | None = None


class ActivationCopies:
    """Copies saved tensors off the device and back, on two copy streams; see the module docstring."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.d2h, self.h2d = backend.new_stream(), backend.new_stream()
        self.compute = backend.current_stream()

    def off(self, t: torch.Tensor) -> HostCopy:
        """Start copying device tensor ``t`` to host staging; ``t`` may be dropped at once."""
        host = self.backend.host_staging(tuple(t.shape), t.dtype)
        self.backend.record().wait(self.d2h)  # hazard: copying t before compute finished writing it
        landed = self.backend.copy(host, t, self.d2h)
        self.backend.keep_alive(t, self.d2h)  # hazard: t's memory reused while the copy still reads it
        return HostCopy(host, landed)

    def back(self, host: torch.Tensor, what: str) -> HostCopy:
        """Start copying ``host`` (filled on the host: no copy off the device to wait for) onto the
        device; ``take`` returns it. Raises DeviceMemoryError naming ``what`` past the capacity."""
        c = HostCopy(host, self.backend.record(self.h2d))
        self.upload(c, what)
        return c

    def upload(self, c: HostCopy, what: str) -> None:
        """Start copying ``c`` back onto the device (idempotent). Raises DeviceMemoryError naming
        ``what`` past the device capacity."""
        if c.back is not None:
            return
        dev = self.backend.device_empty(tuple(c.host.shape), c.host.dtype, what, stream=self.h2d)
        self.backend.keep_alive(dev, self.compute)  # hazard: the stream's pool refills it while compute reads it
        c.landed.wait(self.h2d)  # hazard: copying back host memory the copy off is still filling
        c.ready = self.backend.copy(dev, c.host, self.h2d)
        c.back = dev

    def take(self, c: HostCopy, what: str) -> torch.Tensor:
        """``c`` on the device, for compute (started now if ``upload`` was not called); the host copy
        is dropped."""
        self.upload(c, what)
        assert c.ready is not None and c.back is not None  # upload() started the copy back
        c.ready.wait(self.compute)  # hazard: compute reads the activation before its copy back landed
        t, c.back = c.back, None
        return t
