#!/usr/bin/env bash
# The GPU run in one command, for a CUDA machine without registry access (run from anywhere; it works
# in the repository root). Every stage is timed and logged; a failing stage does not stop the others.
#
#   bash bench/gpu_wheels.sh                  # first, where pip can download: fills wheels/
#   bash bench/gpu_suite.sh                   # there: install, then env tests store p6-smoke
#   bash bench/gpu_suite.sh p6                # the throughput run alone (P6_ARGS picks the shape)
#
# Stages (arguments; default: install env tests store p6-smoke):
#   install   wheels/*.whl where the machine has no newer version, then this project (editable, no deps)
#   env       GPU, driver, CUDA, torch, transformers and kvikio versions, `fuyou doctor`   -> env.txt
#   tests     pytest -m gpu: CUDA backend, fidelity on CUDA (fp32 policies, bf16), the memory cap,
#             device-timed spans, pinned memory, kvikio settings, NCCL on one rank     -> junit-gpu.xml
#   store     bench_store.py with the POSIX and (where usable) kvikio engines side by side: GB/s and
#             CPU-seconds per GB; fio too where installed                             -> results.jsonl
#   p6-smoke  bench_gpu.py --smoke with a trace                                      -> results.jsonl
#   p6        bench_gpu.py $P6_ARGS with a trace (default below)                      -> results.jsonl
#   profile   fuyou profile of $WORK, layers timed on the P6 shape                   -> results.jsonl
#   p7        bench_gpu.py --plan auto on $P7_SHAPE under each of $P7_BUDGETS, with the profile if
#             measured: predicted ÷ measured step time per plan                      -> results.jsonl
# Results in $OUT (default ./gpu-suite-out): summary.txt (one line per stage: ok, or FAILED with its exit code,
# seconds), suite.log (every stage's output), env.txt, junit-gpu.xml, results.jsonl, trace-*.json.gz.
# Scratch (stores, traces before compression) in $FUYOU_SUITE_DIR (default /tmp/fuyou-suite).
# shellcheck disable=SC2317  # the stage functions are called by name (stage_$s)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-suite-out}
WORK=${FUYOU_SUITE_DIR:-/tmp/fuyou-suite}
# P6 default: a 1.6 B Llama with Llama-3's 128k vocabulary (16 layers × 2048), 65,536 tokens per step, the
# planner's plan within 100 GiB of host memory. A Llama-3-8B shape (--layers 32 --hidden 4096 --ffn 14336)
# needs ~230 GiB of store (two versions of 14 B/param): set P6_ARGS and FUYOU_SUITE_DIR where that fits.
P6_ARGS=${P6_ARGS:---layers 16 --hidden 2048 --ffn 8192 --vocab 128256 --seq 2048 --micro-batch 8 --grad-accum 4 --steps 3 --cpu-memory 100GiB --plan auto}
# P7: the plans the planner chooses for a 1.1 B Llama (8 layers × 2048, 128k vocabulary) under three host
# budgets (all in RAM, part, all on SSD), each run and timed
P7_SHAPE=${P7_SHAPE:---layers 8 --hidden 2048 --ffn 8192 --vocab 128256 --seq 2048 --micro-batch 4 --grad-accum 2 --steps 3}
P7_BUDGETS=${P7_BUDGETS:-64GiB 8GiB 4GiB}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/suite.log"
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1

stage_install() {
  if compgen -G "wheels/*.whl" >/dev/null; then
    local wanted
    wanted=$("$PY" - wheels/*.whl <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

for path in sys.argv[1:]:
    name, ver, _, _ = parse_wheel_filename(path.rsplit("/", 1)[-1])
    try:
        have = Version(version(canonicalize_name(name)))
    except PackageNotFoundError:
        have = None
    if have is None or have < ver:
        print(path)
    else:
        print(f"kept {name} {have} (wheel {ver})", file=sys.stderr)
EOF
)
    if [ -n "$wanted" ]; then
      # shellcheck disable=SC2086
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir $wanted || return 1
    fi
  fi
  "$PY" -c "import fuyou.cli, sys; sys.exit(0 if fuyou.__file__.startswith('$PWD/') else 1)" 2>/dev/null ||
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
}

stage_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: none"
    "$PY" - <<'EOF'
import platform
import torch
from importlib.metadata import version

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for pkg in ("transformers", "tokenizers", "peft", "numba", "crc32c", "kvikio-cu13", "kvikio-cu12"):
    try:
        print(pkg, version(pkg))
    except Exception:
        print(pkg, "-")
from fuyou.storage.io_kvikio import kvikio_usable
print("kvikio usable:", kvikio_usable())
EOF
    lscpu | grep -E "Model name|^CPU\(s\)" || true
    free -g | head -2
    df -h "$WORK" | tail -1
    "$PY" -m fuyou doctor --ssd "$WORK" 2>&1 || true
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

stage_tests() {
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/junit-gpu.xml" --basetemp="$WORK/pytest" tests
}

stage_store() {
  local engines=posix fio=()
  if "$PY" -c "from fuyou.storage.io_kvikio import kvikio_usable as u; raise SystemExit(0 if u() else 1)"; then
    engines=posix,kvikio
  else
    echo "kvikio: not usable here (no kvikio package or no CUDA driver); POSIX engine only"
  fi
  command -v fio >/dev/null || fio=(--no-fio)
  "$PY" bench/bench_store.py --dir "$WORK" --io "$engines" --size-mib "${STORE_MIB:-4096}" --repeats 3 \
    "${fio[@]}" --out "$OUT/results.jsonl"
}

stage_p6_smoke() {
  "$PY" bench/bench_gpu.py --smoke --ssd "$WORK" --trace "$WORK/trace-smoke.json" --out "$OUT/results.jsonl" &&
    gzip -c "$WORK/trace-smoke.json" >"$OUT/trace-smoke.json.gz"
}

stage_p6() {
  # shellcheck disable=SC2086
  "$PY" bench/bench_gpu.py $P6_ARGS --ssd "$WORK" --trace "$WORK/trace-p6.json" --out "$OUT/results.jsonl" &&
    gzip -c "$WORK/trace-p6.json" >"$OUT/trace-p6.json.gz"
}

stage_p7() {
  local prof=() budget rc=0
  [ -f "$WORK/profile.json" ] && prof=(--profile "$WORK/profile.json")
  for budget in $P7_BUDGETS; do
    # shellcheck disable=SC2086
    "$PY" bench/bench_gpu.py $P7_SHAPE --plan auto --cpu-memory "$budget" "${prof[@]}" --ssd "$WORK" \
      --out "$OUT/results.jsonl" || rc=1
  done
  return "$rc"
}

stage_profile() {
  # the P6 shape's config, so the profile times its layers (the planner's input for predicted ÷ measured)
  # shellcheck disable=SC2086
  "$PY" - "$WORK/p6-model" $P6_ARGS <<'EOF' || return 1
import argparse
import sys

from transformers import LlamaConfig

ap = argparse.ArgumentParser()
for k in ("layers", "hidden", "ffn", "vocab", "seq"):
    ap.add_argument(f"--{k}", type=int)
a, _ = ap.parse_known_args(sys.argv[2:])
cfg = LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.ffn,
                  vocab_size=a.vocab, num_attention_heads=max(1, a.hidden // 128),
                  num_key_value_heads=max(1, a.hidden // 128), max_position_embeddings=a.seq)
cfg.architectures = ["LlamaForCausalLM"]
cfg.save_pretrained(sys.argv[1])
EOF
  "$PY" -m fuyou profile --ssd "$WORK" --model "$WORK/p6-model" --seq-len "${PROFILE_SEQ:-2048}" \
    --out "$WORK/profile.json" &&
    "$PY" -c "import json,sys; print(json.dumps({'bench': 'profile', **json.load(open(sys.argv[1]))}))" \
      "$WORK/profile.json" >>"$OUT/results.jsonl"
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install env tests store p6-smoke)
failed=0
for s in "${stages[@]}"; do
  fn="stage_${s//-/_}"
  if ! declare -F "$fn" >/dev/null; then
    echo "unknown stage '$s' (install env tests store p6-smoke p6 profile p7)" >&2
    exit 2
  fi
  echo "=== $s ($(date -u +%T))" | tee -a "$LOG"
  t0=$(date +%s)
  "$fn" >>"$LOG" 2>&1
  rc=$?
  dt=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    echo "$s: ok (${dt} s)" | tee -a "$SUMMARY"
  else
    echo "$s: FAILED rc=$rc (${dt} s; see suite.log)" | tee -a "$SUMMARY"
    failed=1
  fi
done
exit $failed
