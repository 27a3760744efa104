"""The hardware profile: measured (``fuyou profile``) or hand-written JSON, what the cost model reads.

Every field is a plain number with its unit in the name or docstring (bytes, seconds, bytes/s,
FLOP/s). A hand-written profile needs at least ``ssd_read_Bps``, ``ssd_write_Bps``,
``adam_params_per_s`` and either measured ``compute`` points or ``device_peak_flops``; everything else
has a default. ``bench/profiles/lohan_4090.json`` is an example.

Device compute speed is given as achieved FLOP/s at a number of tokens per micro-batch (``compute``
points, FLOPs counted as ``shapes.BlockShape.fwd_flops_per_token``; backward = 2 × forward FLOPs);
between points it is interpolated linearly in tokens, outside them the nearest point holds. Without
points, ``device_peak_flops × flops_efficiency × tokens / (tokens + flops_half_tokens)``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from fuyou.errors import ConfigError

GiB = 1 << 30
INT8_ADAM_SHARE = 0.3
"""The 8-bit-moment update's speed ÷ the fp32 update's where a profile has no measured figure: 286 vs 963 M
params/s on 2 Zen 4 cores (session 21; compute-bound table lookups there, so more cores scale it)."""


@dataclass(frozen=True)
class ComputePoint:
    """Achieved device speed at one micro-batch size, measured on one block kind."""

    tokens: int
    """Tokens per micro-batch (micro-batch size × sequence length)."""
    fwd_flops_per_s: float
    """Forward FLOPs (matmul + attention scores) per second."""
    bwd_flops_per_s: float
    """Backward FLOPs (2 × forward) per second."""
    seq_len: int = 0
    """Sequence length of the measurement (0: unknown)."""


@dataclass(frozen=True)
class HardwareProfile:
    """One machine's speeds and sizes; see the module docstring."""

    ssd_read_Bps: float
    """Aggregate read bandwidth over all store directories (striped), bytes/s, O_DIRECT, concurrent."""
    ssd_write_Bps: float
    """Aggregate write bandwidth, bytes/s."""
    adam_params_per_s: float
    """Fused CPU AdamW throughput (fp32 master/m/v, bf16 grad in, bf16 weights out), parameters/s."""
    adam_int8_params_per_s: float = 0.0
    """The same with 8-bit moments (``--optimizer-state int8``: dequantize, AdamW, quantize on a split
    master), parameters/s; 0: ``INT8_ADAM_SHARE × adam_params_per_s`` (hand-written profiles)."""
    name: str = "unnamed"
    device: str = "cuda"
    """``cuda`` or ``cpu``; on ``cpu`` device compute, copies and Adam share the cores (one resource)."""
    device_peak_flops: float = 0.0
    """Datasheet or measured bf16 matmul peak, FLOP/s (MFU and the fallback compute model)."""
    flops_efficiency: float = 0.7
    """Fallback compute model: the large-GEMM fraction of ``device_peak_flops`` reached."""
    flops_half_tokens: int = 512
    """Fallback compute model: tokens per micro-batch at which half that fraction is reached."""
    compute: tuple[ComputePoint, ...] = ()
    """Measured decoder-layer speed by micro-batch tokens (sorted by tokens)."""
    head_compute: tuple[ComputePoint, ...] = ()
    """Measured head (norm + LM head + loss) speed; empty: the layer points are used."""
    h2d_Bps: float = 25e9
    """Host→device copy bandwidth from pinned memory, bytes/s (on ``cpu``: the memcpy rate)."""
    d2h_Bps: float = 25e9
    """Device→host copy bandwidth, bytes/s."""
    pageable_Bps: float = 0.0
    """Copy bandwidth of pageable (unpinned) activation swaps, bytes/s; 0: half of h2d/d2h."""
    host_mem_Bps: float = 10e9
    """Host memcpy rate (bytes copied per second, one side counted)."""
    device_mem_Bps: float = 1e12
    """Device memset/copy rate (zeroing gradient buffers), bytes/s; on ``cpu`` the host memcpy rate."""
    grad_add_elems_per_s: float = 0.0
    """Device rate of ``grad += g`` in the compute dtype, elements/s: autograd adding each micro-batch's
    fresh decoder-layer weight gradients into the engine's preset flat gradient buffer (the LM head adds
    inside its GEMM, the embedding's backward is sparse). 0: ``device_mem_Bps / 6`` (two bf16 reads, one
    write)."""
    grad_norm_elems_per_s: float = 0.0
    """Device rate of the per-block gradient norm (``fuyou.optim.norm.sum_squares``), elements/s.
    0: ``device_mem_Bps / 2`` (one bf16 read)."""
    device_memory_bytes: int = 24 * GiB
    """Device memory usable by Fuyou (the default ``--gpu-memory``)."""
    host_memory_bytes: int = 64 * GiB
    """Host RAM (the default ``--cpu-memory`` is 3/4 of it)."""
    ssd_capacity_bytes: int = 4 * 10**12
    """Total capacity of the SSDs holding the store, bytes (for drive-writes-per-day)."""
    ssd_count: int = 1
    ssd_dwpd_rating: float = 1.0
    """The drives' rated endurance, drive-writes per day over the warranty."""
    io_cpu_s_per_byte: float = 0.0
    """CPU time the SSD I/O path takes per byte moved (CPU-seconds of all its threads ÷ bytes: kernel
    time of O_DIRECT I/O, checksums). On the ``cpu`` device each of those seconds stalls compute for a
    whole second, not a second ÷ cores: torch splits each op evenly over every core and waits for the
    slowest part, so a core taken by I/O for t delays the op by t (``graph.StepGraph._ssd``). 0: not
    modelled (hand-written profiles, GPU machines)."""
    commit_s: float = 0.005
    """Time to commit a store version (fsync + atomic manifest), seconds."""
    layer_act_bytes_per_token: float = 0.0
    """Measured bytes a decoder layer saves for backward per token; 0: the shape formula."""
    lora_step_s: float = 0.0
    """Seconds of a LoRA run's adapter update on the device — the gradients' squared norm, clipping and
    AdamW over every adapter tensor (``fuyou.engine.lora``) — measured for the profiled model and rank
    (``measure.lora_step``); 0: not measured (hand-written profiles, full fine-tuning)."""
    compute_bytes: int = 2
    """Bytes per element of the dtype the compute points and activation bytes were measured in
    (2: bf16, 4: fp32)."""
    model_signature: str = ""
    """The model the compute points and activation bytes were measured on (``hidden×layers×vocab``)."""
    per_dir: tuple[dict, ...] = ()
    """Per store directory: ``{"dir", "read_Bps", "write_Bps"}`` (measured profiles)."""
    notes: dict = field(default_factory=dict)
    """Provenance: date, machine, method, sources (free form)."""

    def __post_init__(self) -> None:
        for k in ("compute", "head_compute"):  # sorted by tokens, whatever order they were given in
            object.__setattr__(self, k, tuple(sorted(getattr(self, k), key=lambda p: p.tokens)))
        problems = [
            f"{k} must be > 0, got {getattr(self, k)}"
            for k in (
                "ssd_read_Bps",
                "ssd_write_Bps",
                "adam_params_per_s",
                "h2d_Bps",
                "d2h_Bps",
                "host_mem_Bps",
                "device_mem_Bps",
            )
            if not getattr(self, k) > 0
        ]
        problems += [
            f"{k} must be >= 0 (0: derived from device_mem_Bps), got {getattr(self, k)}"
            for k in ("grad_add_elems_per_s", "grad_norm_elems_per_s")
            if not getattr(self, k) >= 0
        ]
        if not self.adam_int8_params_per_s >= 0:
            problems.append(f"adam_int8_params_per_s must be >= 0 (0: derived), got {self.adam_int8_params_per_s}")
        if self.device not in ("cuda", "cpu"):
            problems.append(f"device must be cuda or cpu, got {self.device!r}")
        if not self.compute and not self.device_peak_flops > 0:
            problems.append("give measured 'compute' points or 'device_peak_flops'")
        if problems:
            raise ConfigError(f"hardware profile {self.name!r}: " + "; ".join(problems))

    def adam_rate(self, quantized: bool) -> float:
        """Parameters/s of the CPU AdamW update: with 8-bit moments (``quantized``) or without."""
        if not quantized:
            return self.adam_params_per_s
        return self.adam_int8_params_per_s or INT8_ADAM_SHARE * self.adam_params_per_s

    # ------------------------------------------------------------------ per-element device work
    @property
    def grad_add_rate(self) -> float:
        """Elements/s of gradient accumulation (``grad_add_elems_per_s`` or its default)."""
        return self.grad_add_elems_per_s or self.device_mem_Bps / 6

    @property
    def grad_norm_rate(self) -> float:
        """Elements/s of the gradient norm (``grad_norm_elems_per_s`` or its default)."""
        return self.grad_norm_elems_per_s or self.device_mem_Bps / 2

    # ------------------------------------------------------------------ compute model
    def flops_per_s(self, tokens: int, backward: bool = False, head: bool = False) -> float:
        """Achieved device FLOP/s for a micro-batch of ``tokens`` tokens (see the module docstring)."""
        pts = (self.head_compute or self.compute) if head else self.compute
        if not pts:
            return self.device_peak_flops * self.flops_efficiency * tokens / (tokens + self.flops_half_tokens)
        rate = [(p.tokens, p.bwd_flops_per_s if backward else p.fwd_flops_per_s) for p in pts]
        if tokens <= rate[0][0]:
            return rate[0][1]
        for (t0, r0), (t1, r1) in zip(rate, rate[1:]):
            if tokens <= t1:
                return r0 + (r1 - r0) * (tokens - t0) / (t1 - t0)
        return rate[-1][1]

    @property
    def swap_Bps(self) -> tuple[float, float]:
        """(device→host, host→device) bandwidth of activation swaps, bytes/s."""
        if self.device == "cpu":
            return self.host_mem_Bps, self.host_mem_Bps
        if self.pageable_Bps:
            return self.pageable_Bps, self.pageable_Bps
        return self.d2h_Bps / 2, self.h2d_Bps / 2

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """Plain data (inverse of ``from_json``)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> HardwareProfile:
        """Build from plain data; unknown keys raise ConfigError naming them (typos stay visible).

        Keys starting with ``_`` are comments and ignored.
        """
        d = {k: v for k, v in d.items() if not k.startswith("_")}
        known = {f.name for f in dataclasses.fields(HardwareProfile)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"hardware profile: unknown field(s) {unknown}; known: {sorted(known)}")
        d = dict(d)
        for k in ("compute", "head_compute"):
            d[k] = tuple(
                sorted(
                    (p if isinstance(p, ComputePoint) else ComputePoint(**p) for p in d.get(k, ())),
                    key=lambda p: p.tokens,
                )
            )
        d["per_dir"] = tuple(d.get("per_dir", ()))
        try:
            return HardwareProfile(**d)
        except TypeError as e:
            raise ConfigError(f"hardware profile: {e}") from None


def save_profile(profile: HardwareProfile, path: str) -> None:
    """Write ``profile`` as indented JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=2)
        f.write("\n")


def load_profile(path: str) -> HardwareProfile:
    """Read a profile JSON file; raises ConfigError if unreadable or invalid."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read hardware profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"hardware profile {path} must be a JSON object")
    return HardwareProfile.from_json(data)
