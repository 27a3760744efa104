"""The ranks a step runs on and the links between them, for the cost of collectives.

A ``Cluster`` is ``gpus_per_node × nodes`` data-parallel ranks (what ``torchrun --nproc-per-node
--nnodes`` launches). The hardware profile describes one rank: its device, its share of the host's
cores (CPU Adam) and memory, and its own SSDs. Collectives are modelled as NCCL's ring algorithms:
one all-gather or reduce-scatter takes ``latency_s + bytes moved per rank ÷ bus bandwidth``
(``fuyou.schedule.shards.collective_bytes``; the bus bandwidth is what ``nccl-tests`` reports as
``busbw``). Within a node that is the GPU interconnect; across nodes the ring crosses each node's
network link, so the slower of the two bounds it.

Link presets (``LINKS``) are stated, typical ``nccl-tests`` all-gather bus bandwidths, not
measurements of any machine: PCIe 4.0 x16 through the host's root complex ~20 GB/s, PCIe 5.0 ~40 GB/s,
H100 SXM NVLink 4 (NVSwitch) ~360 GB/s; a 200 Gb/s InfiniBand port per node ~24 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuyou.errors import ConfigError

GB = 1e9
LINKS: dict[str, float] = {"pcie4": 20 * GB, "pcie5": 40 * GB, "nvlink": 360 * GB, "ib200": 24 * GB}
"""Stated bus bandwidths (bytes/s) by name; see the module docstring."""


@dataclass(frozen=True)
class Cluster:
    """Data-parallel ranks and their links; the default is one rank (no collectives)."""

    gpus_per_node: int = 1
    nodes: int = 1
    intra_node_Bps: float = LINKS["pcie4"]
    """Bus bandwidth of collectives among one node's ranks, bytes/s."""
    inter_node_Bps: float = LINKS["ib200"]
    """Bus bandwidth of a ring crossing nodes (each node's network link), bytes/s."""
    latency_s: float = 30e-6
    """Fixed cost of one collective (launch and the ring's hops), seconds."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ConfigError(f"--gpus and --nodes must be ≥ 1, got {self.gpus_per_node} and {self.nodes}")
        if not (self.intra_node_Bps > 0 and self.inter_node_Bps > 0 and self.latency_s >= 0):
            raise ConfigError(
                f"link bandwidths must be > 0 and the latency ≥ 0, got {self.intra_node_Bps}, "
                f"{self.inter_node_Bps} bytes/s and {self.latency_s} s"
            )

    @property
    def world(self) -> int:
        """Ranks in all."""
        return self.gpus_per_node * self.nodes

    @property
    def bus_Bps(self) -> float:
        """Bus bandwidth of a ring over all ranks, bytes/s."""
        return self.intra_node_Bps if self.nodes == 1 else min(self.intra_node_Bps, self.inter_node_Bps)

    def collective_s(self, nbytes: float) -> float:
        """Seconds of one all-gather or reduce-scatter moving ``nbytes`` into (out of) each rank; 0 on
        one rank."""
        return 0.0 if self.world == 1 else self.latency_s + nbytes / self.bus_Bps


def link_Bps(value: str, option: str) -> float:
    """A link bandwidth from a preset name (``LINKS``) or a number of GB/s (``"50"``). Raises
    ConfigError naming ``option`` otherwise."""
    v = value.strip().lower()
    if v in LINKS:
        return LINKS[v]
    try:
        gbps = float(v.removesuffix("gb/s"))
    except ValueError:
        gbps = 0.0
    if not gbps > 0:
        raise ConfigError(f"{option} must be one of {', '.join(LINKS)} or a bandwidth in GB/s (e.g. 50), got {value!r}")
    return gbps * GB
