"""How ``fuyou finetune`` picks its engine plan: the cost-model planner by default.

``--plan auto`` (default) asks the planner (``fuyou.planner.search``) for the fastest plan that fits
the budgets, keeping the run's own batch: ``--micro-batch-size`` × ``--grad-accum`` sequences of
``--seq-len`` tokens per step, split into ``--grad-accum`` micro-batches. It chooses the prefetch
depth, the per-layer activation policy, the state chunk and buffer count, (without clipping) the
schedule and, when spare host memory makes it faster (bf16 runs), which blocks' weights and optimizer
state live in host RAM instead of on SSD (``Plan.ram_weight_blocks``/``ram_state_blocks``).
``--prefetch-depth`` and ``--activations`` fix those choices; ``--plan rules`` uses the
engine's simple budget rules instead (``fuyou.engine.rules``).

The planner reads a hardware profile: ``--profile PATH``, else ``$FUYOU_PROFILE``, else
``hw.json`` in the cache directory (``$FUYOU_CACHE``, default ``~/.cache/fuyou``; written by
``fuyou profile``) if it was measured on the same kind of device. Without one, a quick profile is
measured (seconds: a 64 MiB SSD test in the first store directory, CPU Adam, memcpy, one layer and the
head at the run's micro-batch, in the run's compute dtype), cached per machine (``fuyou.machine``:
the machine's figures per store filesystem, the model's per model shape, batch and dtype) so a re-run,
a resumed run or another run on this machine does not measure again, and saved as
``OUTPUT/profile.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from fuyou.engine.plan import Plan
from fuyou.errors import ConfigError
from fuyou.finetune_config import FinetuneConfig
from fuyou.units import parse_size


def default_profile() -> str:
    """Where ``fuyou profile`` keeps this machine's profile: ``hw.json`` in the cache directory."""
    from fuyou.machine import cache_dir

    return os.path.join(cache_dir(), "hw.json")



@dataclass(frozen=True)
class ChosenPlan:
    """The plan a run uses, the state chunk (None: the engine's default) and how it was chosen."""

    plan: Plan
    state_chunk: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    """For run.json: source (planner|rules), profile, predicted step time and bottleneck."""


def _device_kind(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _profile(cfg: FinetuneConfig, config: Any, log: Callable[[str], None]) -> tuple[Any, str]:
    """The hardware profile for this run and where it came from; see the module docstring."""
    from fuyou.planner.profile import load_profile, save_profile

    path = cfg.profile or os.environ.get("FUYOU_PROFILE")
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"no hardware profile at {path}; run `fuyou profile --ssd DIR --out {path}` or drop --profile")
        return load_profile(path), path
    kind = _device_kind(cfg.device)
    if os.path.isfile(default_profile()):
        prof = load_profile(default_profile())
        if prof.device == kind:
            return prof, default_profile()
    from fuyou.storage.dirs import check_dir

    for d in cfg.store_dirs:
        check_dir(d)  # unusable directories get the store's one-line error before anything is measured
    prof = quick_profile(cfg, config, kind, _stderr)  # said even without progress output: it explains a wait
    out = os.path.join(cfg.output, "profile.json")
    save_profile(prof, out)
    return prof, out


def quick_profile(cfg: FinetuneConfig, config: Any, kind: str, log: Callable[[str], None]) -> Any:
    """The quick profile for this run, from the per-machine cache where measured before (see the
    module docstring). ``cfg.precision`` must be resolved (bf16 or fp32)."""
    from fuyou.device import get_backend
    from fuyou.machine import cached, machine_key
    from fuyou.planner.measure import QUICK, machine_figures, model_figures, profile_from
    from fuyou.planner.shapes import shape_from_config

    backend = get_backend(kind)
    ssd = os.path.abspath(cfg.store_dirs[0])
    base = f"{machine_key(kind + ':' + backend.describe())}/{cfg.precision}"
    said = []

    def measuring(what: str) -> Callable[[], Any]:
        def run() -> Any:
            if not said:
                log("planner: measuring a quick hardware profile of this machine (once; seconds) …")
                said.append(1)
            return (machine_figures(backend, [ssd], cfg.precision, QUICK) if what == "machine" else
                    model_figures(config, backend, (cfg.micro_batch_size,), cfg.seq_len, cfg.precision, QUICK))
        return run

    machine, _ = cached("quick-profile", f"{base}/fs{os.stat(ssd).st_dev}", measuring("machine"))
    sig = shape_from_config(config.to_dict()).signature
    model, _ = cached("quick-profile", f"{base}/{sig}/{cfg.micro_batch_size}x{cfg.seq_len}", measuring("model"))
    return profile_from(machine, model, "quick (fuyou finetune)")


def _stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)


def choose_plan(cfg: FinetuneConfig, config: Any, log: Callable[[str], None] = lambda s: None) -> ChosenPlan:
    """The engine plan for ``cfg`` on ``config`` (a transformers config).

    Raises ConfigError (the planner's InfeasibleError among them) naming what does not fit and what
    to change, or an unreadable profile.
    """
    if cfg.plan == "rules":
        pol = _fixed_policies(cfg, config)
        plan = Plan(micro_batches=cfg.grad_accum, **({"prefetch_depth": cfg.prefetch_depth} if cfg.prefetch_depth else {}),
                    **({"activation_policy": pol} if pol else {}))
        return ChosenPlan(plan, None, {"source": "rules"})
    from fuyou.planner.result import Budgets
    from fuyou.planner.search import Request, search
    from fuyou.planner.shapes import shape_from_config

    prof, where = _profile(cfg, config, log)
    shape = shape_from_config(config.to_dict())
    gpu = parse_size(cfg.gpu_memory, "--gpu-memory") if cfg.gpu_memory is not None else prof.device_memory_bytes
    budgets = Budgets(cpu_memory=parse_size(cfg.cpu_memory, "--cpu-memory"), gpu_memory=gpu)
    req = Request(seq_len=cfg.seq_len, tokens_per_step=cfg.seq_len * cfg.micro_batch_size * cfg.grad_accum,
                  clip=cfg.max_grad_norm > 0, micro_batch_size=cfg.micro_batch_size,
                  prefetch_depth=cfg.prefetch_depth, activations=cfg.activations,
                  precision=cfg.precision)
    res = search(shape, prof, budgets, req)
    p = res.prediction
    info = {"source": "planner", "profile": where, "predicted_step_s": p.step_s, "predicted_bottleneck": p.bottleneck,
            "plan": res.plan.to_json(), "state_chunk": res.step.state_chunk}
    log(f"planner: predicted {p.step_s:.2f} s/step, bottleneck {p.bottleneck} (profile {where})")
    return ChosenPlan(res.plan, res.step.state_chunk, info)


def _fixed_policies(cfg: FinetuneConfig, config: Any) -> tuple[str, ...] | None:
    """``--activations`` for every layer (embedding and head keep), as a per-block policy tuple."""
    if not cfg.activations:
        return None
    from fuyou.planner.shapes import shape_from_config

    n = len(shape_from_config(config.to_dict()).blocks)
    return ("keep",) + (cfg.activations,) * (n - 2) + ("keep",)
