"""How a run picks its engine plan, for both front ends (``fuyou finetune`` and ``FuyouTrainer``).

A front end describes its run as a ``PlanRequest`` (plain data: no ``FinetuneConfig``, no
``TrainingArguments``) and calls ``choose_plan``, so the same run gets the same plan from either.

``mode="auto"`` (``--plan auto``, the default) asks the cost-model planner (``fuyou.planner.search``)
for the fastest plan that fits the budgets, keeping the run's own batch: ``micro_batch_size`` ×
``grad_accum`` sequences of ``seq_len`` tokens per step, split into ``grad_accum`` micro-batches. It
chooses the prefetch depth, the per-layer activation policy, the state chunk and buffer count,
(without clipping) the schedule and, when spare host memory makes it faster (bf16 runs), which blocks'
weights and optimizer state live in host RAM instead of on SSD (``Plan.ram_weight_blocks``/
``ram_state_blocks``). ``prefetch_depth`` and ``activations`` (``--prefetch-depth``,
``--activations``) fix those choices; ``mode="rules"`` (``--plan rules``) uses the engine's simple
budget rules instead.

The planner reads a hardware profile: ``PlanRequest.profile`` (``--profile PATH``), else
``$FUYOU_PROFILE``, else ``hw.json`` in the cache directory (``$FUYOU_CACHE``, default
``~/.cache/fuyou``; written by ``fuyou profile``) if it was measured on the same kind of device.
Without one, a quick profile is measured (seconds: a 64 MiB SSD test in the first store directory, CPU
Adam, memcpy, one layer and the head at the run's micro-batch, in the run's compute dtype), cached per
machine (``fuyou.machine``: the machine's figures per store filesystem, the model's per model shape,
batch and dtype) so a re-run, a resumed run or another run on this machine does not measure again,
and saved at ``PlanRequest.profile_out`` (the CLI: ``OUTPUT/profile.json``) once the run has started
(``ChosenPlan.keep_profile``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fuyou.errors import ConfigError
from fuyou.schedule.plan import POLICIES, Plan
from fuyou.schedule.state_format import CHOICES, FORMATS, resolve_format

MODES = ("auto", "rules")


def default_profile() -> str:
    """Where ``fuyou profile`` keeps this machine's profile: ``hw.json`` in the cache directory."""
    from fuyou.machine import cache_dir

    return os.path.join(cache_dir(), "hw.json")


@dataclass(frozen=True)
class PlanRequest:
    """One run as the plan chooser sees it, whichever front end describes it."""

    model_config: Any
    """The model's ``transformers`` config."""
    store_dirs: tuple[str, ...]
    """Store directories, one per SSD (a quick profile measures the first)."""
    cpu_memory: str | int
    """Host budget (``64GiB`` or bytes)."""
    gpu_memory: str | int | None = None
    """Device budget; None: the profile's device memory."""
    device: str = "auto"
    """``auto`` | ``cuda`` | ``cpu``."""
    precision: str = "bf16"
    """Compute dtype, resolved: ``bf16`` or ``fp32``."""
    optimizer_state: str = "auto"
    """How AdamW's state is stored (``fuyou.schedule.state_format``); ``auto``: the resumed store's, else
    ``split`` (the plan is made for ``stored_format``; the engine gets ``auto`` and adopts a resumed store's)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (kept: the planner does not change the run's batch)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seq_len: int = 1024
    """Tokens per sequence the plan is sized for (activations, compute)."""
    clip: bool = False
    """Global-norm clipping on (forces the ``overlap_next_forward`` schedule)."""
    mode: str = "auto"
    """``auto``: the cost-model planner; ``rules``: the engine's budget rules."""
    prefetch_depth: int | None = None
    """Fix the prefetch depth instead of planning it."""
    activations: str | None = None
    """Fix every layer's activation policy (keep|swap_cpu|swap_ssd|recompute|recompute_cpu) instead of planning it."""
    profile: str | None = None
    """Hardware profile JSON; None: ``$FUYOU_PROFILE``, this machine's ``hw.json``, else measured."""
    profile_out: str | None = None
    """Where a profile measured now is saved (None: not saved; it is cached per machine either way)."""
    lora: Any = None
    """The run's ``LoraSettings`` (None: full fine-tuning): adapters on a frozen LoRA base, whose plan streams
    weights only (``Plan.lora_base``); a quick profile times the blocks as LoRA computes them."""
    freeze: tuple[str, ...] = ()
    """``--freeze`` globs: the blocks they freeze whole are planned without state or writes."""
    ranks: int = 1
    """Data-parallel ranks (``torchrun``): the plan is one rank's, for its shards of the state and its
    ``micro_batch_size × grad_accum`` sequences; the budgets are per rank."""

    def __post_init__(self) -> None:
        p = []
        if not self.store_dirs:
            p.append("at least one store directory is needed")
        if self.mode not in MODES:
            p.append(f"plan mode must be auto or rules, got {self.mode!r}")
        if self.precision not in ("bf16", "fp32"):
            p.append(f"precision must be bf16 or fp32, got {self.precision!r}")
        if self.optimizer_state not in CHOICES and self.optimizer_state not in FORMATS:
            p.append(f"--optimizer-state must be one of {', '.join(CHOICES)}, got {self.optimizer_state!r}")
        for name, low in (("micro_batch_size", 1), ("grad_accum", 1), ("seq_len", 2), ("ranks", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                p.append(f"{name.replace('_', ' ')} must be an integer ≥ {low}, got {v!r}")
        if self.prefetch_depth is not None and (not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1):
            p.append(f"prefetch depth must be an integer ≥ 1, got {self.prefetch_depth!r}")
        if self.activations is not None and self.activations not in POLICIES:
            p.append(f"activations must be one of {', '.join(POLICIES)}, got {self.activations!r}")
        if p:
            raise ConfigError("; ".join(p))

    @property
    def lora_base(self) -> bool:
        """Whether the model is a LoRA run's frozen base (``lora`` given)."""
        return self.lora is not None

    @property
    def stored_format(self) -> str:
        """The optimizer-state format the plan is made for: ``optimizer_state`` with ``auto`` resolved as for a
        new store (a resume resolves it from the store before asking: ``fuyou.run.loop``)."""
        return resolve_format(self.optimizer_state)

    @property
    def lora_rank(self) -> int:
        """The adapters' rank (their device memory); 0 without LoRA."""
        return int(self.lora.rank) if self.lora is not None else 0


@dataclass(frozen=True)
class ChosenPlan:
    """The plan a run uses (the state chunk inside it) and how it was chosen."""

    plan: Plan
    info: dict[str, Any] = field(default_factory=dict)
    """For the run's record: source (planner|rules), profile, predicted step time and bottleneck."""
    step: Any = None
    """The planner's ``StepConfig`` for ``plan`` (None for a rules plan): ``check_profile`` predicts the same
    step again on figures measured afresh."""
    measured: Any = None
    """A hardware profile measured for this run, to be saved at ``info["profile"]`` once the run starts
    (``keep_profile``), so a run refused or failing before leaves no file behind."""

    def keep_profile(self) -> None:
        """Save the profile measured for this run (if any) where ``info["profile"]`` names it."""
        from fuyou.planner.profile import save_profile

        if self.measured is not None:
            path = self.info["profile"]
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_profile(self.measured, path)


def device_kind(device: str) -> str:
    """``cuda`` or ``cpu`` for a ``--device`` value (``auto``: cuda when torch sees a GPU)."""
    from fuyou.device import device_kind as kind

    return kind(device)


def _profile(req: PlanRequest, log: Callable[[str], None]) -> tuple[Any, str | dict[str, Any]]:
    """The hardware profile for this run and where it came from: a file's path, or for a quick profile its
    cache keys and whether it came from the cache (``quick_profile``); see the module docstring."""
    from fuyou.planner.profile import load_profile

    path = req.profile or os.environ.get("FUYOU_PROFILE")
    if path:
        if not os.path.isfile(path):
            raise ConfigError(
                f"no hardware profile at {path}; run `fuyou profile --ssd DIR --out {path}` or drop --profile"
            )
        return load_profile(path), path
    kind = device_kind(req.device)
    if os.path.isfile(default_profile()):
        prof = load_profile(default_profile())
        if prof.device == kind:
            return prof, default_profile()
    from fuyou.storage.dirs import check_dir

    for d in req.store_dirs:
        check_dir(d)  # unusable directories get the store's one-line error before anything is measured
    return quick_profile(req, kind, _stderr)  # said even without progress output: it explains a wait


def quick_profile(
    req: PlanRequest, kind: str, log: Callable[[str], None], again: bool = False
) -> tuple[Any, dict[str, Any]]:
    """The quick profile for this run, from the per-machine cache where measured before (see the
    module docstring), and ``{"keys": its cache keys, "cached": whether it all came from the cache}``.
    ``again``: measured anew whatever the cache holds, which then keeps the new figures."""
    from fuyou.device import get_backend
    from fuyou.machine import cache_put, cached, machine_key
    from fuyou.models.description import describe_model
    from fuyou.planner.measure import QUICK, machine_figures, model_figures, profile_from

    backend = get_backend(kind)
    ssd = os.path.abspath(req.store_dirs[0])
    base = f"{machine_key(kind + ':' + backend.describe())}/{req.precision}"
    lora = req.lora
    tag = f"/lora{lora.rank}-{'+'.join(lora.targets)}" if lora is not None else ""
    sig = describe_model(req.model_config).signature
    keys = [
        f"{base}/fs{os.stat(ssd).st_dev}/{SSD_TIMING}",
        f"{base}/{sig}/{req.micro_batch_size}x{req.seq_len}{tag}/{TIMING}",
    ]
    said: list[int] = []

    def measure(what: str) -> Callable[[], Any]:
        def run() -> Any:
            if not said and not again:
                log("planner: measuring a quick hardware profile of this machine (once; seconds) …")
                said.append(1)
            if what == "machine":
                return machine_figures(backend, [ssd], req.precision, QUICK)
            mb = (req.micro_batch_size,)
            return model_figures(req.model_config, backend, mb, req.seq_len, req.precision, QUICK, lora=lora)

        return run

    if again:
        machine, model = measure("machine")(), measure("model")()
        cache_put(QUICK_CACHE, keys[0], machine)
        cache_put(QUICK_CACHE, keys[1], model)
        return profile_from(machine, model, "quick (measured again for a run)"), {"keys": keys, "cached": False}
    (machine, hit), (model, hit_model) = (
        cached(QUICK_CACHE, k, measure(w)) for k, w in zip(keys, ("machine", "model"))
    )
    return profile_from(machine, model, "quick (measured for a run)"), {"keys": keys, "cached": hit and hit_model}


TIMING = "t3"
"""How blocks are timed (``measure.block_compute``), in the cache key: figures timed another way are
measured again (t2: under the CPU backend's allocation meter, as the engine computes; t3: forward and
backward each timed in the same passes, not the backward as a difference of two medians)."""
SSD_TIMING = "s3"
"""How the SSD is timed (``measure.ssd_measure``), in the machine figures' cache key (s2: the fastest of
256 MiB passes, not the median of 64 MiB ones; s3: the I/O path's CPU time per byte not divided by the
cores): figures measured another way are measured again."""
QUICK_CACHE = "quick-profile"
"""The per-machine cache file of quick profiles (``fuyou.machine``)."""
PROFILE_TOLERANCE = 1.3
"""Predicted ÷ measured step time outside [1/this, this] makes a run measure the cached quick profile it was
planned with again (``check_profile``)."""


WARMUP_STEPS = 2
"""Steps a run's steady step time (``profile_check``) leaves out: the first pay for warm-up."""


def check_profile(
    chosen: ChosenPlan, req: PlanRequest, measured_s: float | None, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any] | None:
    """The run's verdict on the profile it was planned with, for run.json: its predicted step time ÷ the
    median measured one (None without either). Where a quick profile (cached, or measured at the run's
    start) is off by more than ``PROFILE_TOLERANCE``, it is measured again in the running process (seconds)
    and the new figures replace the cached ones; the verdict gives both predictions for the plan that ran:
    ``re-measured`` when they differ by more than the tolerance (cached figures measured while the machine
    was busy, or a fresh process faster than a loaded one — seen: 1.4× on a CPU's decoder layers; the
    caller says so with ``note``), else ``cost model`` (the figures hold: the model misses something of
    this setting)."""
    pred = chosen.info.get("predicted_step_s")
    if not pred or not measured_s:
        return None
    rec: dict[str, Any] = {
        "predicted_step_s": pred,
        "measured_step_s": measured_s,
        "predicted_over_measured": pred / measured_s,
    }
    cache = chosen.info.get("profile_cache")
    if 1 / PROFILE_TOLERANCE <= pred / measured_s <= PROFILE_TOLERANCE:
        return rec | {"verdict": "ok"}
    if not cache:
        return rec | {"verdict": "cost model (a profile file, not measured by the run)"}
    log("planner: the run's steps disagree with its quick profile; profiling again (seconds) …")
    fresh, _ = quick_profile(req, device_kind(req.device), log, again=True)
    again = _predicted_step_s(req, fresh, chosen)
    rec |= {"remeasured_step_s": again, "remeasured_over_measured": again / measured_s, "cached": cache["cached"]}
    if 1 / PROFILE_TOLERANCE <= again / pred <= PROFILE_TOLERANCE:
        return rec | {"verdict": "cost model (the profile measured again predicts the same)"}
    was = "the cached quick profile" if cache["cached"] else "the quick profile measured before the run"
    return rec | {
        "verdict": "re-measured",
        "note": f"{was} predicted {pred:.2f} s/step, the run measured {measured_s:.2f} s and the profile "
        f"measured again in the running process predicts {again:.2f} s; the new figures replace the cached "
        "ones" + (" (the cached ones were stale: measured on a busy machine?)" if cache["cached"] else ""),
    }


def _predicted_step_s(req: PlanRequest, prof: Any, chosen: ChosenPlan) -> float:
    """The cost model's step time of the planner's ``chosen`` plan for the run ``req`` on ``prof``, with the
    step configuration the search planned it with."""
    from fuyou.planner.cost import predict

    return predict(_shape(req), chosen.plan, chosen.step, prof).step_s


def _shape(req: PlanRequest) -> Any:
    """The planner's shape of ``req``'s model (its ``--freeze`` parts frozen)."""
    from fuyou.models.description import describe_model

    return describe_model(req.model_config, freeze=req.freeze)


def _stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)


def choose_plan(req: PlanRequest, log: Callable[[str], None] = lambda s: None) -> ChosenPlan:
    """The engine plan for the run ``req`` describes; ``log`` gets one line saying which plan and why.

    Raises ConfigError (the planner's InfeasibleError among them) naming what does not fit and what
    to change, or an unreadable profile.
    """
    if req.mode == "rules":
        pol = _fixed_policies(req)
        kw: dict[str, Any] = {"grad_accum": req.grad_accum}
        if req.prefetch_depth:
            kw["prefetch_depth"] = req.prefetch_depth
        if pol:
            kw["activation_policy"] = pol
        plan = Plan(**kw)
        log(
            f"plan: the engine's budget rules ({req.grad_accum} micro-batches"
            f"{f', prefetch depth {req.prefetch_depth}' if req.prefetch_depth else ''}"
            f"{f', activations {req.activations}' if req.activations else ''})"
        )
        return ChosenPlan(plan, {"source": "rules"})
    from fuyou.planner.cluster import Cluster
    from fuyou.planner.search import plan_inputs, search

    prof, where = _profile(req, log)
    shape = _shape(req)
    budgets, sreq = plan_inputs(
        prof,
        cpu_memory=req.cpu_memory,
        gpu_memory=req.gpu_memory,
        seq_len=req.seq_len,
        tokens_per_step=req.seq_len * req.micro_batch_size * req.grad_accum * req.ranks,
        clip=req.clip,
        optimizer_state=req.stored_format,
        precision=req.precision,
        micro_batch_size=req.micro_batch_size,
        prefetch_depth=req.prefetch_depth,
        activations=req.activations,
        cluster=Cluster(req.ranks),  # one node; the link speed shapes the prediction, not the plan's memory
        lora_rank=req.lora_rank if req.lora_base else None,
    )
    res = search(shape, prof, budgets, sreq)
    quick = where if isinstance(where, dict) else None
    measured = prof if quick is not None and req.profile_out is not None else None
    where = (req.profile_out or "quick (not saved)") if quick is not None else where
    p, plan = res.prediction, res.plan  # the state chunk rides inside the plan
    info = {
        "source": "planner",
        "profile": where,
        "predicted_step_s": p.step_s,
        "predicted_bottleneck": p.bottleneck,
        "predicted_busy_s": p.busy_s,
        "predicted_device_bytes": p.memory.device,
        "predicted_ssd_read_bytes": p.ssd_read_bytes,
        "predicted_ssd_write_bytes": p.ssd_write_bytes,
        "plan": plan.to_json(),
        "state_chunk": plan.state_chunk,
    } | ({"profile_cache": quick} if quick is not None else {})
    log(f"planner: {describe(plan)}; predicted {p.step_s:.2f} s/step, bottleneck {p.bottleneck} (profile {where})")
    return ChosenPlan(plan, info, res.step, measured)


def describe(plan: Plan) -> str:
    """One line naming a plan's knobs, for the run's log."""
    pols = plan.activation_policy[1:-1]
    acts = ", ".join(f"{pols.count(k)}× {k}" for k in POLICIES if k in pols) or "default"
    ram = (
        f", RAM tier: {plan.ram_weight_blocks} blocks' weights, {plan.ram_state_blocks} blocks' state"
        if plan.ram_weight_blocks or plan.ram_state_blocks
        else ""
    )
    experts = f", each layer's experts in {plan.expert_groups} blocks" if plan.expert_groups > 1 else ""
    experts += f", embedding and head in {plan.vocab_groups} blocks of vocabulary rows" if plan.vocab_groups > 1 else ""
    return (
        f"{plan.grad_accum} micro-batches, prefetch depth {plan.prefetch_depth}, layer activations {acts}, "
        f"schedule {plan.schedule}, state chunk {plan.state_chunk} × {plan.state_buffers} buffers{ram}{experts}"
    )


def _fixed_policies(req: PlanRequest) -> tuple[str, ...] | None:
    """``activations`` for every layer (embedding and head keep), as a per-block policy tuple."""
    if not req.activations:
        return None
    from fuyou.models.description import describe_model

    n = len(describe_model(req.model_config).blocks)
    return ("keep",) + (req.activations,) * (n - 2) + ("keep",)


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW's hyperparameters and clipping, as a front end (the CLI, the Trainer plugin) takes them."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    """Global-norm clipping threshold (0: off)."""
    no_decay: frozenset[str] = frozenset()
    """Parameter names without weight decay."""


def engine_config(
    req: PlanRequest,
    chosen: ChosenPlan,
    optim: OptimizerSettings,
    batch: tuple[int, int, int] | None,
    moe_balance: str,
    ssd_dirs: tuple[str, ...] | None = None,
) -> Any:
    """The ``EngineConfig`` of a run planned by ``req`` and ``chosen``: both front ends build it here.
    ``batch``: the steps' shape for admission before the store exists (micro-batch, tokens, micro-batches;
    None: admitted at the first step); ``ssd_dirs``: the store directories as the engine takes them (default
    the request's; several ranks: a template the engine fills in)."""
    from fuyou.engine import EngineConfig

    return EngineConfig(
        ssd_dirs=ssd_dirs if ssd_dirs is not None else req.store_dirs,
        device=req.device,
        gpu_memory=req.gpu_memory,
        cpu_memory=req.cpu_memory,
        precision=req.precision,
        optimizer_state=req.optimizer_state,
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.max_grad_norm,
        no_decay=optim.no_decay,
        plan=chosen.plan,
        moe_balance=moe_balance,
        lora=req.lora,
        freeze=req.freeze,
        batch=batch,
    )
