#!/usr/bin/env bash
# Fetch, on a machine with registry access, the wheels a CUDA machine without one lacks for Fuyou, into
# wheels/ (git-ignored); carry that folder beside the working tree and run bench/gpu_suite.sh there.
#
#   bash bench/gpu_wheels.sh                      # CPython 3.12, CUDA 13 (kvikio-cu13)
#   PY_VERSION=3.11 CUDA_MAJOR=12 bash bench/gpu_wheels.sh
#
# What is fetched: the versions Fuyou is tested with where the target's own may be older
# (transformers), what such images usually lack (crc32c, kvikio with libkvikio and rapids-logger).
# bench/gpu_suite.sh installs a wheel only where the machine has no newer version of it.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
py=${PY_VERSION:-3.12}
cuda=${CUDA_MAJOR:-13}
dest=wheels
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for req in "transformers==5.23.0" "crc32c>=2.4" "kvikio-cu${cuda}==26.10.*" "libkvikio-cu${cuda}==26.10.*" \
  "rapids-logger==0.3.*"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d "$dest" "$req"
done
du -sh "$dest"
ls "$dest"
