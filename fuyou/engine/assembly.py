"""Engine assembly: the run's model blocks, plan and layout, from the engine's config and, when resuming,
the store's record (``StoreMeta``) — decided here, once, before anything is allocated.

``assemble_model`` is the first stage of ``Engine.__init__``: expert and vocabulary groups (a new run
sizes them to the budgets: ``expert_groups_for``, ``vocab_groups_for``; a resumed one keeps its store's),
the model adapter and LoRA adapters, the ``ModelLayout`` (new, or the store's, checked extent by extent),
then the ``Plan``, decided once (``run_plan``: schedule resolved, policies spread over the blocks, a LoRA
base frozen, the budget check). What runs is a function of the two results, ``ModelParts.plan`` and
``ModelParts.layout``, which the engine records with each commit.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from fuyou.device.base import Backend
from fuyou.engine.config import EngineConfig
from fuyou.engine.lora import LoraState, NoAdapters
from fuyou.errors import ConfigError, DeviceMemoryError, FuyouWarning
from fuyou.models.activation_rules import experts_of, top_k_of
from fuyou.models.adapters import GPT2, Adapter, architecture_of, make_adapter
from fuyou.models.blocks import split_experts
from fuyou.models.families import untrained
from fuyou.models.freeze import frozen_blocks, frozen_keys
from fuyou.models.store_layout import ModelLayout, origin_wanted
from fuyou.schedule import rules, sizing
from fuyou.schedule.experts import expert_group_options, spread_policies
from fuyou.schedule.plan import Plan
from fuyou.schedule.state_format import AUTO, resolve_format, state_format
from fuyou.schedule.vocab import bounding_groups
from fuyou.storage.run_meta import PRECISIONS, STALE, StoreMeta, precision_name
from fuyou.storage.store import TensorStore
from fuyou.transfer.collectives import Collectives
from fuyou.units import format_size


@dataclass(frozen=True)
class ModelParts:
    """What ``assemble_model`` decided."""

    adapter: Adapter
    lora: LoraState | NoAdapters
    """The trainable LoRA weights and their AdamW (None: full fine-tuning)."""
    plan: Plan
    """The plan the engine runs: ``cfg.plan`` with its schedule resolved, fitted to the host budget."""
    layout: ModelLayout
    source_dtype: torch.dtype
    """The dtype of the checkpoint the run started from (a resumed store's record)."""
    stored: StoreMeta | None
    """What the resumed store recorded of its run (None: a new store)."""


def assemble_model(
    config: Any,
    cfg: EngineConfig,
    backend: Backend,
    comm: Collectives,
    store: TensorStore | None,
    lora_init: dict[str, torch.Tensor] | None,
    source_dtype: torch.dtype | None,
) -> ModelParts:
    """The run's blocks, plan and layout; see the module docstring. With ``store`` (resuming) every rank's
    store is brought to one step first (``agree_on_step``).

    Raises ConfigError for a store trained with other settings (ranks, precision, --freeze, extents),
    DeviceMemoryError when the largest block cannot fit the device budget."""
    stored = None if store is None else StoreMeta.from_json(store.meta, store.dirs[0])
    groups, vocab = _groups(config, cfg, backend, comm.world, stored)
    adapter = make_adapter(config, cfg.lora, groups, vocab)
    adapter.frozen_keys = frozen_keys(tuple(adapter.blocks), cfg.freeze, untrained(config))
    lora = (
        NoAdapters()
        if cfg.lora is None
        else LoraState(
            adapter.model,
            cfg.lora,
            backend.device,
            lora_init or {},
            dict(betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay),
        )
    )
    blocks = tuple(adapter.blocks)
    if store is None or stored is None:
        layout = _new_layout(cfg, blocks, comm, adapter, source_dtype)
        source = source_dtype or torch.float32
    else:
        layout = _resumed_layout(cfg, blocks, comm, adapter, store, stored)
        stored = StoreMeta.from_json(store.meta, store.dirs[0])  # the step every rank agreed on
        source = stored.source_dtype
    # the adapters' extent is staged through one host buffer of the pool
    layout = dataclasses.replace(layout, adapter_bytes=sum(e.nbytes for e in lora.extents()))
    plan = run_plan(cfg, layout, groups, vocab, backend, fixed_chunk=store is not None)
    adapter.prepare(backend.device)  # the first device allocation: after the floor check
    layout = dataclasses.replace(layout, state_chunk=plan.state_chunk)
    return ModelParts(adapter, lora, plan, layout, source, stored)


def _groups(config: Any, cfg: EngineConfig, backend: Backend, world: int, stored: StoreMeta | None) -> tuple[int, int]:
    """(expert groups, vocabulary groups): a resumed store's, else the plan's, else sized to the budgets."""
    if stored is not None:
        return stored.expert_groups, stored.vocab_groups
    base = rules.resolve(cfg.plan, clip=cfg.max_grad_norm > 0)
    vocab = cfg.plan.vocab_groups or vocab_groups_for(
        config,
        dataclasses.replace(base, lora_base=cfg.lora is not None),
        PRECISIONS[cfg.precision],
        world,
        cfg.cpu_bytes,
    )
    groups = cfg.plan.expert_groups or expert_groups_for(
        config, PRECISIONS[cfg.precision], world, backend.memory().capacity, backend.name
    )
    return groups, vocab


def run_plan(
    cfg: EngineConfig, layout: ModelLayout, groups: int, vocab: int, backend: Backend, fixed_chunk: bool
) -> Plan:
    """The plan the engine runs, decided here once and recorded: ``cfg.plan`` — the planner's, or the
    front end's for the budget rules — with its schedule resolved (clipping forces
    ``overlap_next_forward``), the expert and vocabulary ``groups``, the activation policies spread over
    ``layout``'s blocks, a LoRA base frozen (no state, nothing written), and the budget check (``admit``:
    the device floor; the state chunk the layout's, the host buffers fitted to ``cfg.cpu_bytes`` —
    ``fixed_chunk``: a store's chunk, which cannot change). A plan the planner chose comes back as it
    is (``tests/integration/test_plans_admitted.py``).

    Raises ConfigError for a RAM tier past the blocks or ``overlap_backward`` with clipping,
    DeviceMemoryError when the largest block cannot fit the device budget."""
    requested = cfg.plan
    if cfg.lora is not None:  # the base only streams in: no state, no gradient or weight traffic out
        requested = dataclasses.replace(requested, lora_base=True, ram_state_blocks=0)
    plan = dataclasses.replace(
        rules.resolve(requested, clip=cfg.max_grad_norm > 0),
        expert_groups=groups,
        vocab_groups=vocab,
        activation_policy=spread_policies(requested.activation_policy, [b.name for b in layout.blocks]),
    )
    rules.check_ram_tier(plan, len(layout.blocks))
    return admit(layout, plan, cfg.cpu_bytes, backend.memory().capacity, fixed_chunk, backend.name)


def _new_layout(
    cfg: EngineConfig, blocks: tuple, comm: Collectives, adapter: Adapter, source_dtype: torch.dtype | None
) -> ModelLayout:
    """A new store's layout: the run's dtypes, the requested state chunk (``run_plan`` may shrink it to the
    host budget), this rank's shards, the frozen blocks and parameters (a LoRA base whole), and the
    source's exact values kept where something is frozen and the compute dtype would round them."""
    frozen = frozen_blocks(blocks, cfg.freeze)
    layout = ModelLayout(
        blocks,
        PRECISIONS[cfg.precision],
        state_format(resolve_format(cfg.optimizer_state), resumable=True),
        cfg.plan.state_chunk,
        comm.rank,
        comm.world,
        cfg.lora is not None or cfg.plan.lora_base,
        frozen_blocks=frozen,
        frozen_params=adapter.frozen_keys,
    )
    any_frozen = layout.lora_base or bool(frozen) or bool(layout.frozen_params)
    return dataclasses.replace(layout, origin=origin_wanted(layout.compute_dtype, source_dtype, any_frozen))


def _resumed_layout(
    cfg: EngineConfig, blocks: tuple, comm: Collectives, adapter: Adapter, store: TensorStore, stored: StoreMeta
) -> ModelLayout:
    """The resumed store's layout, checked against this run's settings and the store's extents; every
    rank's store brought to one step (it may go back one: read its record again after)."""
    layout = stored_layout(blocks, stored, store.dirs[0], cfg, comm.rank, comm.world)
    agree_on_step(comm, store, stored.step)
    if sorted(stored.freeze) != sorted(cfg.freeze):
        raise ConfigError(
            f"the store in {store.dirs[0]} was trained with --freeze {list(stored.freeze)}; resume "
            "with the same patterns (its frozen blocks have no optimizer state)"
        )
    layout = dataclasses.replace(
        layout,
        frozen_blocks=frozen_blocks(blocks, cfg.freeze),
        frozen_params=adapter.frozen_keys,
        origin=stored.origin,
    )
    check_extents(layout, store)
    return layout


def admit(
    layout: ModelLayout, plan: Plan, host_bytes: int, device_bytes: int, fixed_chunk: bool = False, device: str = "cpu"
) -> Plan:
    """The engine's budget check: ``plan`` (schedule resolved) fitted to ``host_bytes`` by the budget
    rules (``sizing.fit_host``; a plan that fits comes back unchanged). ``fixed_chunk``: the layout's
    state chunk is a store's and cannot change; ``device``: the backend's name (``cuda`` adds what its
    libraries need to the floor).

    Raises DeviceMemoryError if ``device_bytes`` is below ``sizing.device_floor``. A plan whose
    smallest form still passes ``host_bytes`` is returned; the pool's reservation then refuses it,
    naming every buffer class.
    """
    fp = layout.footprint()
    need, lib = sizing.device_floor(fp, device), sizing.library_bytes(device)
    if need > device_bytes:
        extra = f" (with {format_size(lib)} for the cuBLAS workspace and the allocator's rounding)" if lib else ""
        raise DeviceMemoryError(
            f"the largest block needs {format_size(need)} of device memory for its weights and gradients{extra}, "
            f"the device budget is {format_size(device_bytes)}; raise --gpu-memory (or use a GPU with more memory)"
        )
    return sizing.fit_host(fp, dataclasses.replace(plan, state_chunk=layout.state_chunk), host_bytes, fixed_chunk)


def expert_groups_for(config: Any, compute_dtype: torch.dtype, world: int, capacity: int, device: str) -> int:
    """The fewest expert groups (``fuyou.schedule.experts.expert_group_options``) that bring a mixture of
    experts' largest block within ``capacity`` device bytes (``sizing.device_floor``: its weights and
    gradients, gathered from ``world`` ranks' shards); 1 for a dense model, the most there are when
    none does (``admit`` then names the largest block)."""
    experts = experts_of(config)
    if experts < 2:
        return 1
    whole = tuple(make_adapter(config).blocks)
    options = expert_group_options(experts)
    for g in options:
        blocks = split_experts(whole, g, experts, top_k_of(config))
        if sizing.device_floor(ModelLayout(blocks, compute_dtype, world=world).footprint(), device) <= capacity:
            return g
    return options[-1]


def vocab_groups_for(config: Any, plan: Plan, compute_dtype: torch.dtype, world: int, host_bytes: int) -> int:
    """1, unless ``plan`` cannot fit the smallest host buffer set of the unsplit model in ``host_bytes``
    (``sizing.fit_host``) and the embedding or an untied LM head is larger than a decoder layer: then
    the fewest vocabulary groups that bring each within one (``fuyou.schedule.vocab.bounding_groups``).
    A tied embedding, or a family the adapter does not split, stays whole (``admit`` then names the
    largest block)."""
    if getattr(config, "tie_word_embeddings", False) or architecture_of(config) in GPT2:
        return 1
    whole = tuple(make_adapter(config).blocks)
    if max(plan.ram_weight_blocks, plan.ram_state_blocks) > len(whole):
        return 1  # ``rules.check_ram_tier`` names it
    fp = ModelLayout(whole, compute_dtype, world=world).footprint()
    if sizing.host_need(fp, sizing.fit_host(fp, dataclasses.replace(plan, vocab_groups=1), host_bytes)) <= host_bytes:
        return 1
    layer = max((b.numel for b in whole[1:-1]), default=0)
    if max(whole[0].numel, whole[-1].numel) <= layer:
        return 1
    return bounding_groups(config.vocab_size, config.hidden_size, layer)


def agree_on_step(comm: Collectives, store: TensorStore, step: int) -> None:
    """Bring every rank's reopened store (at ``step``) to one step. A crash during a commit can leave ranks
    one step apart; those ahead still keep the step before (``TensorStore.previous``) and go back to it.
    Raises ConfigError on every rank when some rank cannot reach the lowest step (its stores were changed
    by hand, or that version kept RAM-tier state unwritten): resume from a checkpoint then."""
    if comm.world == 1:
        store.forget_previous()
        return
    low, high = comm.min_int(step), -comm.min_int(-step)
    prev = store.previous
    back = step > low and prev is not None and int(prev["meta"].get("step", -1)) == low
    if comm.any(step > low and (not back or bool(prev and prev["meta"].get(STALE)))):
        raise ConfigError(
            f"the ranks' stores were left at different steps ({low} to {high}; this rank's, {store.dirs[0]}, at "
            f"{step}) and cannot all go back to step {low}: resume from a checkpoint every rank holds "
            "(fuyou finetune --resume auto)"
        )
    if back:
        store.roll_back()
        warnings.warn(
            f"this rank's store in {store.dirs[0]} went back from step {step} to step {low}, the step every "
            "rank committed before the run stopped",
            FuyouWarning,
            stacklevel=3,
        )
    else:
        store.forget_previous()


def check_extents(layout: ModelLayout, store: TensorStore) -> None:
    """Raise ConfigError unless ``store`` holds every extent ``layout`` reads, of the same size (a store
    written for other settings, or by an older Fuyou with another layout)."""
    held = {e.name: e.nbytes for e in store.extents}
    for e in layout.extents():
        if held.get(e.name) != e.nbytes:
            raise ConfigError(
                f"the store in {store.dirs[0]} does not hold extent {e.name!r} of {e.nbytes} bytes "
                f"({'absent' if e.name not in held else f'{held[e.name]} bytes'}): it was written with other "
                "settings or by another Fuyou version; resume with the settings it was created with, or start again"
            )


def stored_layout(blocks: tuple, meta: StoreMeta, where: str, cfg: EngineConfig, rank: int, world: int) -> ModelLayout:
    """The layout the store in ``where`` was created with (dtypes and state chunk from its ``meta``);
    raises ConfigError if it was a different rank's shard or trained with another precision."""
    if (meta.rank, meta.world) != (rank, world):
        raise ConfigError(
            f"the store in {where} holds rank {meta.rank} of {meta.world} ranks, this process is rank {rank} of "
            f"{world}; resume with the same number of ranks"
        )
    if meta.compute_dtype != PRECISIONS[cfg.precision]:
        raise ConfigError(
            f"the store in {where} was trained with --precision {precision_name(meta.compute_dtype)}; resume "
            "with the same precision"
        )
    if cfg.optimizer_state not in (AUTO, meta.optimizer_state):
        raise ConfigError(
            f"the store in {where} was written with --optimizer-state {meta.optimizer_state}; resume with the "
            f"same format (or export it and start a new run with --optimizer-state {cfg.optimizer_state})"
        )
    fmt = state_format(meta.optimizer_state, resumable=True)
    return ModelLayout(blocks, meta.compute_dtype, fmt, meta.state_chunk, rank, world, meta.lora_base)
