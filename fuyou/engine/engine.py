"""The training engine's Python API: build from a model, ``train_step``, ``export``, ``close``.

    engine = Engine.from_pretrained("path/to/hf-model", EngineConfig(ssd_dirs=("/mnt/nvme0/run",)))
    stats = engine.train_step(input_ids, labels)      # loss, grad norm, tokens/s, busy time per resource
    engine.set_lr(2e-5); engine.export("out/model"); engine.close()

The model is built on the meta device; its weights go block by block into the SSD store (bf16
compute copy + fp32 master + zeroed m/v) and never sit whole in RAM.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import torch

from fuyou.device import get_backend
from fuyou.device.base import Backend
from fuyou.engine import updates
from fuyou.engine.adam_stage import AdamStage
from fuyou.engine.assembly import assemble_model
from fuyou.engine.balance import StepBalance, balance_rule
from fuyou.engine.config import EngineConfig
from fuyou.engine.device_admission import admit_batch, batch_peak
from fuyou.engine.export import HF_FILES, export_dtype, export_layout, iter_master
from fuyou.engine.family_buffers import hold_buffers, write_buffers
from fuyou.engine.lora import LoraState
from fuyou.engine.step import StepContext, StepIO, StepResult, StepRunner, StepState
from fuyou.engine.updates import Progress
from fuyou.engine.vocab_loss import IGNORE, shifted
from fuyou.errors import ConfigError, DeviceMemoryError, ManifestError
from fuyou.models.adapters import seed_context
from fuyou.models.blocks import BlockSpec, parse_slice
from fuyou.models.hf_io import (
    TOKENIZER_FILES,
    CheckpointReader,
    ModelFileError,
    keep_untrained,
    load_config,
    widest_float,
)
from fuyou.models.lora import is_lora
from fuyou.models.multimodal import is_multimodal_store, runtime_part
from fuyou.models.store_layout import elem_size
from fuyou.optim import AdamWHyper
from fuyou.optim.split import split_encode, write_flags
from fuyou.schedule import rules, sizing
from fuyou.schedule.device_memory import DevicePeak
from fuyou.storage.cpu_meter import ACT_DIR_NAME
from fuyou.storage.dirs import rank_dirs
from fuyou.storage.run_meta import StoreMeta
from fuyou.storage.store import TensorStore
from fuyou.timeline import Timeline
from fuyou.transfer.activation_files import ActivationSpace
from fuyou.transfer.collectives import Collectives, world_size
from fuyou.transfer.grad_park import GradientParking
from fuyou.transfer.host_pool import HostBufferPool
from fuyou.transfer.ram_tier import RamTier, refuse_stale
from fuyou.transfer.weights import WeightLoader
from fuyou.units import format_size

_PIECE = 1 << 18
"""Elements of the fp32 pieces a split master's remainders are imported through."""


class Engine:
    """Out-of-core trainer for one causal LM; see the module docstring."""

    def __init__(
        self,
        config: Any,
        cfg: EngineConfig,
        tensors: Callable[[list[str]], dict[str, torch.Tensor]] | None,
        source_dir: str | None = None,
        store: TensorStore | None = None,
        lora_init: dict[str, torch.Tensor] | None = None,
        source_dtype: torch.dtype | None = None,
        source: CheckpointReader | None = None,
    ) -> None:
        """Build the engine; with ``store`` (an opened store of an earlier run) resume from it, else
        create a new store in ``cfg.ssd_dirs`` and import ``tensors`` block by block. With
        ``cfg.lora``, LoRA adapters train on the frozen base, starting from ``lora_init`` (by ``peft``
        parameter name), ``peft``'s initialisation, or the resumed store's (the same on every rank).
        ``source_dtype``: the checkpoint's dtype (``checkpoint_dtype``; None: fp32), which export writes by
        default and frozen parameters keep exactly (``ModelLayout.origin``); a resumed store's is recorded.
        ``source``: the reader of ``source_dir`` that ``tensors`` reads through (its index is read once;
        None: one is opened where needed). Raises ConfigError for a store trained with other LoRA settings."""
        self.cfg, self.source_dir = cfg, source_dir
        self.progress = Progress(step=0, lr=cfg.lr)
        self.max_grad_norm = cfg.max_grad_norm
        if cfg.lora is None and store is not None and any(e.name == LoraState.EXTENT for e in store.extents):
            raise ConfigError(
                f"the store in {store.dirs[0]} holds LoRA adapters; resume with the --lora-* settings it was trained with"
            )
        self.balance = balance_rule(config, cfg.moe_balance)
        """A mixture of experts' balance loss (None: a dense model, ``--moe-balance off`` or no coefficient)."""
        self.backend = get_backend(cfg.device, cfg.gpu_bytes)
        self.timeline = Timeline()
        self.comm = Collectives.join(self.backend, self.timeline)
        """The data-parallel ranks' collectives (``torchrun``; ``OneRank`` for one process)."""
        parts = assemble_model(config, cfg, self.backend, self.comm, store, lora_init, source_dtype)
        self.adapter, self.lora, self.plan, self.layout = parts.adapter, parts.lora, parts.plan, parts.layout
        self.source_dtype = parts.source_dtype
        if parts.stored is not None:
            self.progress.step = parts.stored.step
        self._admitted: set[tuple[int, int, int]] = set()
        """Batch shapes (micro-batch, tokens, micro-batches) the device-memory model admitted."""
        self.predicted_peak: DevicePeak | None = None
        """The largest device peak the model predicted for a step admitted so far (None: none yet)."""
        if cfg.batch is not None:  # before the store exists: a refused step leaves nothing behind
            self._admit_shape(*cfg.batch)
        self._setup_store(cfg, store)
        self._setup_data_path(cfg)
        if store is None:
            assert tensors is not None  # a new store is filled from the model's tensors
            try:
                self._save_model_files(source)
                self._import(tensors)
            except BaseException:
                self._discard_new_store()
                raise
        self.adapter.held = hold_buffers(self.tier, self.layout, self.backend)

    def _setup_store(self, cfg: EngineConfig, store: TensorStore | None) -> None:
        """The host buffer pool (every buffer class reserved up front), the store (a new one, or the
        resumed ``store``) and the RAM tier in front of it (loaded when resuming)."""
        rank, world = self.comm.rank, self.comm.world
        self.pool = HostBufferPool(self.backend, cfg.cpu_bytes)
        for c in sizing.buffer_classes(self.layout.footprint(), self.plan):
            self.pool.reserve(c.name, c.nbytes, c.count)
        self.store = store or TensorStore.create(
            rank_dirs(cfg.ssd_dirs, rank, world),
            self.layout.extents() + self.lora.extents(),
            io=cfg.io,
            direct=cfg.direct,
            checksums=cfg.checksums,
            overwrite=True,
        )
        try:
            self.tier = RamTier(
                self.store,
                self.pool,
                self.layout,
                self.timeline,
                self.plan.ram_weight_blocks,
                self.plan.ram_state_blocks,
                self.comm.min_int if world > 1 else None,  # several ranks commit only what all committed
            )
            if store is not None:
                self.tier.load()
                self.lora.load_from(self.store, self.progress.step, self.pool)
        except BaseException:
            if store is None:
                self.store.close()
            raise

    def _setup_data_path(self, cfg: EngineConfig) -> None:
        """The stages a step drives, each given its collaborators at construction: the Adam stage, the
        gradient parking, the activation space, the update policy, the weight loader and the step runner."""
        self.compute_stream = self.backend.current_stream()  # forward/backward run on torch's current stream
        hyper = AdamWHyper(cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay)
        self.stage = AdamStage(
            self.tier,
            self.backend,
            self.pool,
            self.layout,
            hyper,
            self.timeline,
            self.backend.new_stream(),
            cfg.adam_threads,
            cfg.no_decay,
        )
        self.parking = GradientParking(
            self.stage,
            self.pool,
            self.layout,
            self.store.io,
            self.store.dirs,
            self.store.direct,
            self.timeline,
            rules.parked_on_ssd(len(self.layout.blocks), self.plan),
            cfg.checksums,
        )
        self.act_space = ActivationSpace(
            self.backend, self.pool, self.store.io, self.store.dirs, self.store.direct, self.timeline
        )
        lay = self.layout
        last = min((b for b in range(len(lay.blocks)) if lay.gets_gradients(b)), default=-1)
        self.updates = updates.for_run(
            updates.UpdateContext(
                self.plan,
                self.backend,
                self.stage,
                self.parking,
                self.tier,
                self.comm,
                self.progress,
                self.commit_meta,
                self.max_grad_norm,
            ),
            self.lora,
            last_gradient=last,
        )
        """What happens to completed gradients (``fuyou.engine.updates``), chosen once."""
        self.loader = WeightLoader(
            self.tier,
            self.backend,
            self.pool,
            self.layout,
            self.timeline,
            self.plan.prefetch_depth,
            self.backend.new_stream(),
            self.compute_stream,
            self.comm,
            self.stage.new_weights,
            self.updates.gate,
        )
        self.runner = StepRunner(
            StepContext(
                self.layout,
                self.plan,
                self.adapter,
                self.backend,
                self.loader,
                self.act_space,
                self.timeline,
                self.compute_stream,
                self.comm,
                self.updates,
            )
        )

    @property
    def step(self) -> int:
        """Updates applied so far."""
        return self.progress.step

    @property
    def lr(self) -> float:
        """Learning rate of the next update(s) (``set_lr``)."""
        return self.progress.lr

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_dir: str, cfg: EngineConfig) -> Engine:
        """Stream a Hugging Face model directory (config.json + safetensors) into a new store."""
        config = load_config(model_dir)
        reader = CheckpointReader(model_dir, getattr(config, "model_type", None))

        def block_tensors(keys: list[str]) -> dict[str, torch.Tensor]:
            out = {k: reader.get(k).clone() for k in keys}  # an expert group's slice keys: its rows only
            reader.close()  # one block at a time: never keep the checkpoint mapped
            return out

        return cls(config, cfg, block_tensors, source_dir=model_dir, source_dtype=reader.dtype(), source=reader)

    @classmethod
    def resume(cls, cfg: EngineConfig) -> Engine:
        """Reopen the store in ``cfg.ssd_dirs`` at its last committed step and continue from there.

        The model config comes from the store; precision and state layout are the store's (a
        different ``precision`` in ``cfg`` raises ConfigError). Raises ManifestError if the
        directories hold no Fuyou training store, StoreError if its last committed step kept extents
        in host RAM that were never written back (``ram_tier_stale``: resume from a checkpoint).
        Several ranks (torchrun) each reopen their own store; a rank that a crash left one step ahead of
        the others goes back to the step they hold (kept until all confirmed it), with a FuyouWarning.
        """
        store = TensorStore.open(
            rank_dirs(cfg.ssd_dirs, *_rank_world()), io=cfg.io, direct=cfg.direct, checksums=cfg.checksums
        )
        files = os.path.join(store.dirs[0], HF_FILES)
        try:
            if not os.path.isdir(files) or "compute_dtype" not in store.meta:
                raise ManifestError(f"{store.dirs[0]} holds no Fuyou training state to resume from")
            refuse_stale(store.meta, store.dirs[0])
            return cls(load_config(files), cfg, None, source_dir=files, store=store)
        except BaseException:
            store.close()
            raise

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor], cfg: EngineConfig) -> Engine:
        """Build from an in-memory state dict (tests, the Trainer plugin); copies go block by block."""
        lora = {k: v for k, v in state_dict.items() if is_lora(k)}
        dtype = widest_float(v.dtype for k, v in state_dict.items() if k not in lora)
        return cls(
            config, cfg, lambda keys: {k: _entry(state_dict, k) for k in keys}, lora_init=lora, source_dtype=dtype
        )

    def _import(self, tensors: Callable[[list[str]], dict[str, torch.Tensor]]) -> None:
        """Write every block's weights and zeroed state to the store (and the RAM tier's copies), one
        block's source at a time, converting through the pool's own buffers (so import stays inside
        the host budget). The first committed version is complete."""
        for b, blk in enumerate(self.layout.blocks):
            src = tensors([p.key for p in blk.params] + [x.key for x in blk.buffers])
            _check_shapes(blk, src, self.source_dir)
            self._import_block(b, src)
        self.lora.save_to(self.store, self.pool)
        self.tier.commit(self.commit_meta())

    def _import_block(self, b: int, src: dict[str, torch.Tensor]) -> None:
        lay = self.layout
        n = lay.numel(b)
        buf = self.pool.acquire(sizing.WEIGHTS)
        try:
            w = buf.data[: n * elem_size(lay.compute_dtype)]
            lay.flatten_into(b, src, w.view(lay.compute_dtype), 0, n)
            self.tier.write_through(lay.w(b).name, w).result()
            f, nf = lay.f(b), lay.frozen_numel(b)
            if f is not None:  # the block's frozen parameters: written once, here
                w = buf.data[: nf * elem_size(lay.compute_dtype)]
                lay.flatten_into(b, src, w.view(lay.compute_dtype), 0, nf, frozen=True)
                self.tier.write_through(f.name, w).result()
        finally:
            self.pool.release(buf)
        write_buffers(self.tier, lay, b, src)
        chunks = [(lay.s(b, c), "master", lo, hi, sizing.STATE) for c, (lo, hi) in enumerate(lay.chunks(b))]
        origin = [(lay.o(b, c), "origin", lo, hi, sizing.WEIGHTS) for c, (lo, hi) in enumerate(lay.origin_chunks(b))]
        for ext, field, lo, hi, kind in (chunks if lay.trains(b) else []) + origin:
            buf = self.pool.acquire(kind)
            try:
                s = buf.data[: ext.nbytes]
                s.zero_()
                views = ext.views(s)
                if field in views:
                    lay.flatten_into(b, src, views[field], lo, hi, frozen=field == "origin" and lay.trains(b))
                elif "rem" in views:  # a split master: the remainders of the source's fp32 values
                    self._import_remainders(b, src, views, lo, hi)
                self.tier.write_through(ext.name, s).result()
            finally:
                self.pool.release(buf)

    def _import_remainders(self, b: int, src: dict[str, torch.Tensor], views: dict, lo: int, hi: int) -> None:
        """A split master's state chunk [lo, hi) of block ``b`` from its source values: the remainders the
        bf16 weights drop, and the tie flags in v's sign bits (``fuyou.optim.split``). Goes through fp32
        pieces of ``_PIECE`` elements (1 MiB), so no chunk-sized copy is made beside the pool's buffer."""
        for a in range(lo, hi, _PIECE):
            z = min(a + _PIECE, hi)
            master = torch.empty(z - a, dtype=torch.float32)
            self.layout.flatten_into(b, src, master, a, z)
            _, code, flag = split_encode(master)
            views["rem"][a - lo : z - lo] = code
            write_flags(views["rem"][a - lo : z - lo], views["v"][a - lo : z - lo], flag)

    def commit_meta(self) -> dict:
        """What each committed store version records (``StoreMeta``, as JSON)."""
        return self.store_meta().to_json()

    def store_meta(self) -> StoreMeta:
        """This run's record for its store: progress, and the layout facts resume and export need."""
        lay = self.layout
        return StoreMeta(
            step=self.step,
            lr=self.lr,
            compute_dtype=lay.compute_dtype,
            optimizer_state=lay.optimizer_state.name,
            state_chunk=lay.state_chunk,
            source_dtype=self.source_dtype,
            origin=lay.origin,
            rank=lay.rank,
            world=lay.world,
            lora_base=lay.lora_base,
            expert_groups=self.plan.expert_groups,
            vocab_groups=self.plan.vocab_groups,
            freeze=tuple(self.cfg.freeze),
        )

    def _discard_new_store(self) -> None:
        """After a failed import (a checkpoint that does not match its config, a full disk): close
        everything and remove the new store's files, so its directories are as they were and the next
        run starts afresh rather than finding an empty store to refuse or resume."""
        dirs = list(self.store.dirs)
        try:
            self.close(persist=False)
        finally:
            TensorStore.discard(dirs)
            shutil.rmtree(os.path.join(dirs[0], HF_FILES), ignore_errors=True)
            for d in dirs:  # the activations' scratch directory, left empty by close
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(d, ACT_DIR_NAME))

    def _save_model_files(self, source: CheckpointReader | None) -> None:
        """Keep the HF config (and tokenizer files) with the store, so ``fuyou export`` needs nothing else;
        ``source``: the checkpoint's reader (None: ``source_dir``'s is opened)."""
        d = os.path.join(self.store.dirs[0], HF_FILES)
        os.makedirs(d, exist_ok=True)
        self.adapter.config.save_pretrained(d)
        if self.source_dir:
            keep_untrained(source or CheckpointReader(self.source_dir), d)  # a multimodal checkpoint's other parts
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(self.source_dir, name)):
                    shutil.copy2(os.path.join(self.source_dir, name), d)

    # ------------------------------------------------------------------ training
    def set_lr(self, lr: float) -> None:
        """Learning rate for the next update(s); raises ConfigError if negative or not finite."""
        if not (math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"learning rate must be a finite number ≥ 0, got {lr}")
        self.progress.lr = lr

    def train_step(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> StepResult:
        """One optimizer step on a batch of ``[B, T]`` token ids (B divisible by the micro-batch count).

        ``labels`` default to ``input_ids``; -100 marks positions without loss. ``position_ids``
        (``[B, T]``, optional): each token's position in its document for packed documents
        (``fuyou.data.packing``; each document then attends only to itself). The loss is the mean
        over all labelled tokens of the batch, as ``transformers`` computes it with
        ``num_items_in_batch``. Returns loss, grad norm, whether the update was applied, tokens,
        step time and the timeline summary (busy time per resource, bottleneck, SSD bytes).
        """
        K = self.plan.grad_accum
        if input_ids.dim() != 2 or input_ids.shape[0] % K:
            raise ConfigError(f"batch of shape {tuple(input_ids.shape)} cannot be split into {K} micro-batches")
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ConfigError(
                f"position_ids of shape {tuple(position_ids.shape)} for input_ids of {tuple(input_ids.shape)}"
            )
        labels = input_ids if labels is None else labels
        positions = None if position_ids is None else list(position_ids.chunk(K))
        return self.train_micro_batches(list(input_ids.chunk(K)), list(labels.chunk(K)), position_ids=positions)

    def _check_ids(self, input_ids: list[torch.Tensor]) -> None:
        """Raises ConfigError (one line, before any work) if a token id falls outside the model's
        vocabulary — data tokenized with another tokenizer than the model's — where the embedding lookup
        would fail deep inside the step (or, on a GPU, with a device-side assert). With several ranks every
        rank raises when one batch holds such an id (no rank is left waiting in a collective)."""
        vocab = int(self.adapter.config.vocab_size)
        ranges = [torch.aminmax(t) for t in input_ids if t.numel()]  # one pass per micro-batch
        low, high = min((int(r.min) for r in ranges), default=0), max((int(r.max) for r in ranges), default=0)
        bad = low if low < 0 else high if high >= vocab else None
        if self.comm.world > 1 and self.comm.any(bad is not None) and bad is None:
            raise ConfigError(
                "another rank's batch holds a token id outside the model's vocabulary (its message says which)"
            )
        if bad is not None:
            raise ConfigError(
                f"token id {bad} is outside the model's vocabulary of {vocab:,} (ids 0…{vocab - 1}, vocab_size in its "
                "config.json): the data was tokenized with another tokenizer than the model's; tokenize with the "
                "model's own (fuyou finetune uses the tokenizer files in the model directory: give it the model's)"
            )

    def train_micro_batches(
        self,
        input_ids: list[torch.Tensor],
        labels: list[torch.Tensor],
        num_items: int | None = None,
        position_ids: list[torch.Tensor] | None = None,
    ) -> StepResult:
        """One optimizer step over micro-batches of ``[b, t]`` token ids (shapes may differ).

        All micro-batches pass each block together (layer-grouped accumulation). ``num_items`` is the
        number of labelled (shifted) tokens the summed loss is divided by; default: counted here (and,
        with several ranks, summed over their micro-batches: pass the same total on every rank).
        ``position_ids``: one per micro-batch, as for ``train_step``.
        """
        if (
            len(input_ids) != len(labels)
            or not input_ids
            or (position_ids is not None and len(position_ids) != len(input_ids))
        ):
            raise ConfigError("train_micro_batches needs one labels (and position_ids) tensor per input_ids tensor")
        self._check_ids(input_ids)
        dev = self.backend.device
        if num_items is None:
            num_items = int(sum((lab[:, 1:] != -100).sum() for lab in labels))
            num_items = self.comm.sum_int(num_items)  # the loss is the mean over every rank's labelled tokens
        st = StepState(
            xs=[x.to(dev) for x in input_ids],
            ctxs=_seeds(position_ids, len(input_ids), dev),
            labels=[lab.to(dev) for lab in labels],
            num_items=num_items,
            balance=None if self.balance is None else StepBalance(self.balance, len(input_ids), dev, self.comm),
        )
        self._admit_batch(input_ids)
        key = self.timeline.begin_step()
        try:
            with _device_memory("a step", self.backend):
                applied, t0, t1 = self.runner.run(st)
        finally:
            self.timeline.end_step()
        tokens = sum(x.numel() for x in input_ids)
        return StepResult(
            step=self.step,
            loss=st.loss,
            grad_norm=math.sqrt(st.norm_sq),
            applied=applied,
            lr=self.lr,
            tokens=tokens,
            step_time_s=t1 - t0,
            tokens_per_s=tokens / (t1 - t0),
            moe_balance_loss=None if st.balance is None else st.aux,
            io=StepIO(key, self.step_io),
            **self.timeline.summary(t0, t1),
        )

    def _admit_batch(self, input_ids: list[torch.Tensor]) -> None:
        """Refuse, before it allocates, a step whose micro-batches' shape (the largest of each
        dimension) the device-memory model says cannot fit (``device_admission``); each shape is
        checked once."""
        self._admit_shape(max(x.shape[0] for x in input_ids), max(x.shape[-1] for x in input_ids), len(input_ids))

    def _admit_shape(self, micro_batch: int, seq_len: int, accum: int) -> None:
        """Admit steps of ``accum`` micro-batches of ``micro_batch × seq_len`` tokens (once per shape);
        DeviceMemoryError (one line) if the device-memory model says they cannot fit."""
        key = (micro_batch, seq_len, accum)
        if key in self._admitted:
            return
        cap = self.backend.memory().capacity
        peak = batch_peak(self.adapter.config, self.layout, self.plan, *key, self.lora.numel, self.backend.name, cap)
        admit_batch(peak, cap, *key)
        self._admitted.add(key)
        if peak is not None and (self.predicted_peak is None or peak.nbytes > self.predicted_peak.nbytes):
            self.predicted_peak = peak

    @torch.no_grad()
    def evaluate(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> float:
        """Mean loss over the labelled tokens of a ``[B, T]`` batch, forward only (no update);
        ``position_ids`` as for ``train_step``.

        Streams the weights block by block like a training step; pending updates are committed first. The
        head's logits are made and reduced ``sizing.loss_chunk_tokens`` tokens at a time, as in training.
        Raises DeviceMemoryError (one line) if the device's allocator runs out.
        """
        with _device_memory("an evaluation", self.backend):
            self.flush()
            with self.backend.counting("an evaluation"):
                return self._evaluate(input_ids, labels, position_ids)

    def _evaluate(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> float:
        self._check_ids([input_ids])
        labels = input_ids if labels is None else labels
        dev = self.backend.device
        seed = _seeds(None if position_ids is None else [position_ids], 1, dev)[0]
        head = self.runner.head
        H = len(self.layout.blocks) - 1
        borrowed = [self.layout.index(o) for o in self.layout.blocks[H].borrows]
        shift = shifted(labels)
        n_items = int((shift != IGNORE).sum())  # counted on the host
        self.loader.start(rules.eval_order(H + 1, borrowed))
        try:
            x, ctx = input_ids.to(dev), seed
            for b in range(head.first):
                self._bind_next(b)
                x, ctx = self.adapter.forward(b, x, ctx)
                self.adapter.unbind(b)
                done = self.adapter.last_of_layer(b)
                if done is not None:  # the layer's last expert group has run: its route is spent
                    ctx.routes.pop(done)
            cap = self.backend.memory().capacity
            total = head.evaluate(self._bind_next, x, ctx, shift.to(dev), cap)
        finally:
            self.loader.drain()
        return float(total) / n_items if n_items else float("nan")

    def _bind_next(self, b: int) -> None:
        """Evaluation: bind block ``b`` to the loader's next weights (the head with what it borrows)."""
        dt = self.layout.compute_dtype
        tensors = self.layout.unflatten(b, self.loader.next(b).view(dt))
        if b == len(self.layout.blocks) - 1:
            for name in self.layout.blocks[b].borrows:
                o = self.layout.index(name)
                tensors.update(self.layout.unflatten(o, self.loader.next(o).view(dt)))
        self.loader.ready_event().wait(self.compute_stream)  # hazard: compute reading weights mid-copy
        self.adapter.bind(b, tensors)

    def flush(self) -> None:
        """Wait for pending updates (clipping schedule) and commit them; then write the RAM tier's
        changed extents to the store and commit a complete version (see ``fuyou.transfer.ram_tier``).

        Call before checkpoints and exports. Raises StoreError if a write or commit fails.
        """
        self.updates.settle()
        self.lora.commit(self.store, self.pool, self.tier, self.commit_meta())

    def step_io(self, key: int) -> dict[str, int]:
        """The bytes (per resource of ``fuyou.timeline.MOVED``) of the step with the timeline's ledger
        ``key`` (``StepIO``): its own transfers and its update's, waited for until every one has been
        issued (an update that failed has issued all it will: its error is the step's to raise). The
        latest step's update may still be pending (the clipping schedule's holds its new weights for the
        next forward): asked for that step, the engine flushes first — always, not only when something is
        pending, so that data-parallel ranks, whose flush commits together, all do at the same point."""
        served = self.updates.c.stage.served(key)
        if key == self.timeline.steps:
            self.flush()
        futures.wait(served)
        return self.timeline.take_bytes(key)

    def io_outside(self) -> tuple[int, int]:
        """SSD bytes (read, written) issued outside any step since the last call — an import, an
        evaluation, the RAM tier's writes at a flush — once every pending update is done (``flush``):
        a run's total is its steps' figures plus these."""
        self.flush()
        moved = self.timeline.take_bytes(None)
        return moved["ssd_read"], moved["ssd_write"]

    # ------------------------------------------------------------------ results
    def master_weights(self, everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, fp32 master tensor) for every parameter, one block at a time. With several ranks
        they are gathered on rank 0, which alone yields them (``everywhere``: on every rank); every
        rank must iterate to the end."""
        self.flush()
        gather = self._gather_to_root()
        if everywhere and self.comm.world > 1:
            gather = self.comm.gather_everywhere
        yield from iter_master(self.tier, self.layout, gather)

    def export(self, out_dir: str, dtype: str = "auto") -> None:
        """Write the current weights as a Hugging Face model directory (sharded safetensors) in ``dtype``
        (``auto``: the checkpoint's own, so frozen weights come out bit-identical; else bf16, fp16 or fp32).
        With several ranks every rank calls it; rank 0 writes ``out_dir``. A LoRA run writes the base with
        its adapters merged (``LoraState.merged``). Raises ConfigError for another dtype name."""
        out_dtype = export_dtype(dtype, self.store_meta())
        self.flush()
        export_layout(
            self.tier,
            self.layout,
            self.adapter.config,
            out_dir,
            out_dtype,
            os.path.join(self.store.dirs[0], HF_FILES),  # tokenizer files and a multimodal model's other parts
            self._gather_to_root(),
            self.lora.merged,
        )

    def export_adapter(self, out_dir: str, base: str | None = None) -> None:
        """Write the LoRA adapters as a PEFT adapter directory (``peft.PeftModel.from_pretrained``
        loads it onto the base, which ``adapter_config.json`` names: ``base``, default the model
        directory imported). Raises ConfigError when this run trains no LoRA."""
        files = os.path.join(self.store.dirs[0], HF_FILES)
        rename = runtime_part(load_config(files, whole=True)).disk_key if is_multimodal_store(files) else None
        self.lora.save(out_dir, base or self.source_dir, self.comm.rank == 0, rename)  # every rank holds the same

    def _gather_to_root(self) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        return self.comm.gather_to_root if self.comm.world > 1 else None

    def close(self, persist: bool = True) -> None:
        """Commit pending updates and write the RAM tier back (``flush``), stop the Adam worker, close
        the store. ``persist=False`` (a benchmark's close) only waits for the updates in flight: the
        store keeps its last committed version, which (with a RAM tier) resumes as after a crash would."""
        try:
            if persist:
                self.flush()
            else:
                self.updates.settle()
        finally:
            self.stage.close()
            self.parking.close()
            self.act_space.close()
            self.tier.close()
            self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _device_memory(what: str, backend: Backend) -> Iterator[None]:
    """Turn the device allocator's out-of-memory error (what Fuyou's budget does not count) during ``what``
    into the one-line DeviceMemoryError with the ways out, and ``backend``'s figures at that moment (live
    tensors, what the allocator holds, the cap)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        m = backend.memory()
        tried = re.search(r"Tried to allocate ([\d.]+ \w+)", str(e))
        raise DeviceMemoryError(
            f"the device ran out of memory during {what} (asking for {tried.group(1) if tried else 'more'} with "
            f"{format_size(m.allocated)} in tensors and {format_size(m.reserved)} held by the allocator, of the "
            f"{format_size(m.capacity)} cap); lower --micro-batch-size or --seq-len, choose --activations recompute, "
            "or give the planner the real --gpu-memory (it keeps activations and logits within it)"
        ) from None


def _check_shapes(blk: BlockSpec, src: dict[str, torch.Tensor], source: str | None) -> None:
    """Raises ModelFileError, in one line, where a source tensor's shape is not the one the model's config
    gives its parameter or buffer (a checkpoint beside another model's config.json, or a family whose
    ``transformers`` module is sized otherwise than its published checkpoint)."""
    for key, want in [(p.key, p.shape) for p in blk.params] + [(x.key, x.shape) for x in blk.buffers]:
        got = tuple(src[key].shape)
        if got != tuple(want):
            where, config = (source, "this config.json") if source else ("the state dict", "the model's config")
            raise ModelFileError(
                f"{where}: {key} has shape {list(got)} but {config} gives it {list(want)}; the checkpoint "
                "and its config disagree (or transformers sizes this family's module otherwise than its checkpoint)"
            )


def _entry(state_dict: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """``state_dict[key]``, or for a ``slice_key`` (an expert group's, a vocabulary group's) its rows of
    the whole tensor — served by the source itself where it holds the slice's key (a lazy source that
    makes rows on demand need not make the whole matrix for each group)."""
    rows = parse_slice(key)
    if rows is None or key in state_dict:
        return state_dict[key]
    return state_dict[rows[0]][rows[1] : rows[2]]


def _seeds(position_ids: list[torch.Tensor] | None, n: int, dev: torch.device) -> list:
    """What the embedding block of each of ``n`` micro-batches starts from: None (plain positions
    0…t−1), or a context holding the micro-batch's ``position_ids`` and packed documents
    (``seed_context``: found on the host, so no mask function reads them back from the device)."""
    if position_ids is None:
        return [None] * n
    return [seed_context(p, dev) for p in position_ids]


def _rank_world() -> tuple[int, int]:
    """This process's (rank, world) as torchrun announces them, before the collectives are joined."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = world_size()
    return (int(os.environ.get("RANK", "0")) if world > 1 else 0), world
