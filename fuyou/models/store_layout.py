"""How a model's training state is laid out in the store: two extents per block.

* ``w/<block>`` — the compute weights (bf16, or fp32 in fp32 mode), keyed by HF parameter name,
  read in forward and backward, written by Adam.
* ``s/<block>/<chunk>`` — the optimizer state as flat vectors over the same element positions as the
  ``w`` extent (the 64-byte gaps between tensors included, and zero), cut into chunks of at most
  ``state_chunk`` elements: the master (``master``, fp32; or with a split master the remainder ``rem``
  the compute weights drop, int16 beside bf16 weights, nothing beside fp32 ones), ``m`` and ``v`` (fp32
  or bf16), as the run's ``optimizer_state`` (``fuyou.schedule.state_format``) says. Adam runs chunk
  by chunk, so host memory for state is bounded by the chunk size, not by the largest block (a
  150k-token embedding), and writes the new compute weights straight into a ``w`` buffer.

Parameters frozen by ``--freeze`` in a block that still trains (``frozen_params``) are stored apart, in
a read-only extent ``f/<block>`` with the same layout rules: no optimizer state, no gradient, never
rewritten. Where the checkpoint is wider than the compute dtype (fp32 weights computed in bf16), the
frozen values are also kept as they came, in fp32 chunks ``o/<block>/<chunk>`` (``origin``), which only
export reads: a weight that never trains leaves the run bit-identical. On the device the block's weights are one vector, the trained part then the frozen part
(``device_numel``); its gradient covers the trained part only (``full_numel``).

The family's persistent buffers (``BlockSpec.buffers``: DeepSeek-V3's router biases) are no parameters:
each block's are in one extent ``k/<block>``, in the dtype the family keeps them in (fp32 where
``transformers`` keeps them so, else the compute dtype), written by the import, read once per run into
device memory and by export; every rank holds them whole.

With data-parallel ranks (``world`` > 1) each rank stores only its shard of every block's flat vector
(``fuyou.schedule.shards``): ``w/<block>`` is then one flat tensor ``shard`` of ``numel(b)`` elements
(the last rank's zero-padded), and the state chunks cover the shard. The device works on the
gathered vector of ``full_numel(b)`` elements, laid out like the one-rank ``w`` extent (``unflatten``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fuyou.models.blocks import BlockSpec
from fuyou.schedule import shards
from fuyou.schedule.sizing import Footprint, staged_offset, state_chunks
from fuyou.schedule.state_format import FORMATS, StateFormat
from fuyou.storage.extents import ExtentSpec, TensorSpec, dtype_from_name


def origin_wanted(compute: torch.dtype, source: torch.dtype | None, any_frozen: bool) -> bool:
    """Whether frozen parameters need their checkpoint values kept apart (``ModelLayout.origin``): some
    parameter is frozen and the checkpoint's dtype (``source``; None: unknown, taken as fp32) is not the
    compute dtype, so the compute copy would round them (fp32 computed in bf16)."""
    return any_frozen and compute != torch.float32 and (source or torch.float32) != compute


def elem_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelLayout:
    """Extents of every block for a compute dtype and an optimizer-state format."""

    blocks: tuple[BlockSpec, ...]
    compute_dtype: torch.dtype = torch.bfloat16
    optimizer_state: StateFormat = FORMATS["fp32"]
    state_chunk: int = 1 << 23
    """Elements per optimizer-state chunk (8 Mi: 96 MiB of fp32 master+m+v); a multiple of 32."""

    rank: int = 0
    """This process's data-parallel rank."""
    world: int = 1
    """Data-parallel ranks the blocks are sharded over (1: no sharding)."""
    lora_base: bool = False
    """A LoRA run's frozen base: compute weights only, no optimizer-state extents."""
    adapter_bytes: int = 0
    """Bytes of the LoRA adapters' extent (``fuyou.engine.lora``), which host sizing stages (0: none)."""
    frozen_blocks: frozenset[int] = frozenset()
    """Blocks whose every parameter is frozen (``--freeze``): compute weights only, like a ``lora_base``."""
    frozen_params: frozenset[str] = frozenset()
    """Keys of the parameters ``--freeze`` freezes (``fuyou.models.freeze.frozen_keys``); in a block that
    trains they live in its read-only extent ``f(b)``."""
    origin: bool = False
    """Frozen parameters are also kept exactly as the checkpoint had them, in fp32 (``o(b, c)``): set when
    the checkpoint's dtype is not the compute dtype (an fp32 model computed in bf16), so that a weight that
    never trains comes out of export bit-identical (``origin_wanted``). Read by export only, never in a step."""

    def trains(self, b: int) -> bool:
        """Whether block ``b`` has optimizer state and is updated (not ``frozen``, not in ``frozen_blocks``)."""
        return not self.lora_base and b not in self.frozen_blocks

    def gets_gradients(self, b: int) -> bool:
        """Whether backward computes block ``b``'s weight gradients and hands them off: it, or a block it
        borrows (the head's tied embedding), is updated (``trains``). Never for a LoRA base."""
        return any(self.trains(o) for o in [b] + [self.index(n) for n in self.blocks[b].borrows])

    def __post_init__(self) -> None:
        if self.state_chunk <= 0 or self.state_chunk % 32:
            raise ValueError(f"state chunk must be a positive multiple of 32 elements, got {self.state_chunk}")
        shards.shard_range(1, self.rank, self.world)  # raises ConfigError for a rank outside the world

    @functools.cached_property
    def _parts_of(self) -> dict[int, tuple[ExtentSpec, ExtentSpec | None]]:
        """``_parts`` by block, filled as asked (the engine asks per block, several times a step)."""
        return {}

    def _parts(self, b: int) -> tuple[ExtentSpec, ExtentSpec | None]:
        """Block ``b``'s parameters keyed by HF name as the device sees them (the gathered vectors): the
        trained ones, and the frozen ones of a block that trains (None if there are none)."""
        got = self._parts_of.get(b)
        if got is None:
            got = self._parts_of[b] = self._split(b)
        return got

    def _split(self, b: int) -> tuple[ExtentSpec, ExtentSpec | None]:
        whole = self.blocks[b].extent("w/", self.compute_dtype)
        frozen = tuple(t for t in whole.tensors if t.name in self.frozen_params)
        if not frozen or not self.trains(b):
            return whole, None
        trained = tuple(t for t in whole.tensors if t.name not in self.frozen_params)
        return ExtentSpec(whole.name, trained), ExtentSpec(f"f/{self.blocks[b].name}", frozen)

    def _hf(self, b: int) -> ExtentSpec:
        return self._parts(b)[0]

    def _hf_numel(self, b: int) -> int:
        return -(-self._hf(b).nbytes // elem_size(self.compute_dtype))

    def _frozen_hf_numel(self, b: int) -> int:
        part = self._parts(b)[1]
        return 0 if part is None else -(-part.nbytes // elem_size(self.compute_dtype))

    def w(self, b: int) -> ExtentSpec:
        """The compute-weight extent of block ``b``: its tensors by HF name, or (sharded) this rank's
        shard as one flat tensor ``shard``."""
        if self.world == 1:
            return self._hf(b)
        return ExtentSpec(f"w/{self.blocks[b].name}", (TensorSpec("shard", (self.numel(b),), self.compute_dtype),))

    def f(self, b: int) -> ExtentSpec | None:
        """The read-only extent of block ``b``'s frozen parameters (``frozen_params`` in a block that
        trains; by HF name, or sharded this rank's shard ``shard``), or None if it has none."""
        part = self._parts(b)[1]
        if part is None or self.world == 1:
            return part
        return ExtentSpec(part.name, (TensorSpec("shard", (self.frozen_numel(b),), self.compute_dtype),))

    def frozen_numel(self, b: int) -> int:
        """Elements of ``f(b)`` (this rank's shard when sharded); 0 without one."""
        n = self._frozen_hf_numel(b)
        return shards.shard_len(n, self.world) if n else 0

    def device_numel(self, b: int) -> int:
        """Elements of block ``b``'s gathered weight vector on the device: the trained part
        (``full_numel``), then the frozen part, each padded to ``world`` shards."""
        n = self._frozen_hf_numel(b)
        return self.full_numel(b) + (shards.padded_numel(n, self.world) if n else 0)

    def frozen_offset(self, b: int) -> int:
        """Byte offset of ``f(b)``'s data in a host buffer holding block ``b``'s weights (``sizing.staged_offset``)."""
        return staged_offset(self.w(b).nbytes)

    def numel(self, b: int) -> int:
        """Elements of block ``b``'s flat vectors this rank stores and updates (the ``w`` extent in
        compute-dtype elements): the whole block on one rank, else ``shards.shard_len``."""
        return shards.shard_len(self._hf_numel(b), self.world)

    def full_numel(self, b: int) -> int:
        """Elements of block ``b``'s gathered flat vector on the device (weights, gradient): the whole
        block, zero-padded to ``world × numel(b)`` when sharded."""
        return shards.padded_numel(self._hf_numel(b), self.world)

    def shard_start(self, b: int) -> int:
        """Position of this rank's first element in block ``b``'s gathered vector."""
        return self.rank * self.numel(b) if self.world > 1 else 0

    def chunks(self, b: int) -> list[tuple[int, int]]:
        """Element ranges [lo, hi) of block ``b``'s optimizer-state chunks."""
        return state_chunks(self.numel(b), self.state_chunk)

    def s(self, b: int, c: int) -> ExtentSpec:
        """Chunk ``c`` of block ``b``'s optimizer state: the tensors its format keeps (``StateFormat.parts``:
        the master or a split master's remainder, m, v, 8-bit moments' block scales)."""
        lo, hi = self.chunks(b)[c]
        parts = self.optimizer_state.parts(hi - lo, elem_size(self.compute_dtype))
        return ExtentSpec(
            f"s/{self.blocks[b].name}/{c}", tuple(TensorSpec(k, (n,), dtype_from_name(dt)) for k, n, dt in parts)
        )

    def origin_chunks(self, b: int) -> list[tuple[int, int]]:
        """Element ranges [lo, hi) of block ``b``'s ``o`` extents: its frozen vector (the whole block's ``w``
        vector if it does not train, else its ``f`` part's; this rank's) in pieces of at most half of it, so
        import stages each through a weights buffer; none without ``origin``."""
        m = self.frozen_numel(b) if self.trains(b) else self.numel(b)
        if not self.origin or not m:
            return []
        piece = max(32, m // 64 * 32)  # ≤ m/2 elements: in fp32 a piece fits the host buffer that stages m in bf16
        return state_chunks(m, piece)

    def o(self, b: int, c: int) -> ExtentSpec:
        """Chunk ``c`` of block ``b``'s frozen values as the checkpoint had them, in fp32 (``origin``)."""
        lo, hi = self.origin_chunks(b)[c]
        return ExtentSpec(f"o/{self.blocks[b].name}/{c}", (TensorSpec("origin", (hi - lo,), torch.float32),))

    def k(self, b: int) -> ExtentSpec | None:
        """The extent of block ``b``'s persistent buffers (``BlockSpec.buffers``), each in the dtype the
        family keeps it in; None if it has none. Never sharded."""
        bufs = self.blocks[b].buffers
        if not bufs:
            return None
        specs = (TensorSpec(x.key, x.shape, x.dtype(self.compute_dtype)) for x in bufs)
        return ExtentSpec(f"k/{self.blocks[b].name}", tuple(specs))

    def footprint(self) -> Footprint:
        """What host-memory sizing (``fuyou.schedule.sizing``) needs of this layout."""
        nb = range(len(self.blocks))
        head = self.blocks[-1]
        return Footprint(
            tuple(self.w(b).nbytes for b in nb),
            tuple(self.numel(b) for b in nb),
            elem_size(self.compute_dtype),
            self.optimizer_state,
            tuple(self.index(o) for o in head.borrows),
            self.world,
            self.adapter_bytes,
            tuple(sorted(self.frozen_blocks)),
            tuple(self.frozen_numel(b) for b in nb) if self.frozen_params else (),
        )

    def extents(self) -> list[ExtentSpec]:
        """Every extent, block by block."""
        out = []
        for b in range(len(self.blocks)):
            out.append(self.w(b))
            f = self.f(b)
            if f is not None:
                out.append(f)
            if self.trains(b):
                out += [self.s(b, c) for c in range(len(self.chunks(b)))]
            out += [self.o(b, c) for c in range(len(self.origin_chunks(b)))]
            k = self.k(b)
            if k is not None:
                out.append(k)
        return out

    def index(self, name: str) -> int:
        """Block index of block ``name``."""
        return [blk.name for blk in self.blocks].index(name)

    def flatten_into(
        self, b: int, tensors: dict[str, torch.Tensor], out: torch.Tensor, lo: int, hi: int, frozen: bool = False
    ) -> None:
        """Write elements [lo, hi) of block ``b``'s flat vector into ``out`` (``hi - lo`` elements,
        any dtype), gaps between tensors zeroed; converts one tensor slice at a time, so the whole
        block is never held a second time. Positions are this rank's (``shard_start`` adds up).
        ``frozen``: of its frozen part's vector (``f(b)``; ValueError if it has none)."""
        ext, size = self._parts(b)[1] if frozen else self._hf(b), elem_size(self.compute_dtype)
        if ext is None:
            raise ValueError(f"block {self.blocks[b].name} has no frozen part")
        base = self.rank * self.frozen_numel(b) if frozen else self.shard_start(b)
        lo, hi = lo + base, hi + base
        out.zero_()
        for t, off in zip(ext.tensors, ext.offsets):
            a, z = max(off // size, lo), min((off + t.nbytes) // size, hi)
            if z > a:
                src = tensors[t.name].reshape(-1)[a - off // size : z - off // size]
                out[a - lo : z - lo].copy_(src)

    def decay_runs(self, b: int, no_decay: frozenset[str]) -> list[tuple[int, int, bool]]:
        """Element ranges [lo, hi) of block ``b`` with whether weight decay applies (tensors in
        ``no_decay`` get none; the gaps between tensors and the shard padding, always zero, count as
        decayed). Positions are this rank's."""
        ext, size = self._hf(b), elem_size(self.compute_dtype)
        runs: list[tuple[int, int, bool]] = []
        pos = 0
        for t, off in zip(ext.tensors, ext.offsets):
            lo, hi, decay = off // size, (off + t.nbytes) // size, t.name not in no_decay
            for a, z, d in ((pos, lo, True), (lo, hi, decay)):
                if z > a:
                    if runs and runs[-1][2] == d and runs[-1][1] == a:
                        runs[-1] = (runs[-1][0], z, d)
                    else:
                        runs.append((a, z, d))
            pos = hi
        if pos < self.full_numel(b):
            runs.append((pos, self.full_numel(b), True))
        lo, hi = self.shard_start(b), self.shard_start(b) + self.numel(b)
        return [(max(a, lo) - lo, min(z, hi) - lo, d) for a, z, d in runs if min(z, hi) > max(a, lo)]

    def unflatten(self, b: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of each parameter in block ``b``'s gathered vector ``flat``: of ``device_numel``
        elements, every parameter (weights, masters); of ``full_numel``, the trained ones (gradients)."""
        trained, frozen = self._parts(b)
        size = elem_size(self.compute_dtype)
        parts = [(trained, 0)] + (
            [(frozen, self.full_numel(b))] if frozen is not None and flat.numel() > self.full_numel(b) else []
        )
        return {
            t.name: flat[base + off // size : base + off // size + t.nbytes // size].view(t.shape)
            for ext, base in parts
            for t, off in zip(ext.tensors, ext.offsets)
        }
