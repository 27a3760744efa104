"""``fuyou plan`` and ``fuyou profile``: the planner's commands (registered in ``cli/main.py``).

``plan`` reads a model config (or a named shape), describes the model from its meta-device skeleton
(``fuyou.models.description``: no memory, seconds for 405B parameters) and a hardware profile, and prints
the chosen plan with its prediction. ``profile`` measures this machine.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import click

from fuyou.schedule.plan import DEFAULT_MAX_GRAD_NORM, POLICIES
from fuyou.schedule.state_format import DEFAULT_FORMAT, OFFERED

if TYPE_CHECKING:
    from fuyou.planner.profile import HardwareProfile
    from fuyou.planner.result import Budgets
    from fuyou.planner.search import Request
    from fuyou.schedule.shapes import ModelShape

DEFAULT_PROFILE = "$FUYOU_CACHE/hw.json (default ~/.cache/fuyou/hw.json)"
"""How the default profile path reads in help texts; ``_default_profile()`` is the path."""


def _default_profile() -> str:
    from fuyou.machine import cache_dir

    return os.path.join(cache_dir(), "hw.json")


def _profile_path(path: str | None) -> str:
    from fuyou.errors import ConfigError

    path = path or os.environ.get("FUYOU_PROFILE") or _default_profile()
    if not os.path.isfile(path):
        raise ConfigError(
            f"no hardware profile at {path}; run `fuyou profile --ssd DIR` first, or pass --profile "
            "(hand-written examples: bench/profiles/)"
        )
    return path


def _load_shape(model: str) -> ModelShape:
    """The description of ``model`` (``fuyou.models.description.load_description``); a hub id's config.json
    comes from the Hugging Face cache (fetched if needed: ``fuyou.models.hub``), and the shape keeps the id as
    its name."""
    import dataclasses

    from fuyou.models.description import load_description
    from fuyou.models.hub import CONFIG_FILES, is_hub_id, resolve_model

    if not is_hub_id(model):
        return load_description(model)
    return dataclasses.replace(load_description(resolve_model(model, CONFIG_FILES)), name=model)


@click.command("plan")
@click.argument("model")
@click.option(
    "--profile", "profile_path", type=click.Path(), help=f"Hardware profile JSON (default {DEFAULT_PROFILE})."
)
@click.option(
    "--cpu-memory",
    help="Host budget for buffers and swapped activations, per rank (default 3/4 of the profile's RAM ÷ --gpus).",
)
@click.option("--gpu-memory", help="Device-memory budget (default: the profile's device memory).")
@click.option("--ssd-space", help="Free SSD space for the store (default: not checked).")
@click.option("--seq-len", type=int, default=1024, show_default=True)
@click.option("--tokens-per-step", type=int, help="Tokens per optimizer step (default 8 sequences).")
@click.option(
    "--max-grad-norm",
    type=float,
    default=DEFAULT_MAX_GRAD_NORM,
    show_default=True,
    help="Global-norm clipping as fuyou finetune's (0 = off; > 0 forces the overlap_next_forward schedule).",
)
@click.option(
    "--optimizer-state",
    type=click.Choice(list(OFFERED)),
    default=DEFAULT_FORMAT,
    show_default=True,
    help="How AdamW's state is stored (fuyou finetune's default for a new run: split): fp32; split (the master as the bf16 weights + a remainder: identical "
    "updates, fewer bytes); bf16 (split with bf16 moments: lossy); int8 (split with 8-bit block-wise moments: lossy, "
    "fewest bytes).",
)
@click.option(
    "--precision",
    type=click.Choice(["bf16", "fp32"]),
    default="bf16",
    show_default=True,
    help="Compute dtype of the run (`fuyou finetune --precision auto` picks fp32 where bf16 is slow).",
)
@click.option("--micro-batch-size", type=int, help="Fix the micro-batch size instead of searching it.")
@click.option("--schedule", type=click.Choice(["overlap_backward", "overlap_next_forward"]), help="Fix the schedule.")
@click.option("--prefetch-depth", type=int, help="Fix the prefetch depth.")
@click.option(
    "--activations",
    type=click.Choice(list(POLICIES)),
    help="One activation policy for every layer instead of searching.",
)
@click.option(
    "--gpus", type=int, default=1, show_default=True, help="Data-parallel ranks per node (torchrun --nproc-per-node)."
)
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes (torchrun --nnodes).")
@click.option(
    "--interconnect",
    default="pcie4",
    show_default=True,
    help="Bus bandwidth of collectives within a node: pcie4, pcie5, nvlink (stated typical figures) or GB/s.",
)
@click.option(
    "--network",
    default="ib200",
    show_default=True,
    help="Bus bandwidth of collectives across nodes (each node's link): ib200 or GB/s.",
)
@click.option(
    "--lora-rank",
    type=int,
    help="Plan LoRA of this rank on the frozen base: weights only read, no optimizer state or writes.",
)
@click.option("--json", "json_out", type=click.Path(), help="Also write the result as JSON here ('-' for stdout only).")
def plan_cmd(
    model: str,
    profile_path: str | None,
    cpu_memory: str | None,
    gpu_memory: str | None,
    ssd_space: str | None,
    seq_len: int,
    tokens_per_step: int | None,
    max_grad_norm: float,
    optimizer_state: str,
    precision: str,
    micro_batch_size: int | None,
    schedule: str | None,
    prefetch_depth: int | None,
    activations: str | None,
    gpus: int,
    nodes: int,
    interconnect: str,
    network: str,
    lora_rank: int | None,
    json_out: str | None,
) -> None:
    """Plan a run of MODEL (a model directory, a config.json, a hub id ORG/NAME[@REVISION] whose config.json is
    fetched into the Hugging Face cache, or a named shape such as GPT-3-13B).

    With --gpus/--nodes the profile describes one rank (its GPU, its share of the cores, its own
    SSDs), budgets are per rank and --tokens-per-step is the global batch."""
    from fuyou.planner.profile import load_profile
    from fuyou.planner.search import search

    shape = _load_shape(model)
    prof = load_profile(_profile_path(profile_path))
    bud, req = plan_inputs(
        prof,
        cpu_memory=cpu_memory,
        gpu_memory=gpu_memory,
        ssd_space=ssd_space,
        seq_len=seq_len,
        tokens_per_step=tokens_per_step,
        max_grad_norm=max_grad_norm,
        optimizer_state=optimizer_state,
        precision=precision,
        micro_batch_size=micro_batch_size,
        schedule=schedule,
        prefetch_depth=prefetch_depth,
        activations=activations,
        gpus=gpus,
        nodes=nodes,
        interconnect=interconnect,
        network=network,
        lora_rank=lora_rank,
    )
    res = search(shape, prof, bud, req)
    if json_out == "-":
        click.echo(json.dumps(res.to_json(), indent=2))
        return
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res.to_json(), f, indent=2)
    print_result(res, shape.params, max_grad_norm)


def plan_inputs(
    prof: HardwareProfile,
    *,
    max_grad_norm: float = DEFAULT_MAX_GRAD_NORM,
    gpus: int = 1,
    nodes: int = 1,
    interconnect: str = "pcie4",
    network: str = "ib200",
    cpu_memory: str | None = None,
    **settings: Any,
) -> tuple[Budgets, Request]:
    """The budgets and the planner request of ``fuyou plan`` with these options (each as its flag; defaults
    as the command's), on the hardware profile ``prof``: what the command searches, and what
    ``bench/bench_frontier_plans.py`` searches too, built by the search's own ``plan_inputs`` (which takes
    ``settings``: ``gpu_memory``, ``seq_len``, ``tokens_per_step``, …) as ``fuyou finetune``'s plan chooser
    builds its, so none can drift apart. ``max_grad_norm`` > 0 turns clipping on (default: ``fuyou
    finetune``'s, ``DEFAULT_MAX_GRAD_NORM``); ``gpus``/``nodes`` and the link names make the cluster.

    Raises ConfigError for an unreadable size or link speed."""
    from fuyou.planner.cluster import Cluster, link_Bps
    from fuyou.planner.search import plan_inputs as inputs

    cluster = Cluster(gpus, nodes, link_Bps(interconnect, "--interconnect"), link_Bps(network, "--network"))
    return inputs(prof, cpu_memory=cpu_memory, clip=max_grad_norm > 0, cluster=cluster, **settings)


def _policies(pol: tuple[str, ...]) -> str:
    """Run-length summary: ``keep ×1, recompute ×30, swap_cpu ×10, keep ×1``."""
    out: list[list] = []
    for p in pol:
        if out and out[-1][0] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return ", ".join(f"{p} ×{n}" for p, n in out)


def print_result(res: object, params: int, max_grad_norm: float = 0.0) -> None:
    """Print a PlannerResult as a rich table (``max_grad_norm``: the clipping it was planned with, 0 = off)."""
    from rich.console import Console
    from rich.table import Table

    from fuyou.units import format_size as fs

    con = Console()
    for r, title in ((res, "plan"),):
        p, s, pr, m = r.plan, r.step, r.prediction, r.prediction.memory
        t = Table(title=f"{title}: {r.model} ({params / 1e9:.2f} B params) on {r.profile}", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        world = s.cluster.world
        ranks = f" × {world} ranks" if world > 1 else ""
        t.add_row(
            "batch",
            f"micro-batch {s.micro_batch_size} × accumulation {p.grad_accum} × seq {s.seq_len}{ranks} "
            f"= {pr.tokens} tokens/step",
        )
        t.add_row(
            "schedule",
            f"{p.schedule} ({f'clipping at global norm {max_grad_norm:g}' if max_grad_norm > 0 else 'no clipping'}), "
            f"prefetch depth {p.prefetch_depth}, state buffers {p.state_buffers}, "
            f"state chunk {p.state_chunk} elements",
        )
        if p.expert_groups > 1:
            t.add_row(
                "experts", f"each mixture-of-experts layer streams as a core block + {p.expert_groups} expert groups"
            )
        if p.vocab_groups > 1:
            t.add_row(
                "vocabulary",
                f"the embedding and the LM head stream as {p.vocab_groups} blocks of vocabulary rows each "
                "(the host budget is below their whole blocks' buffers)",
            )
        t.add_row("activations", _policies(p.activation_policy))
        if p.ram_weight_blocks or p.ram_state_blocks:
            t.add_row(
                "RAM tiers",
                f"weights of {p.ram_weight_blocks} blocks and state of {p.ram_state_blocks} blocks in RAM",
            )
        t.add_row(
            "memory",
            f"device {fs(m.device)}, host {fs(m.host)} (buffers {fs(m.host_buffers)}, activations "
            f"{fs(m.host_activations)}, RAM tiers {fs(m.host_ram_tiers)}), SSD {fs(m.ssd)}",
        )
        if m.device_by_kind:
            t.add_row(
                "device peak",
                f"{fs(m.device)} in {m.device_phase}; by block kind: "
                + ", ".join(f"{k} {fs(v)}" for k, v in m.device_by_kind.items()),
            )
        if world > 1:
            t.add_row(
                "ranks",
                f"{s.cluster.gpus_per_node} per node × {s.cluster.nodes} nodes, bus "
                f"{s.cluster.bus_Bps / 1e9:.0f} GB/s; collectives {pr.comm_bytes / 1e9:.2f} GB/step per rank; "
                "memory and SSD figures are per rank",
            )
        own = params / world  # a rank stores and updates its shard of every block
        t.add_row(
            "SSD per step",
            f"read {pr.ssd_read_bytes / 1e9:.1f} GB, write {pr.ssd_write_bytes / 1e9:.1f} GB "
            f"({pr.ssd_read_bytes / own:.1f} + {pr.ssd_write_bytes / own:.1f} B per parameter"
            f"{' of the rank' if world > 1 else ''}, optimizer state {s.optimizer_state}); "
            f"{pr.dwpd:.2f} drive-writes/day",
        )
        t.add_row(
            "step",
            f"[bold]{pr.step_s:.3f} s[/], {pr.tokens_per_s:.1f} tokens/s, {pr.tflops:.2f} TFLOPS"
            + (f" (MFU {pr.mfu:.0%})" if pr.mfu else ""),
        )
        t.add_row(
            "bottleneck",
            pr.bottleneck
            + " — busy s: "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(pr.extra["resource_busy_s"].items(), key=lambda kv: -kv[1])),
        )
        t.add_row("FLOPs", pr.flop_formula)
        con.print(t)


@click.command("profile")
@click.option(
    "--ssd", "ssd_dirs", multiple=True, required=True, type=click.Path(), help="Store directory (repeat per SSD)."
)
@click.option("--model", help="Model directory (or its config.json, or a hub id ORG/NAME) for per-layer compute times.")
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--micro-batches", default="1,2,4", show_default=True, help="Micro-batch sizes to time the layer at.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--ssd-bytes", default="512MiB", show_default=True, help="Bytes written and read per SSD measurement.")
@click.option("--name", default="", help="Profile name (default: the host name).")
@click.option("--out", type=click.Path(), help=f"Where to write the JSON (default {DEFAULT_PROFILE}).")
@click.option(
    "--precision",
    type=click.Choice(["bf16", "fp32"]),
    default="bf16",
    show_default=True,
    help="Compute dtype to time the matmul peak and the layers in.",
)
def profile_cmd(
    ssd_dirs: tuple[str, ...],
    model: str | None,
    seq_len: int,
    micro_batches: str,
    device: str,
    ssd_bytes: str,
    name: str,
    out: str | None,
    precision: str,
) -> None:
    """Measure this machine (SSD, Adam, memory, copies, per-layer compute) and save a hardware profile."""
    from fuyou.planner.measure import measure_profile
    from fuyou.planner.profile import save_profile
    from fuyou.storage.dirs import check_dir
    from fuyou.units import parse_size

    dirs = [check_dir(d) for d in ssd_dirs]
    config = None
    if model:
        from fuyou.models.hf_io import load_config
        from fuyou.models.hub import CONFIG_FILES, resolve_model

        model = resolve_model(model, CONFIG_FILES)
        config = load_config(os.path.dirname(model) if model.endswith(".json") else model)
    try:
        mbs = tuple(int(x) for x in micro_batches.split(","))
    except ValueError:
        raise click.BadParameter(
            f"expected sizes like 1,2,4, got {micro_batches!r}", param_hint="--micro-batches"
        ) from None
    prof = measure_profile(
        dirs,
        config,
        mbs,
        seq_len,
        device,
        parse_size(ssd_bytes, "--ssd-bytes"),
        name=name,
        log=lambda s: click.echo(s, err=True),
        precision=precision,
    )
    out = out or _default_profile()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_profile(prof, out)
    click.echo(
        f"SSD read {prof.ssd_read_Bps / 1e9:.2f} GB/s, write {prof.ssd_write_Bps / 1e9:.2f} GB/s; Adam "
        f"{prof.adam_params_per_s / 1e9:.2f} G params/s; memcpy {prof.host_mem_Bps / 1e9:.1f} GB/s; "
        f"H2D {prof.h2d_Bps / 1e9:.1f} GB/s; layer fwd "
        + ", ".join(f"{p.fwd_flops_per_s / 1e9:.0f} GFLOP/s @ {p.tokens} tok" for p in prof.compute)
    )
    click.echo(f"profile written to {out}")
