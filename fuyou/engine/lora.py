"""LoRA on a frozen, streamed base: ``peft``'s adapters, resident on the device, with their own AdamW.

The base model's blocks stream as for full fine-tuning but are frozen. They get no gradients, no
optimizer state traffic, no Adam update and no writes. The LoRA weights that ``peft`` injected
(``fuyou.models.lora``) are the only trainable parameters. They stay fp32 and on the device for the
whole run, initialised by ``peft`` (``reset_lora_parameters``) or taken from given tensors. After a
step's backward they are clipped by their global norm and updated by ``torch.optim.AdamW``
(``LoraState.step``).

The adapters and their AdamW moments live in the store too, as one extent ``lora``. It is written
and committed at every ``Engine.flush``: checkpoints, exports and the end of the run. The store is
never written by a step of a frozen base, so each committed version's step count and ``lora``
extent agree. Checkpoints (hard links to a committed version) and ``Engine.resume`` therefore cover
the adapters with no machinery of their own (``extent``, ``save_to``, ``load_from``).

With data-parallel ranks every rank holds the same adapters: the base streams sharded (read-only,
gathered), each rank's adapter gradients are summed over ranks in one all-reduce, and every rank
takes the same AdamW step (``fuyou.engine.step``); rank 0 writes the adapter directory.

The output is a PEFT adapter directory that ``peft.PeftModel.from_pretrained`` loads:
``adapter_config.json`` and ``adapter_model.safetensors`` (``LoraState.save``). ``merged`` gives a
base weight plus its LoRA update, for a merged full model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fuyou.errors import ConfigError
from fuyou.models.families import untrained
from fuyou.models.lora import ADAPTER, LoraSettings, base_key, excluded, is_lora
from fuyou.schedule import sizing
from fuyou.storage.extents import ExtentSpec, TensorSpec
from fuyou.transfer.host_pool import HostBufferPool


class LoraState:
    """The trainable LoRA weights on the device and their AdamW."""

    def __init__(
        self,
        model: nn.Module,
        settings: LoraSettings,
        device: torch.device,
        init: dict[str, torch.Tensor],
        hyper: dict[str, Any],
    ) -> None:
        """Materialise ``model``'s LoRA weights on ``device`` (fp32): ``init``'s tensors by parameter
        name where given (all or none), else ``peft``'s initialisation seeded with ``settings.seed``.
        ``hyper``: AdamW's ``betas``, ``eps``, ``weight_decay``."""
        from peft.tuners.lora import LoraLayer

        self.settings = settings
        self.exclude = excluded(model, untrained(model.config))
        """Linear layers LoRA leaves out (``fuyou.models.lora.excluded``), named in the adapter's config too:
        by name, or by full name (a dotted one)."""
        self.layers = {
            base_key(f"{n}.{getattr(m, 'parameter_name', 'weight')}"): m
            for n, m in model.named_modules()
            if isinstance(m, LoraLayer)
        }
        """The LoRA layers by the Hugging Face key of the weight they adapt (a ``ParamWrapper``'s: the
        tensor it targets, e.g. a mixture of experts' fused ``experts.gate_up_proj``)."""
        with torch.random.fork_rng(devices=[]):  # the same adapters every run: seeded, on the host
            torch.manual_seed(settings.seed)
            for layer in self.layers.values():
                layer.lora_A.to_empty(device="cpu")
                layer.lora_B.to_empty(device="cpu")
                layer.reset_lora_parameters(ADAPTER, True)
                for p in list(layer.lora_A.parameters()) + list(layer.lora_B.parameters()):
                    p.data = p.data.float().to(device)
        self.params = {n: p for n, p in model.named_parameters() if is_lora(n)}
        given = {k: v for k, v in init.items() if is_lora(k)}
        if given:
            missing = sorted(set(self.params) - set(given))
            if missing:
                raise ConfigError(f"LoRA weights given for some layers but not for {missing[:3]}")
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(given[n])
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=0.0, foreach=False, **hyper)

    @property
    def numel(self) -> int:
        """Trainable parameters."""
        return sum(p.numel() for p in self.params.values())

    def zero_grad(self) -> None:
        """Drop the last step's gradients (set to None)."""
        self.optimizer.zero_grad(set_to_none=True)

    def sq_norm(self) -> torch.Tensor:
        """Σ of the squared gradients (a 0-d fp64 tensor on the device; 0 when none arrived)."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        dev = next(iter(self.params.values())).device
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=dev)
        return torch.stack([g.double().square().sum() for g in grads]).sum()

    def flat_grads(self) -> torch.Tensor:
        """Every adapter gradient (zeros where none arrived) in one flat fp32 device tensor, and each
        ``.grad`` made a view of it: what the ranks sum in one collective."""
        params = list(self.params.values())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        off = 0
        for p in params:
            p.grad = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
        return flat

    def step(self, lr: float, scale: float) -> None:
        """One AdamW update at ``lr``, the gradients first multiplied by ``scale`` (clipping)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if scale != 1.0:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()

    EXTENT = "lora"

    def extents(self) -> list[ExtentSpec]:
        """The store extents the adapters add: their ``extent``."""
        return [self.extent()]

    def commit(self, store: Any, pool: HostBufferPool, tier: Any, meta: dict[str, Any]) -> None:
        """``Engine.flush``'s commit: the adapters written to their extent and a version committed by the
        run's ``RamTier`` ``tier``; a frozen base changed nothing else."""
        self.save_to(store, pool)
        tier.commit(meta)

    def extent(self) -> ExtentSpec:
        """The store extent holding every adapter weight and its AdamW moments (fp32)."""
        specs = []
        for n, p in self.params.items():
            specs += [TensorSpec(f"{part}/{n}", tuple(p.shape), torch.float32) for part in ("w", "m", "v")]
        return ExtentSpec(self.EXTENT, tuple(specs))

    def save_to(self, store: Any, pool: HostBufferPool) -> None:
        """Write the adapters and their moments into the store's ``lora`` extent (not yet committed),
        through the pool's adapter buffer (``sizing.ADAPTERS``: inside the host budget)."""
        spec = self.extent()
        held = pool.acquire(sizing.ADAPTERS)
        try:
            buf = held.data[: spec.nbytes]
            buf.zero_()
            views = spec.views(buf)
            for n, p in self.params.items():
                st = self.optimizer.state.get(p, {})
                views[f"w/{n}"].copy_(p.detach())
                for part, key in (("m", "exp_avg"), ("v", "exp_avg_sq")):
                    if key in st:
                        views[f"{part}/{n}"].copy_(st[key])
            store.write(self.EXTENT, buf).result()
        finally:
            pool.release(held)

    def load_from(self, store: Any, step: int, pool: HostBufferPool) -> None:
        """Restore the adapters and their moments from the store's ``lora`` extent after ``step``
        updates, through the pool's adapter buffer. Raises ConfigError when the store holds other
        adapters (or none)."""
        names = {e.name: e for e in store.extents}
        if names.get(self.EXTENT) != self.extent():
            what = "no LoRA adapters" if self.EXTENT not in names else "LoRA adapters of another rank or targets"
            raise ConfigError(
                f"the store in {store.dirs[0]} holds {what}; resume with the --lora-* settings it was trained with"
            )
        held = pool.acquire(sizing.ADAPTERS)
        try:
            buf = held.data[: self.extent().nbytes]
            store.read(self.EXTENT, buf).result()
            views = self.extent().views(buf)
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(views[f"w/{n}"])
                    if step:
                        self.optimizer.state[p] = {
                            "step": torch.tensor(float(step)),
                            "exp_avg": views[f"m/{n}"].to(p.device, copy=True),
                            "exp_avg_sq": views[f"v/{n}"].to(p.device, copy=True),
                        }
        finally:
            pool.release(held)

    @torch.no_grad()
    def merged(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (the base's, by Hugging Face ``key``, on the host) plus its LoRA update
        ``scaling · B · A``; other weights unchanged."""
        layer = self.layers.get(key)
        if layer is None:
            return weight
        a: torch.Tensor = layer.lora_A[ADAPTER].weight  # type: ignore[assignment]
        b: torch.Tensor = layer.lora_B[ADAPTER].weight  # type: ignore[assignment]
        experts = getattr(layer, "num_experts", 1)
        if experts > 1:  # a fused expert tensor [E, …]: one rank-r update per expert, as peft's
            # ParamWrapper.get_delta_weight (which cannot run here: its base is a meta tensor)
            a3, b3 = a.double().reshape(experts, -1, a.shape[-1]), b.double().reshape(b.shape[0], -1, experts)
            order = "e o i" if getattr(layer, "_did_swap_in_out_features", False) else "e i o"
            delta = torch.einsum(f"o r e, e r i -> {order}", b3, a3) * layer.scaling[ADAPTER]
        else:
            delta = (b.double() @ a.double()) * layer.scaling[ADAPTER]
        if getattr(layer, "fan_in_fan_out", False):  # GPT-2's Conv1D keeps weights as [in, out]
            delta = delta.T
        return (weight.double() + delta.cpu()).to(weight.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA weights by parameter name (host copies)."""
        return {n: p.detach().cpu().clone() for n, p in self.params.items()}

    def save(
        self, out_dir: str, base: str | None, write: bool = True, rename: Callable[[str], str] | None = None
    ) -> None:
        """Write a PEFT adapter directory: ``adapter_config.json`` (``base`` as the base model's path)
        and ``adapter_model.safetensors`` with ``peft``'s key names. Written to ``out_dir.partial``
        and renamed, so ``out_dir`` is never half-written. ``write=False``: nothing (another rank writes).
        ``rename``: the causal LM's module names as the base model names them (a multimodal model's
        language model: ``multimodal.TextPart.disk_key``); its adapter then targets those modules by full
        name, never the vision tower's of the same short name."""
        if not write:
            return
        import shutil

        from safetensors.torch import save_file

        tmp = out_dir.rstrip("/") + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        name = rename or (lambda n: n)
        modules = sorted({name(n[: n.index(".lora_")]) for n in self.params}) if rename else None
        exclude = [name(e) if "." in e else e for e in self.exclude]
        self.settings.peft_config(base, modules, exclude).save_pretrained(tmp)
        tensors = {"base_model.model." + name(n.replace(f".{ADAPTER}.", ".")): t for n, t in self.state_dict().items()}
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)


class NoAdapters:
    """What a run without LoRA has in ``LoraState``'s place (full fine-tuning, ``--freeze``): no adapters to
    store, restore, merge or export; a flush persists the RAM tier's changes."""

    numel = 0
    """Trainable adapter parameters: none."""
    merged = None
    """No LoRA update to merge into exported weights."""

    def extents(self) -> list[ExtentSpec]:
        """No store extent of its own."""
        return []

    def save_to(self, store: Any, pool: HostBufferPool) -> None:
        """Nothing to write."""

    def load_from(self, store: Any, step: int, pool: HostBufferPool) -> None:
        """Nothing to restore."""

    def commit(self, store: Any, pool: HostBufferPool, tier: Any, meta: dict[str, Any]) -> None:
        """``Engine.flush``'s commit: the RAM tier's changed extents written and a version committed."""
        tier.persist(meta)

    def save(
        self, out_dir: str, base: str | None, write: bool = True, rename: Callable[[str], str] | None = None
    ) -> None:
        """Refused: ConfigError (one line, on every rank)."""
        raise ConfigError("this run trains no LoRA adapters (give --lora-rank); export the full model instead")
