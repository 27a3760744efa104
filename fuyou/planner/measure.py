"""Measurements behind ``fuyou profile``: real speeds of this machine, not datasheet peaks.

Heavy imports (torch, the store, numba Adam, the model adapter) happen inside the functions, so the
planner package itself stays importable without them. Each function returns plain numbers
(bytes/s, parameters/s, FLOP/s) and takes the median of ``repeats`` runs after one warm-up.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from fuyou.planner.profile import ComputePoint, HardwareProfile


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _median(fn: Callable[[], Any], repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


def ssd_measure(
    dirs: list[str], size_bytes: int = 512 << 20, extent_bytes: int = 64 << 20, threads: int = 16, repeats: int = 3
) -> tuple[float, float, float]:
    """(read B/s, write B/s, CPU share per byte) of the store's own I/O path striped over ``dirs``
    (O_DIRECT where the filesystem allows, checksums on): ``size_bytes`` in extents of
    ``extent_bytes``, all in flight at once, as the engine issues them. Writes go to recycled files
    after a warm-up, as in training. Each rate is the fastest of ``repeats`` passes: a moment the
    machine or a shared disk is busy only slows a pass, and the engine's continuous stream of state
    reads and writes runs at least at a pass's rate (each pass also pays the start and drain of its
    burst). The third figure is the process's CPU time (all threads) over the timed runs ÷ bytes moved
    (``HardwareProfile.io_cpu_s_per_byte``).

    Raises StoreError subclasses if a directory is unusable or short of space.
    """
    import torch

    from fuyou.device import host_aligned_empty
    from fuyou.storage import ExtentSpec, TensorSpec, TensorStore

    n = max(1, size_bytes // extent_bytes)
    exts = [ExtentSpec(f"p{i}", (TensorSpec("x", (extent_bytes,), torch.uint8),)) for i in range(n)]
    bufs = [host_aligned_empty(extent_bytes) for _ in range(n)]
    work = [tempfile.mkdtemp(prefix="fuyou-profile-", dir=d) for d in dirs]
    try:
        store = TensorStore.create(work, exts, io="auto", direct="auto", threads=threads, fsync=False)
        with store:

            def run(op: str) -> None:
                for f in [getattr(store, op)(e.name, b) for e, b in zip(exts, bufs)]:
                    f.result()

            def write() -> None:
                run("write")
                store.commit({})

            cpu0 = time.process_time()
            w = min(_times(write, repeats))
            r = min(_times(lambda: run("read"), repeats))
            cpu = time.process_time() - cpu0
    finally:
        for d in work:
            shutil.rmtree(d, ignore_errors=True)
    total = n * extent_bytes
    moved = 2 * (repeats + 1) * total  # _median runs each once more as a warm-up
    return total / r, total / w, cpu / moved


def adam_throughput(params: int = 32 << 20, repeats: int = 3, threads: int | None = None, int8: bool = False) -> float:
    """Parameters/s of ``fuyou.optim.adamw_step`` as the engine calls it (fp32 master/m/v in place,
    bf16 gradient in, bf16 weights out) on ``params`` elements, with ``threads`` numba threads; with
    ``int8``, of ``adamw_int8_step`` (8-bit moments on a split master, one call per state chunk)."""
    import numba
    import torch

    from fuyou.optim import adamw_int8_step, adamw_step
    from fuyou.optim.quant8 import int8_from_fp32

    master, m, v = (torch.randn(params) for _ in range(3))
    v.abs_()
    grad = torch.randn(params, dtype=torch.bfloat16)
    out = torch.empty(params, dtype=torch.bfloat16)
    step = [0]
    if int8:
        rem = torch.zeros(params, dtype=torch.int16)
        mq, vq, ms, vs = int8_from_fp32(m * 1e-3, v * 1e-6)
        del master, m, v

    def run() -> None:
        step[0] += 1
        if int8:
            adamw_int8_step(rem, mq, vq, ms, vs, grad, lr=1e-4, step=step[0], out=out, runs=[(0, params, True)])
        else:
            adamw_step(master, m, v, grad, lr=1e-4, step=step[0], out=out)

    before = numba.get_num_threads()  # per calling thread: restored so later kernels here keep all cores
    if threads:
        numba.set_num_threads(threads)
    try:
        return params / _median(run, repeats)
    finally:
        numba.set_num_threads(before)


def _dtype(precision: str) -> Any:
    import torch

    return torch.float32 if precision == "fp32" else torch.bfloat16


def device_elementwise(
    backend: Any, elems: int = 64 << 20, repeats: int = 3, precision: str = "bf16"
) -> tuple[float, float]:
    """(gradient accumulation, gradient norm) elements/s on the device, in the compute dtype
    (``precision``): ``g += x`` into a device buffer (autograd's AccumulateGrad into the engine's preset
    gradients) and the engine's ``sum_squares`` norm. See ``HardwareProfile.grad_add_elems_per_s``."""
    import torch

    from fuyou.optim.norm import sum_squares

    g = backend.device_empty((elems,), _dtype(precision), "profile gradient").zero_()
    x = torch.ones(elems, dtype=_dtype(precision), device=backend.device)

    def add() -> None:
        g.add_(x)
        backend.synchronize()

    return elems / _median(add, repeats), elems / _median(lambda: sum_squares(g), repeats)


def host_memcpy(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Host copy rate, bytes copied per second (one side counted), between page-aligned buffers, as the
    engine copies extents host to host (``host_copy`` on a serial worker thread: the RAM tier's reads
    and writes, the new weights' hand-off), which is the rate the planner charges those copies."""
    from concurrent.futures import ThreadPoolExecutor

    from fuyou.device import host_aligned_empty
    from fuyou.device.host_threads import host_copy, serial_worker

    a, b = host_aligned_empty(nbytes), host_aligned_empty(nbytes)
    b.copy_(a)  # both touched
    with ThreadPoolExecutor(1, initializer=serial_worker) as worker:
        return nbytes / worker.submit(_median, lambda: host_copy(b, a), repeats).result()


def host_device_copy(backend: Any, nbytes: int = 256 << 20, repeats: int = 3) -> tuple[float, float]:
    """(host→device, device→host) bytes/s between the backend's host buffers (pinned on CUDA) and device
    memory; on the CPU backend this is a memcpy."""
    import torch

    host = backend.host_empty(nbytes)
    dev = backend.device_empty((nbytes,), torch.uint8, "profile copy buffer")

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        backend.synchronize()

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        backend.synchronize()

    return nbytes / _median(h2d, repeats), nbytes / _median(d2h, repeats)


def matmul_peak(
    backend: Any, n: int = 2048, repeats: int = 3, precision: str = "bf16", max_s: float | None = None
) -> float:
    """Achieved FLOP/s of an ``n × n × n`` matmul in the compute dtype on the device (the MFU reference).

    With ``max_s``, ``n`` is at most the largest power-of-two size from 256 whose one matmul is expected
    to take ≤ ``max_s`` seconds (so a CPU that emulates bf16 is measured in seconds, not minutes).
    """
    import torch

    if max_s is not None:
        n = min(n, _matmul_size_within(backend, precision, max_s))
    a = torch.randn(n, n, device=backend.device).to(_dtype(precision))
    b = torch.randn(n, n, device=backend.device).to(_dtype(precision))

    def run() -> None:
        a @ b
        backend.synchronize()

    return 2 * n**3 / _median(run, repeats)


def _matmul_size_within(backend: Any, precision: str, max_s: float) -> int:
    """The largest n (256, 512, …) whose n³ matmul should take ≤ ``max_s``: time 256, scale by n³."""
    import torch

    a = torch.randn(256, 256, device=backend.device).to(_dtype(precision))
    a @ a
    backend.synchronize()
    t0 = time.perf_counter()
    a @ a
    backend.synchronize()
    t, n = time.perf_counter() - t0, 256
    while t * 8 <= max_s and n < 1 << 15:
        t, n = t * 8, n * 2
    return n


def block_compute(
    config: Any,
    backend: Any,
    block: int,
    micro_batch: int,
    seq_len: int,
    flops_per_token: int,
    repeats: int = 5,
    precision: str = "bf16",
    lora: Any = None,
) -> tuple[ComputePoint, float]:
    """Forward and backward speed of one block of ``config``'s model on the device, with random
    weights of the block's shapes in the compute dtype (``precision``), at ``micro_batch × seq_len``
    tokens (through the model adapter, as the engine runs it). Returns (the ComputePoint, bytes the
    block saved for backward per token).

    ``flops_per_token`` is the block's forward FLOPs per token (``shapes.BlockShape.fwd_flops_per_token``).
    With ``lora`` (``LoraSettings``) the block runs as a LoRA run's does: its base frozen, peft's adapters
    (fp32) trained beside it; its backward rate is then its forward FLOPs ÷ the backward's time, the
    rate the cost model divides a frozen block's backward by (``graph.StepGraph._bwd_s``). The backward of
    a frozen base does not take half a trained one's time: the adapters' own matmuls and casts, and every
    element-wise op's backward, remain.
    """
    import torch

    from fuyou.models.adapters import make_adapter
    from fuyou.models.blocks import BlockSpec

    ad = make_adapter(config, lora)
    ad.prepare(backend.device)
    if lora is not None:
        from fuyou.engine.lora import LoraState

        LoraState(ad.model, lora, backend.device, {}, {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
    dev = backend.device
    specs: list[BlockSpec] = ad.blocks

    def rand(spec: BlockSpec) -> dict[str, torch.Tensor]:
        out = {p.key: (torch.randn(p.shape, device=dev) * 0.02).to(_dtype(precision)) for p in spec.params}
        for buf in spec.buffers:  # the family's (router biases), in the dtype it keeps them in
            out[buf.key] = torch.zeros(buf.shape, device=dev, dtype=buf.dtype(_dtype(precision)))
        return out

    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=dev)
    embed = rand(specs[0])
    with torch.no_grad():  # the embed block makes the context (mask, rotary) every layer needs
        ad.bind(0, embed)
        x, ctx = ad.forward(0, ids, None)
        ad.unbind(0)
    tensors = rand(specs[block]) if block else embed
    for other in specs[block].borrows:
        tensors.update(embed if other == specs[0].name else rand(next(s for s in specs if s.name == other)))
    # a run's next block reads weights it has not touched yet, from memory: a layer timed on one set of
    # weights over and over finds them in the CPU's caches (1.5× faster at 256 tokens, seen on a 7 MB
    # SmolLM2 layer). A layer is timed cycling through distinct sets of at least COLD_BYTES together,
    # bound before each pass as the engine binds each block.
    layer = 0 < block < len(specs) - 1
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sets = [tensors] + [rand(specs[block]) for _ in range(min(7, COLD_BYTES // max(nbytes, 1)) if layer else 0)]
    turn = [0]
    params = ad.bind(block, tensors)
    x = ids if block == 0 else (torch.randn(x.shape, device=dev) * 0.5).to(_dtype(precision))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in params.values()):
            saved[0] += t.numel() * t.element_size()
        return t

    def fwd() -> torch.Tensor:
        if len(sets) > 1:
            turn[0] += 1
            params.update(ad.bind(block, sets[turn[0] % len(sets)]))
        # as the engine computes: on the CPU backend every allocation is counted (cpu_allocations), which
        # costs a few µs an op — 7 % of a SmolLM2 step, 22 % of a LoRA one (many small ops)
        with torch.enable_grad(), backend.counting("a block's timing"):
            y, _ = ad.forward(block, x.detach().requires_grad_(x.is_floating_point()), ctx)
        backend.synchronize()
        return y

    # as the engine runs them: the head adds its weight gradient into a preset .grad (adapters.HeadLinear);
    # a layer's weight gradients come out fresh (the engine's add into its buffer is modelled apart:
    # HardwareProfile.grad_add_elems_per_s)
    head = block == len(specs) - 1
    for p in params.values():
        p.grad = torch.zeros_like(p) if head else None

    def fwd_bwd() -> tuple[float, float]:
        """One pass: (forward s, backward s), each timed on its own."""
        t0 = time.perf_counter()
        y = fwd()
        t1 = time.perf_counter()
        with backend.counting("a block's timing"):
            y.float().square().mean().backward()  # a loss-like reduction (the head's logits included)
        backend.synchronize()
        t2 = time.perf_counter()
        if not head:
            for p in params.values():
                p.grad = None
        return t1 - t0, t2 - t1

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd()
    fwd_bwd()  # warm-up: the backward's first pass allocates what later ones reuse
    # forward and backward timed in the same passes, each its own median: a backward taken as the
    # difference of two medians (forward + backward, forward alone) swung 7× when one of them caught a
    # busy moment (35.9 GF/s forward, 255 GF/s backward — above the machine's peak — in one profile)
    passes = [fwd_bwd() for _ in range(repeats)]
    t_f = statistics.median(p[0] for p in passes)
    t_b = max(statistics.median(p[1] for p in passes), 1e-9)
    ad.unbind(block)
    tokens = micro_batch * seq_len
    flops = flops_per_token * tokens
    return ComputePoint(tokens, flops / t_f, (1 if lora is not None else 2) * flops / t_b, seq_len), saved[0] / tokens


COLD_BYTES = 64 << 20
"""Bytes of distinct weights a layer's timing cycles through (``block_compute``): beyond a CPU's last-level cache."""

QUICK = {
    "ssd_bytes": 256 << 20,  # 64 MiB passes measured 0.6-0.8 of the rate a run's state stream reached
    "adam_params": 4 << 20,
    "copy_bytes": 64 << 20,
    "elems": 16 << 20,
    "matmul_n": 1024,
    "matmul_max_s": 0.25,
    "repeats": 3,
    "compute_repeats": 5,  # a median of five passes: two busy moments do not set the profile every later run inherits
    "head_tokens": 256,
}
"""Sizes of the quick profile ``fuyou finetune`` measures when it has none (seconds on any CPU)."""
FULL = {
    "ssd_bytes": 512 << 20,
    "adam_params": 32 << 20,
    "copy_bytes": 256 << 20,
    "elems": 64 << 20,
    "matmul_n": 2048,
    "matmul_max_s": None,
    "repeats": 3,
    "compute_repeats": 5,
    "head_tokens": 0,
}
"""Sizes of ``fuyou profile``."""


def machine_figures(
    backend: Any,
    ssd_dirs: list[str],
    precision: str = "bf16",
    sizes: dict | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """The model-independent ``HardwareProfile`` fields of this machine as plain data: SSD (per
    directory and striped), CPU Adam, host memcpy, host↔device copies, element-wise device rates and
    the matmul peak in the compute dtype. ``sizes``: ``FULL`` (default) or ``QUICK``.

    Raises StoreError subclasses for unusable or full directories.
    """
    z = {**FULL, **(sizes or {})}
    per_dir: list[dict[str, Any]] = []
    for d in ssd_dirs:
        log(f"SSD {d} …")
        r, w, io_cpu = ssd_measure([d], z["ssd_bytes"])
        per_dir.append({"dir": d, "read_Bps": r, "write_Bps": w, "io_cpu_s_per_byte": io_cpu})
    r, w, io_cpu = (
        ssd_measure(ssd_dirs, z["ssd_bytes"])
        if len(ssd_dirs) > 1
        else (per_dir[0]["read_Bps"], per_dir[0]["write_Bps"], per_dir[0]["io_cpu_s_per_byte"])
    )
    log("CPU Adam …")
    adam = adam_throughput(z["adam_params"], z["repeats"])
    adam_int8 = adam_throughput(z["adam_params"], z["repeats"], int8=True)
    log("host memory …")
    mem = host_memcpy(z["copy_bytes"], z["repeats"])
    h2d, d2h = host_device_copy(backend, z["copy_bytes"], z["repeats"])
    log("device element-wise work …")
    add, norm = device_elementwise(backend, z["elems"], z["repeats"], precision)
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = backend.name == "cpu"
    return {
        "ssd_read_Bps": r,
        "ssd_write_Bps": w,
        "adam_params_per_s": adam,
        "adam_int8_params_per_s": adam_int8,
        "device": "cpu" if cpu else "cuda",
        "h2d_Bps": h2d,
        "d2h_Bps": d2h,
        "host_mem_Bps": mem,
        "device_mem_Bps": mem if cpu else 1e12,
        "grad_add_elems_per_s": add,
        "grad_norm_elems_per_s": norm,
        "io_cpu_s_per_byte": io_cpu,
        "device_memory_bytes": int(total_ram // 4 if cpu else backend.memory().capacity),
        "host_memory_bytes": int(total_ram),
        "ssd_capacity_bytes": int(sum(shutil.disk_usage(d).total for d in ssd_dirs)),
        "ssd_count": len(ssd_dirs),
        "per_dir": per_dir,
        "device_peak_flops": matmul_peak(backend, z["matmul_n"], z["repeats"], precision, z["matmul_max_s"]),
        "notes": {
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "ssd_bytes": z["ssd_bytes"],
            "adam_params": z["adam_params"],
            "method": "fuyou.planner.measure",
        },
    }


def model_figures(
    config: Any,
    backend: Any,
    micro_batches: tuple[int, ...],
    seq_len: int,
    precision: str = "bf16",
    sizes: dict | None = None,
    log: Callable[[str], None] = lambda s: None,
    lora: Any = None,
) -> dict[str, Any]:
    """The model-dependent ``HardwareProfile`` fields as plain data: decoder-layer and head compute
    points at ``micro_batches`` × ``seq_len`` in the compute dtype, and the layer's activation bytes.
    With ``sizes["head_tokens"]`` (``QUICK``) the head is timed at no more than that many tokens (its
    speed there stands for larger micro-batches: the planner holds the nearest point). With ``lora``
    (``LoraSettings``) the blocks are timed as a LoRA run computes them (``block_compute``)."""
    from fuyou.models.description import describe_model

    z = {**FULL, **(sizes or {})}
    shape = describe_model(config)
    H = len(shape.blocks) - 1
    compute, head, act = [], [], 0.0
    for mb in micro_batches:
        log(f"compute, micro-batch {mb} × {seq_len} …")
        pt, act = block_compute(
            config,
            backend,
            1,
            mb,
            seq_len,
            shape.blocks[1].fwd_flops_per_token(shape.hidden, seq_len),
            z["compute_repeats"],
            precision,
            lora,
        )
        compute.append(dataclasses.asdict(pt))
        hmb = mb if not z["head_tokens"] else max(1, min(mb, z["head_tokens"] // seq_len))
        hp, _ = block_compute(
            config,
            backend,
            H,
            hmb,
            seq_len,
            shape.blocks[H].fwd_flops_per_token(shape.hidden, seq_len),
            z["compute_repeats"],
            precision,
            lora,
        )
        head.append(dataclasses.asdict(hp))
    return {
        "compute": compute,
        "head_compute": head,
        "layer_act_bytes_per_token": act,
        "model_signature": shape.signature,
        "compute_bytes": 4 if precision == "fp32" else 2,
    } | ({"lora_step_s": lora_step(config, backend, lora, z["compute_repeats"])} if lora is not None else {})


def lora_step(config: Any, backend: Any, lora: Any, repeats: int = 3) -> float:
    """Seconds (``_median``: of ``repeats`` after one warm-up) of the adapter update a LoRA run makes at each
    step's end, as ``fuyou.engine.step`` makes it: the gradients' squared norm, clipping and AdamW over
    every adapter of ``config``'s model with ``lora`` (``LoraSettings``), on the device. On a CPU its
    hundreds of small tensors cost a tenth of a SmolLM2 step; on a GPU, microseconds."""
    import torch

    from fuyou.engine.lora import LoraState
    from fuyou.models.adapters import make_adapter

    ad = make_adapter(config, lora)
    state = LoraState(ad.model, lora, backend.device, {}, {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
    for p in state.params.values():
        p.grad = torch.randn_like(p) * 1e-3

    def once() -> None:
        with backend.counting("a LoRA update's timing"):
            norm = float(state.sq_norm()) ** 0.5
            state.step(1e-5, min(1.0, 1.0 / (norm + 1e-6)))
        backend.synchronize()

    return _median(once, repeats)


def profile_from(
    machine: dict[str, Any], model: dict[str, Any] | None, name: str = "", notes: dict | None = None
) -> HardwareProfile:
    """A ``HardwareProfile`` from ``machine_figures`` and (optionally) ``model_figures`` data."""
    import socket

    fields = {**machine, **(model or {})}
    fields["notes"] = {**machine.get("notes", {}), **(notes or {})}
    return HardwareProfile.from_json({**fields, "name": name or socket.gethostname()})


def measure_profile(
    ssd_dirs: list[str],
    config: Any = None,
    micro_batches: tuple[int, ...] = (1, 2, 4),
    seq_len: int = 256,
    device: str = "auto",
    ssd_bytes: int = 512 << 20,
    adam_params: int = 32 << 20,
    name: str = "",
    log: Callable[[str], None] = lambda s: None,
    precision: str = "bf16",
) -> HardwareProfile:
    """Measure everything a profile holds on this machine (``machine_figures``, and with ``config``
    — a transformers config — ``model_figures`` at ``micro_batches`` × ``seq_len``), at full size.

    Raises FuyouError subclasses for unusable directories; the backend's errors if ``device`` is
    unavailable.
    """
    from fuyou.device import get_backend

    backend = get_backend(device)
    sizes = {"ssd_bytes": ssd_bytes, "adam_params": adam_params}
    machine = machine_figures(backend, ssd_dirs, precision, sizes, log)
    model = model_figures(config, backend, micro_batches, seq_len, precision, log=log) if config is not None else None
    return profile_from(machine, model, name, {"seq_len": seq_len})
