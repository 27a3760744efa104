#!/usr/bin/env bash
# First contact with a lent GPU machine, sized for a 15-minute lease: one command of at most 9 minutes
# (`first`, the default) and one of at most 6.5 (`second`), each under a global deadline, every stage under
# its own `timeout`, results written to $OUT as each stage ends.
#
#   bash bench/gpu_wheels.sh                        # beforehand, where pip can download: fills .whl/
#   bash bench/gpu_first_contact.sh                 # there (carry .whl): env install tests p6 store  <= 9 min
#   bash bench/gpu_first_contact.sh second          # the same lease, next call: env install ssd formats profile  <= 6.5 min
#   bash bench/gpu_first_contact.sh again           # after fixing what `first` found: env install tests store ssd profile  <= 7.5 min
#
# Stages of `first`, in value order (cap in seconds; FC_CAP_<STAGE> overrides one, FC_DEADLINE_S the total):
#   env      20  GPU, driver, torch/CUDA, TF32 flags, df of every mount, ulimit -l -n; the scratch directory
#                (FUYOU_SCRATCH, else the largest writable non-tmpfs mount, O_DIRECT preferred). Stops the
#                whole run at once (exit 3, one line on stderr) without CUDA (unless FUYOU_REHEARSAL=1) or
#                when the scratch has less room than FC_SCRATCH_NEED_GIB (default 22; `second`: 16)
#   install  45  the carried wheels ($FC_WHEELS, default .whl/, else wheels/) into $FC_SITE (default /tmp/site)
#                with pip --target (the image's Python is not written to); PYTHONPATH=repo:site; imports and
#                versions checked (fuyou from this checkout, transformers >= 5.20, peft, numba, crc32c, ...)
#   tests   150  python -m pytest tests/gpu: cheapest files first, NCCL last, --timeout per test (pytest-timeout,
#                left out where missing), TF32 off, gloo/NCCL on loopback, a 45 s collective timeout; fails if
#                any test was skipped for a reason other than a missing optional package (junit XML)
#   p6      230  bench_gpu.py --mode side-by-side: plain PyTorch + AdamW(fused=True), then Fuyou as planned, then
#                Fuyou keeping every layer's activations (--also-fixed keep: what the planner's choice cost), Fuyou
#                with the CPU Adam on all cores but 4 (--also-adam-threads: does Adam starve the launching thread), on a
#                0.75 B Llama at 64k tokens/step; then Fuyou with small --gpu-memory/--cpu-memory (blocks streamed
#                from the store); each line and ratio appended to figures.jsonl as soon as measured
#   store    45  bench_store.py: the store's POSIX and (where usable) kvikio engines side by side, O_DIRECT
# Stages of `second`: env 15, install 40 (skipped work if the same wheels are installed already),
#   ssd 90 (an SSD-bound point: bench_gpu.py --plan auto, predicted ÷ measured step time), formats 150 (the
#   same point under --optimizer-state int8, then split: FORMATS_RUN; the ssd stage runs bench_gpu.py's
#   default, fp32; session 20 measured fp32/split/bf16 there), profile 70 (one
#   step under torch.profiler: kernel busy time beside the timeline's compute busy time).
# A stage starts only if the time left is at least its cap (+5 s to kill it); else its summary line says
# skipped. Exit status: 0 all stages passed, 1 some failed or were skipped, 3 stopped at env.
#
# $OUT (default /tmp/gpu-first-contact-out), at most 5 files: summary.txt (one line per stage: name, exit code,
# seconds, cap), figures.jsonl (every measured figure, one JSON object a line), junit-gpu.xml, one
# gzipped Chrome trace (trace-p6.json.gz or trace-profile.json.gz), and the log (first.log / second.log).
# Shapes and budgets: P6_SHAPE, P6_CPU, P6_OOC_CPU, P6_OOC_GPU, P6_STEPS, P6_OOC_STEPS, STORE_MIB,
# STORE_REPEATS, SSD_SHAPE, SSD_CPU, SSD_GPU, SSD_STEPS, PROF_SHAPE, PROF_CPU, TEST_TIMEOUT (defaults below).
# FUYOU_REHEARSAL=1: a CPU machine is expected (tests/bench/test_smoke.py rehearses both modes with
# tiny shapes and small caps).
# shellcheck disable=SC2317  # the stage functions are called by name (stage_$name)
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/gpu-first-contact-out}
REHEARSAL=${FUYOU_REHEARSAL:-0}
SITE=${FC_SITE:-/tmp/site}
if [ -n "${FC_WHEELS:-}" ]; then WHEELS=$FC_WHEELS; elif [ -d .whl ] || [ ! -d wheels ]; then WHEELS=.whl; else WHEELS=wheels; fi
GRACE=5
# a carried fio (a build of its own, e.g. static) in the wheels folder's bin/: the store stage's reference
[ -x "$WHEELS/bin/fio" ] && PATH="$(cd "$WHEELS/bin" && pwd):$PATH" && export PATH
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the carried tbb wheel's libtbb.so.12 lands in $SITE/lib, where numba's loader (by soname) looks only through this
export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# 0.75 B Llama (12 × 2048, FFN 5632, 32k vocabulary), 8 × 2048 tokens × 4 micro-batches = 65,536 tokens/step;
# its store is ~21 GB (two versions of 14 B/param: 19.6 GiB), one Fuyou run's at a time (removed after each)
P6_SHAPE=${P6_SHAPE:---layers 12 --hidden 2048 --ffn 5632 --vocab 32000 --seq 2048 --micro-batch 8 --grad-accum 4}
P6_CPU=${P6_CPU:-64GiB}
P6_OOC_CPU=${P6_OOC_CPU:-6GiB}
P6_OOC_GPU=${P6_OOC_GPU:-12GiB}
P6_STEPS=${P6_STEPS:-3}
P6_OOC_STEPS=${P6_OOC_STEPS:-2}
P6_ADAM_THREADS=${P6_ADAM_THREADS:-$(($(nproc) > 4 ? $(nproc) - 4 : 1))} # the planned run again, Adam leaving cores free
STORE_MIB=${STORE_MIB:-1024}
STORE_REPEATS=${STORE_REPEATS:-3}
# SSD-bound: 2,048 tokens a step on a 0.54 B Llama, state on the SSD (~15 GB read and written a step)
SSD_SHAPE=${SSD_SHAPE:---layers 8 --hidden 2048 --ffn 5632 --vocab 32000 --seq 2048 --micro-batch 1 --grad-accum 1}
SSD_CPU=${SSD_CPU:-4GiB}
SSD_GPU=${SSD_GPU:-16GiB}
SSD_STEPS=${SSD_STEPS:-2}
FORMATS_RUN=${FORMATS_RUN:-int8 split}
PROF_SHAPE=${PROF_SHAPE:---layers 4 --hidden 2048 --ffn 5632 --vocab 32000 --seq 2048 --micro-batch 4 --grad-accum 2}
PROF_CPU=${PROF_CPU:-32GiB}
TEST_TIMEOUT=${TEST_TIMEOUT:-60}
ALLOW_CPU=()
[ "$REHEARSAL" = 1 ] && ALLOW_CPU=(--allow-cpu)

cap_of() { # stage default -> the cap in seconds (FC_CAP_<STAGE> overrides)
  local var="FC_CAP_${1^^}"
  echo "${!var:-$2}"
}

stage_env() {
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv 2>&1 ||
    echo "nvidia-smi: not available"
  echo "--- df (every mount)"
  df -h -T 2>&1
  echo "--- ulimit -l -n"
  ulimit -l -n
  echo "--- cpu/memory: $(nproc) cores; $(free -g | awk '/^Mem/ {print $2 " GiB RAM, " $7 " GiB available"}')"
  "$PY" - "$OUT/figures.jsonl" "$FC_STATE" <<'EOF'
import json, mmap, os, shutil, sys

import torch

out, state = sys.argv[1:3]
rehearsal = os.environ.get("FUYOU_REHEARSAL", "0") == "1"

def tf32() -> dict:
    flags = {"NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}
    for name, get in (
        ("matmul.fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
        ("cudnn.conv.fp32_precision", lambda: torch.backends.cudnn.conv.fp32_precision),
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
    ):
        try:
            flags[name] = get()
        except Exception as e:  # the legacy getters raise where the new API was used
            flags[name] = f"unreadable: {type(e).__name__}"
    return flags

def direct_ok(d: str) -> bool:
    p = os.path.join(d, ".fc-odirect-probe")
    try:
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600)
        try:
            os.write(fd, mmap.mmap(-1, 4096))
            return hasattr(os, "O_DIRECT")
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        if os.path.exists(p):
            os.unlink(p)

SKIP_FS = {"tmpfs", "devtmpfs", "ramfs", "proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "squashfs",
           "securityfs", "debugfs", "tracefs", "configfs", "fusectl", "pstore", "bpf", "hugetlbfs", "autofs",
           "nsfs", "binfmt_misc", "efivarfs", "iso9660"}

def candidates() -> list[str]:
    if os.environ.get("FUYOU_SCRATCH"):
        return [os.environ["FUYOU_SCRATCH"]]
    dirs = []
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs, opts = line.split()[:4]
            mnt = mnt.replace("\\040", " ")
            if fs in SKIP_FS or "ro" in opts.split(",") or mnt.startswith(("/proc", "/sys", "/dev", "/run", "/boot")):
                continue
            dirs.append("/var/tmp/fuyou-first-contact" if mnt == "/" else os.path.join(mnt, "fuyou-first-contact"))
    return dirs

need = float(os.environ["FC_SCRATCH_NEED_GIB"]) * 2**30
seen, rows = set(), []
for d in candidates():
    try:
        os.makedirs(d, exist_ok=True)
        st = os.stat(d)
        if st.st_dev in seen or not os.access(d, os.W_OK):
            continue
        seen.add(st.st_dev)
        rows.append((direct_ok(d), shutil.disk_usage(d).free, d))
    except OSError:
        continue
for ok, free, d in rows:
    print(f"scratch candidate {d}: {free / 2**30:.1f} GiB free, O_DIRECT {'yes' if ok else 'no'}")
roomy = [r for r in rows if r[1] >= need]
stop = None
if not torch.cuda.is_available() and not rehearsal:
    stop = (f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "this run measures a GPU (FUYOU_REHEARSAL=1 rehearses it on a CPU)")
elif not roomy:
    best = max(rows, key=lambda r: r[1]) if rows else None
    stop = (f"no writable non-tmpfs directory has {need / 2**30:.1f} GiB free for the stages' stores "
            f"(largest: {best[2] + f' with {best[1] / 2**30:.1f} GiB' if best else 'none found'}); "
            "set FUYOU_SCRATCH to a bigger disk, or smaller shapes and FC_SCRATCH_NEED_GIB")
rec = {"bench": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "rehearsal": rehearsal,
       "cuda_available": torch.cuda.is_available(), "tf32": tf32(), "scratch_need_gib": need / 2**30}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    rec |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count}
if roomy:
    ok, free, d = max(roomy)  # O_DIRECT first, then the most room
    rec |= {"scratch": d, "scratch_free_gib": round(free / 2**30, 1), "scratch_o_direct": ok}
    with open(os.path.join(state, "scratch"), "w") as f:
        f.write(d)
    print(f"scratch: {d}")
print(json.dumps(rec))
with open(out, "a") as f:
    f.write(json.dumps(rec) + "\n")
if stop:
    with open(os.path.join(state, "stop"), "w") as f:
        f.write(stop)
    print(f"stop: {stop}")
    sys.exit(3)
if rehearsal and not torch.cuda.is_available():
    print("rehearsal: the CPU is expected")
EOF
}

stage_install() {
  local whl=() stamp
  shopt -s nullglob
  whl=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#whl[@]} -gt 0 ]; then
    stamp=$(stat -c '%n %s %Y' "${whl[@]}" | md5sum)
    if [ -f "$SITE/.fc-stamp" ] && [ "$(cat "$SITE/.fc-stamp")" = "$stamp" ]; then
      echo "the ${#whl[@]} wheels of $WHEELS are installed in $SITE already"
    else
      echo "installing ${#whl[@]} wheels from $WHEELS into $SITE (pip --target; the image's Python is untouched)"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whl[@]}" ||
        return 1
      # pip --target drops a wheel's data files: tbb's libraries (tbb-*.data/data/lib/) go to $SITE/lib by hand
      for w in "$WHEELS"/tbb-*.whl; do
        [ -f "$w" ] || continue
        "$PY" -c 'import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
libs = [n for n in z.namelist() if ".data/data/lib/" in n and not n.endswith("/")]
os.makedirs(sys.argv[2], exist_ok=True)
for n in libs:
    open(os.path.join(sys.argv[2], os.path.basename(n)), "wb").write(z.read(n))
print(f"{len(libs)} tbb libraries into {sys.argv[2]}")' "$w" "$SITE/lib" || return 1
      done
      echo "$stamp" >"$SITE/.fc-stamp"
    fi
  else
    echo "no wheels in $WHEELS: the image's packages are used as they are"
  fi
  "$PY" - "$REPO" "$SITE" "$OUT/figures.jsonl" <<'EOF'
import importlib, json, os, sys
from importlib.metadata import PackageNotFoundError, version

repo, site, out = sys.argv[1:4]
need = ["torch", "transformers", "peft", "numba", "crc32c", "safetensors", "tokenizers", "huggingface_hub"]
optional = ["kvikio", "pytest_timeout"]
rec, bad = {"bench": "install", "site": site}, []
for name in need + optional:
    try:
        mod = importlib.import_module(name)
    except Exception as e:
        rec[name] = None
        print(f"{name:16s} MISSING ({type(e).__name__}: {e})")
        if name in need:
            bad.append(name)
        continue
    ver = getattr(mod, "__version__", None)
    for dist in (name, name.replace("_", "-"), f"{name}-cu13", f"{name}-cu12"):
        if ver:
            break
        try:
            ver = version(dist)
        except PackageNotFoundError:
            pass
    where = os.path.dirname(mod.__file__ or "")
    rec[name] = ver
    print(f"{name:16s} {ver or '?':12s} {'(carried) ' if where.startswith(site) else ''}{where}")
import fuyou  # noqa: E402
import fuyou.engine, fuyou.run.plan_choice, fuyou.storage.io_kvikio  # noqa: E401,E402,F401

rec["fuyou"] = os.path.dirname(fuyou.__file__)
rec["kvikio_usable"] = fuyou.storage.io_kvikio.kvikio_usable()
import fuyou.optim.parallel  # noqa: E402
from fuyou.run.doctor import check_threading_layer  # noqa: E402

layer_check = check_threading_layer()  # tbb expected (the tbb wheel carried); omp slows the training thread
rec["numba_threading_layer"] = fuyou.optim.parallel.threading_layer()
print(f"numba layer      {layer_check.status}: {layer_check.detail}")
print(f"fuyou            {rec['fuyou']}  kvikio usable: {rec['kvikio_usable']}")
if not rec["fuyou"].startswith(repo):
    bad.append(f"fuyou imported from {rec['fuyou']}, not from this checkout {repo}")
from packaging.version import Version  # noqa: E402

if rec.get("transformers") and Version(rec["transformers"]) < Version("5.20"):
    bad.append(f"transformers {rec['transformers']} < 5.20 (carry transformers: bash bench/gpu_wheels.sh)")
with open(out, "a") as f:
    f.write(json.dumps(rec) + "\n")
if bad:
    sys.exit("install: " + "; ".join(bad))
EOF
}

stage_tests() {
  local files=() f timeout_opt=() allowed="" rc
  for f in test_cuda_backend.py test_gpu_memory.py test_engine_cuda.py test_fidelity_fp32_same_gpu.py; do
    [ -f "tests/gpu/$f" ] && files+=("tests/gpu/$f")
  done
  for f in tests/gpu/test_*.py; do # the rest, then NCCL (children, a rendezvous) last
    [[ " ${files[*]} " == *" $f "* || $f == *nccl* ]] || files+=("$f")
  done
  for f in tests/gpu/test_*nccl*.py; do [ -f "$f" ] && files+=("$f"); done
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout_opt=(--timeout "$TEST_TIMEOUT")
  else
    echo "pytest-timeout is not installed: no per-test timeout (the stage's cap still holds)"
  fi
  NVIDIA_TF32_OVERRIDE=0 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 \
    FUYOU_COLLECTIVE_TIMEOUT=${FC_COLLECTIVE_TIMEOUT:-45} TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    "$PY" -m pytest -p no:cacheprovider -q -rs --junitxml="$OUT/junit-gpu.xml" -o junit_logging=system-out --basetemp="$SCRATCH/pytest" \
    "${timeout_opt[@]}" "${files[@]}"
  rc=$?
  [ "$REHEARSAL" = 1 ] && allowed="needs a CUDA GPU"
  if ! "$PY" - "$OUT/junit-gpu.xml" "$allowed" <<'EOF'; then
import sys

from bench.common import ALLOWED_SKIPS, unexpected_skips

allowed = ALLOWED_SKIPS + ((sys.argv[2],) if sys.argv[2] else ())
ran, skipped, bad = unexpected_skips(sys.argv[1], allowed)
print(f"tests: {ran} collected, {skipped} skipped, {len(bad)} skipped for a reason other than {allowed}")
for line in bad:
    print("  unexpected skip:", line)
sys.exit(1 if bad or ran == 0 else 0)
EOF
    [ "$rc" != 0 ] || rc=4 # the tests passed, but some skipped that must not
  fi
  return "$rc"
}

bench() { # bench_gpu.py under a timeout a little shorter than the stage's, so the stage can still save the trace
  timeout --foreground -k 3 "$((FC_STAGE_CAP > 20 ? FC_STAGE_CAP - 10 : FC_STAGE_CAP))" "$PY" bench/bench_gpu.py "$@" "${ALLOW_CPU[@]}" \
    --ssd "$SCRATCH" --out "$OUT/figures.jsonl"
}

save_trace() { # scratch trace -> $OUT/NAME.json.gz
  [ -s "$SCRATCH/$1.json" ] && gzip -c "$SCRATCH/$1.json" >"$OUT/$1.json.gz" && rm -f "$SCRATCH/$1.json"
}

stage_p6() {
  local rc
  rm -f "$SCRATCH/trace-p6.json"
  # shellcheck disable=SC2086
  bench --mode side-by-side $P6_SHAPE --plan auto --cpu-memory "$P6_CPU" --steps "$P6_STEPS" \
    --also-fixed keep --also-adam-threads "$P6_ADAM_THREADS" --ooc-cpu-memory "$P6_OOC_CPU" --ooc-gpu-memory "$P6_OOC_GPU" --ooc-steps "$P6_OOC_STEPS" \
    --trace "$SCRATCH/trace-p6.json"
  rc=$?
  save_trace trace-p6
  return "$rc"
}

stage_store() {
  local engines=posix fio=()
  if "$PY" -c "from fuyou.storage.io_kvikio import kvikio_usable as u; raise SystemExit(0 if u() else 1)"; then
    engines=posix,kvikio
  else
    echo "kvikio: not usable here (no kvikio package or no CUDA driver): POSIX engine only"
  fi
  command -v fio >/dev/null || fio=(--no-fio)
  "$PY" - "$SCRATCH" "$OUT/figures.jsonl" <<'EOF'
import sys

from bench.common import emit
from fuyou.storage.dirs import direct_supported

emit({"bench": "store_direct", "dir": sys.argv[1], "o_direct": direct_supported(sys.argv[1]),
      "note": "bench_store.py --direct auto: each line's o_direct says whether its store used O_DIRECT"}, sys.argv[2])
EOF
  timeout --foreground -k 3 "$((FC_STAGE_CAP > 20 ? FC_STAGE_CAP - 3 : FC_STAGE_CAP))" "$PY" bench/bench_store.py --dir "$SCRATCH" --io "$engines" \
    --direct auto --size-mib "$STORE_MIB" --repeats "$STORE_REPEATS" "${fio[@]}" --out "$OUT/figures.jsonl"
}

stage_ssd() {
  # shellcheck disable=SC2086
  bench --mode fuyou $SSD_SHAPE --plan auto --cpu-memory "$SSD_CPU" --gpu-memory "$SSD_GPU" --steps "$SSD_STEPS" \
    --label ssd_bound
}

stage_formats() { # the ssd stage's shape and budgets under the other optimizer-state formats (issue 34)
  local fmt rc=0
  for fmt in ${FORMATS_RUN}; do
    # shellcheck disable=SC2086
    bench --mode fuyou $SSD_SHAPE --plan auto --cpu-memory "$SSD_CPU" --gpu-memory "$SSD_GPU" --steps "$SSD_STEPS" \
      --optimizer-state "$fmt" --label "ssd_bound_$fmt" || rc=$?
  done
  return "$rc"
}

stage_profile() {
  local rc
  rm -f "$SCRATCH/trace-profile.json"
  # shellcheck disable=SC2086
  bench --mode fuyou $PROF_SHAPE --plan auto --cpu-memory "$PROF_CPU" --steps 1 --torch-profile \
    --label profiled --trace "$SCRATCH/trace-profile.json"
  rc=$?
  save_trace trace-profile
  return "$rc"
}

if [ "${1:-}" = --stage ]; then # one stage, in its own process group (under `timeout`)
  [ -f "$FC_STATE/scratch" ] && SCRATCH=$(cat "$FC_STATE/scratch") && export FUYOU_CACHE="$SCRATCH/cache"
  SCRATCH=${SCRATCH:-/nonexistent}
  "stage_$2"
  exit $?
fi

MODE=${1:-first}
case "$MODE" in
first) STAGES=(env:20 install:45 tests:150 p6:230 store:45) DEADLINE=${FC_DEADLINE_S:-530} need=22 ;;
second) STAGES=(env:15 install:40 ssd:90 formats:150 profile:70) DEADLINE=${FC_DEADLINE_S:-390} need=16 ;;
again) STAGES=(env:15 install:40 tests:150 store:45 ssd:90 profile:70) DEADLINE=${FC_DEADLINE_S:-450} need=16 ;;
*)
  echo "usage: bash bench/gpu_first_contact.sh [first|second|again]" >&2
  exit 2
  ;;
esac
T0=$(date +%s)
mkdir -p "$OUT"
LOG="$OUT/$MODE.log"
SUMMARY="$OUT/summary.txt"
FC_STATE=$(mktemp -d)
FC_SCRATCH_NEED_GIB=${FC_SCRATCH_NEED_GIB:-$need} # the largest store a stage writes (p6: 0.75 B × 28 B = 19.6 GiB)
export FC_STATE OUT PY SITE WHEELS REHEARSAL FC_SCRATCH_NEED_GIB
trap 'rm -rf "$FC_STATE"' EXIT
echo "gpu_first_contact $MODE: deadline ${DEADLINE}s, out $OUT, $(date -u)" | tee -a "$LOG"
status=0
for entry in "${STAGES[@]}"; do
  name=${entry%%:*}
  cap=$(cap_of "$name" "${entry#*:}")
  left=$((DEADLINE - ($(date +%s) - T0)))
  if [ "$left" -lt $((cap + GRACE)) ]; then
    echo "stage=$name rc=skipped seconds=0 cap=$cap left=$left" | tee -a "$SUMMARY" "$LOG"
    status=1
    continue
  fi
  echo "=== $name (cap ${cap}s, ${left}s left) $(date -u +%T)" | tee -a "$LOG"
  t0=$(date +%s)
  FC_STAGE_CAP=$cap timeout -k "$GRACE" "$cap" bash "$SELF" --stage "$name" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  dt=$(($(date +%s) - t0))
  note=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" timed_out"
  echo "stage=$name rc=$rc seconds=$dt cap=$cap$note" | tee -a "$SUMMARY" "$LOG"
  if [ -f "$FC_STATE/stop" ]; then
    echo "gpu_first_contact: stopped at $name: $(cat "$FC_STATE/stop")" | tee -a "$LOG" >&2
    exit 3
  fi
  [ "$rc" = 0 ] || status=1
done
echo "gpu_first_contact $MODE: done in $(($(date +%s) - T0))s, status $status" | tee -a "$LOG"
exit "$status"
