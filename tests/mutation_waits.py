"""Mutation check of the data path's waits: delete one at a time and show that a test fails.

    python tests/mutation_waits.py                 # every mutation, the asynchronous-backend suites
    python tests/mutation_waits.py --ci            # only what the default ``python -m pytest`` runs in async mode
    python tests/mutation_waits.py --only reap     # mutations whose name contains "reap"
    python tests/mutation_waits.py --list          # the mutations, without running anything

The plain CPU backend completes every copy at once, so deleting a wait changes nothing there. Under
the asynchronous CPU backend (``fuyou/device/cpu_async.py``: copies on worker threads after random
delays, released memory poisoned, copies that do not wait for compute refused) every wait the data
path relies on should be load-bearing. For each mutation this script copies the working tree
(``git ls-files``: tracked and untracked, not ignored) into a temporary directory, replaces the
wait's statement with ``pass``, runs pytest there (``PYTHONPATH`` = the copy, ``-x``) and records
the first failing test. It prints a table, wait → failing test, and exits 1 if a mutation went
uncaught (other than the few marked redundant, each with the reason no test can catch it) or the
unmutated copy fails. The working tree itself is never touched.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """Delete the ``occurrence``-th line of ``path`` that contains ``statement`` (replaced by ``replacement``)."""

    name: str
    path: str
    statement: str
    occurrence: int = 0
    why: str = ""
    redundant: str = ""
    """Why no test can fail without this wait (a known-redundant wait; its row then reads "redundant")."""
    replacement: str = "pass"
    """What replaces the statement: ``pass``, or an expression statement that drops the wait."""


MUTATIONS = [
    Mutation(
        "step._load: compute waits for the weights' copy",
        "fuyou/engine/step.py",
        "c.loader.ready_event().wait(c.compute_stream)",
        why="compute reads device weights before their host→device copy landed",
    ),
    Mutation(
        "engine.evaluate: compute waits for each block's weights (the head's groups included)",
        "fuyou/engine/engine.py",
        "self.loader.ready_event().wait(self.compute_stream)",
        0,
        why="evaluate's forward or head reads weights mid-copy",
    ),
    Mutation(
        "weights.next: compute named a user of the weights' memory (keep_alive / record_stream)",
        "fuyou/transfer/weights.py",
        "self.backend.keep_alive(into, self.compute)",
        why="the copy stream's allocator pool refills a device buffer compute may still be reading",
    ),
    Mutation(
        "weights._buffer: a recycled host buffer's upload landed before the next read fills it",
        "fuyou/transfer/weights.py",
        'landed = event_future(ev, "weights")',
        replacement="landed = done_future()",
        why="an SSD read refills a host buffer while its host→device copy still reads it",
    ),
    Mutation(
        "weights._reap: copy done before its host buffer is released",
        "fuyou/transfer/weights.py",
        "ev.wait()",
        why="a host buffer goes back to the pool (and is refilled) while its copy still reads it",
        redundant="only drain() releases a buffer whose copy has not been seen done, and on CPU every copy "
        "has landed by then: compute is synchronous and waited for each copy before using its weights, and "
        "a copy is issued only by next(), right before compute uses it; on a GPU the host reaches drain() "
        "while the queued copies still run, which only a GPU test can see",
    ),
    Mutation(
        "weights.next: SSD read landed before the copy (future)",
        "fuyou/transfer/weights.py",
        "fut.result()",
        why="the host→device copy reads a buffer the SSD read is still filling",
    ),
    Mutation(
        "gradients.offload: copy stream waits for compute",
        "fuyou/transfer/gradients.py",
        "self.backend.record().wait(self.stream)",
        why="the device→host copy reads a gradient backward may still be writing",
    ),
    Mutation(
        "gradients.offload: keep_alive(grad) until the copy ran",
        "fuyou/transfer/gradients.py",
        "self.backend.keep_alive(grad, self.stream)",
        why="the gradient's device memory is reused while the copy still reads it",
    ),
    Mutation(
        "adam_stage._chunk: gradient copy landed before Adam reads it",
        "fuyou/engine/adam_stage.py",
        "ready.wait()",
        why="Adam reads a host gradient buffer before the device→host copy filled it",
    ),
    Mutation(
        "grad_park._write: gradient copy landed before the SSD write",
        "fuyou/transfer/grad_park.py",
        "ready.wait()",
        0,
        why="a parked gradient is written to SSD before the device→host copy filled its buffer",
    ),
    Mutation(
        "grad_park.discard: copy done before a skipped step's buffer is released",
        "fuyou/transfer/grad_park.py",
        "ready.wait()",
        1,
        why="a skipped step's parked buffer returns to the pool while its copy still writes it",
        redundant="a park/<b> buffer is written only by block b's offloads, all on the one device-to-host "
        "stream, in order: the stale copy lands before the next offload's copy into the same buffer, and "
        "the next reader waits for that one (kept as defence in depth)",
    ),
    Mutation(
        "grad_park._read_back: SSD write landed before the read back (future)",
        "fuyou/transfer/grad_park.py",
        "parked.written.result()",
        why="Adam's read of a parked gradient overtakes its write",
    ),
    Mutation(
        "adam_stage._update_now: hand-off retired before the new-weights buffer returns to the pool",
        "fuyou/engine/adam_stage.py",
        "new.retire(b, f.exception(), partial(self.pool.release, wbuf))",
        replacement="self.pool.release(wbuf); new.retire(b, f.exception(), lambda: None)",
        why="a later read of the block copies from a buffer the pool has handed to another block",
    ),
    Mutation(
        "activation_files.upload: staging filled (read back or packed) before the copies back",
        "fuyou/transfer/activation_files.py",
        "f.result()",
        1,
        why="an SSD-swapped activation is copied onto the device before its read back landed",
    ),
    Mutation(
        "activation_copies.upload: compute named a user of the copied-back activation (keep_alive)",
        "fuyou/transfer/activation_copies.py",
        "self.backend.keep_alive(c.back, self.compute)",
        why="the host-to-device stream's pool refills an activation compute may still be reading",
    ),
    Mutation(
        "activation_copies.upload: the copy off landed before the copy back reads the host copy",
        "fuyou/transfer/activation_copies.py",
        "c.landed.wait(self.h2d)",
        why="an activation is copied back from host staging the device-to-host copy is still filling",
    ),
    Mutation(
        "activation_copies.take: compute waits for the copy back",
        "fuyou/transfer/activation_copies.py",
        "c.ready.wait(self.compute)",
        why="backward reads a swapped activation before its copy back landed",
    ),
    Mutation(
        "activation_copies.off: device-to-host stream waits for compute",
        "fuyou/transfer/activation_copies.py",
        "self.backend.record().wait(self.d2h)",
        why="the copy off reads an activation compute may still be writing",
        redundant="on CPU compute is synchronous and activations are torch's own allocations (not stamped "
        "by the backend), so no CPU test can see it; the GPU fidelity tests can",
    ),
    Mutation(
        "activation_copies.off: keep_alive(activation) until the copy off ran",
        "fuyou/transfer/activation_copies.py",
        "self.backend.keep_alive(t, self.d2h)",
        why="an activation's device memory is reused while the copy off still reads it",
        redundant="the asynchronous CPU backend's queued copy holds the source tensor itself, and torch's "
        "own allocations are not recycled by the backend, so the memory cannot be reused on CPU; the "
        "GPU fidelity tests can see it",
    ),
    Mutation(
        "activation_files._pack: the copies off landed before staging is packed (future)",
        "fuyou/transfer/activation_files.py",
        'self.packed = chain(event_future(self.landed, "activations"), lambda: self._pack(staging, pieces))',
        replacement="self.packed = chain(done_future(), lambda: self._pack(staging, pieces))",
        why="swapped activations are packed and written to SSD before their device-to-host copies landed",
    ),
    Mutation(
        "activation_files.upload: staging packed before the copies back (future)",
        "fuyou/transfer/activation_files.py",
        "filled = [f for f in (self.packed, self.io) if f is not None]",
        replacement="filled = [f for f in (self.io,) if f is not None]",
        why="backward reads swapped activations from staging before it was packed",
    ),
    Mutation(
        "activation_files.upload: SSD read landed before the copies back (future)",
        "fuyou/transfer/activation_files.py",
        "filled = [f for f in (self.packed, self.io) if f is not None]",
        replacement="filled = [f for f in (self.packed,) if f is not None]",
        why="backward reads swapped activations before they are read back from SSD",
    ),
    Mutation(
        "updates.UpdateInBackward.finish: Adam jobs done before a skipped step rolls back",
        "fuyou/engine/updates.py",
        "c.stage.worker.wait()",
        why="the store aborts while Adam jobs of the skipped step may still run",
        redundant="finish has just waited for every update future of the step (st.written), and each "
        "completes only after its Adam jobs and writes",
    ),
    Mutation(
        "updates.UpdateInBackward.finish: the step's updates written before commit/abort (futures)",
        "fuyou/engine/updates.py",
        "wait(list(st.written.values()))",
        why="a step commits or rolls back while its updates are still being written",
    ),
    Mutation(
        "updates.ClipOverlapNextForward.settle: last step's updates written before commit (futures)",
        "fuyou/engine/updates.py",
        "wait(futs)",
        why="the clipping schedule commits a step whose updates are still being written",
        redundant="settle calls f.result() on each of the same futures next, before committing",
    ),
]

SUITES = [
    "tests/integration/test_engine_fidelity_async.py",
    "tests/unit/transfer",
    "tests/integration/test_engine_fidelity.py",
    "tests/integration/test_grad_park.py",
    "tests/integration/test_nonfinite.py",
]
"""The default selection: the async fidelity subset first (it forces the asynchronous backend itself),
then the engine suites, run with ``FUYOU_CPU_ASYNC=1``."""

CI_SUITES = ["tests/integration/test_engine_fidelity_async.py", "tests/unit/transfer"]
"""``--ci``: only the async tests the default ``python -m pytest`` runs (no environment variable)."""


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files, into ``dst``."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted but still tracked
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)


def apply(tree: Path, m: Mutation) -> tuple[str, str]:
    """Replace the mutation's line with ``pass`` in ``tree``; return (the file's text before, the line)."""
    path = tree / m.path
    before = path.read_text()
    lines = before.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if m.statement in line and not line.lstrip().startswith("#")]
    if len(hits) <= m.occurrence:
        raise SystemExit(f"{m.path}: {m.statement!r} occurs {len(hits)} times, mutation wants #{m.occurrence + 1}")
    i = hits[m.occurrence]
    original = lines[i]
    if original.strip().split("#")[0].strip() != m.statement:
        raise SystemExit(f"{m.path}:{i + 1}: {original.strip()!r} is more than the statement {m.statement!r}")
    indent = original[: len(original) - len(original.lstrip())]
    lines[i] = f"{indent}{m.replacement}  # mutated: {m.statement}\n"
    path.write_text("".join(lines))
    return before, original


def run_tests(tree: Path, suites: list[str], env_async: bool, timeout: float) -> tuple[bool, str, float]:
    """(passed, first failing test or "", seconds) of pytest over ``suites`` in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "400"}  # wide: failure messages in the summary
    env.pop("FUYOU_CPU_ASYNC", None)
    if env_async:
        env["FUYOU_CPU_ASYNC"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *suites]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"(timed out after {timeout:.0f} s)", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if p.returncode == 0:
        return True, "", dt
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", p.stdout, re.M)
    if failed:
        test, why = failed[0]
        test = test.replace("tests/integration/", "")
        return False, f"{test}: {why[:100]}" if why else test, dt
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
    return False, f"(pytest exit {p.returncode}: {tail[0][:100]})", dt


def check_imports_from(tree: Path) -> None:
    """Refuse to run if ``PYTHONPATH`` does not make the copy's ``fuyou`` the one imported."""
    out = subprocess.run(
        [sys.executable, "-c", "import fuyou; print(fuyou.__file__)"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not out.startswith(str(tree)):
        raise SystemExit(f"the copy's fuyou is not the one imported ({out}); cannot run mutations")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ci", action="store_true", help="only the async tests the default pytest run includes")
    ap.add_argument("--only", default="", help="run only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument("suites", nargs="*", help="test paths (default: the async-backend suites)")
    args = ap.parse_args()
    muts = [m for m in MUTATIONS if args.only.lower() in m.name.lower()]
    if args.list:
        for m in muts:
            print(f"{m.name}\n    {m.path}: {m.statement}  (occurrence {m.occurrence + 1}) — {m.why}")
            if m.redundant:
                print(f"    redundant: {m.redundant}")
        return 0
    suites = args.suites or (CI_SUITES if args.ci else SUITES)
    env_async = not args.ci
    rows: list[tuple[str, str, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="fuyou-mut-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        copy_tree(tree)
        check_imports_from(tree)
        ok, first, dt = run_tests(tree, suites, env_async, args.timeout)
        rows.append(("(none: the unmutated tree)", "pass" if ok else "FAIL", first or "all pass", dt))
        print(f"{rows[-1][0]}: {rows[-1][2]} ({dt:.0f} s)", flush=True)
        for m in muts:
            before, original = apply(tree, m)
            try:
                ok, first, dt = run_tests(tree, suites, env_async, args.timeout)
            finally:
                (tree / m.path).write_text(before)
            result = ("redundant" if m.redundant else "NOT CAUGHT") if ok else "caught"
            rows.append((m.name, result, first or f"no test failed ({m.redundant or m.why})", dt))
            print(f"{m.name}: {rows[-1][1]} by {rows[-1][2]} ({dt:.0f} s)  [{original.strip()}]", flush=True)
    print()
    print(f"suites: {' '.join(suites)}  (FUYOU_CPU_ASYNC={'1' if env_async else 'unset'})")
    w = max(len(r[0]) for r in rows)
    print(f"{'wait deleted':<{w}}  {'result':<10}  {'s':>4}  first failing test")
    for name, result, first, dt in rows:
        print(f"{name:<{w}}  {result:<10}  {dt:4.0f}  {first}")
    bad = rows[0][1] != "pass" or any(r[1] == "NOT CAUGHT" for r in rows[1:])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
