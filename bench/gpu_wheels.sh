#!/usr/bin/env bash
# Fetch, on a machine with registry access, the wheels a CUDA machine without one lacks for Fuyou, into
# .whl/ (or $WHEELS); carry that folder beside the working tree and run bench/gpu_first_contact.sh there,
# which installs them with `pip --target` (never into the image's Python).
#
#   bash bench/gpu_wheels.sh                      # CPython 3.12, CUDA 13 (kvikio-cu13): ~19 MB
#   PY_VERSION=3.11 CUDA_MAJOR=12 bash bench/gpu_wheels.sh
#
# What is fetched (no dependencies: the lent image has torch, numpy, safetensors, tokenizers,
# huggingface_hub, accelerate, numba, cupy and the CUDA toolkit wheels): the versions Fuyou is tested with
# where the image's may be older (transformers, which checks regex's version at import; peft), and
# what such images lack (crc32c; kvikio with libkvikio and rapids-logger; tbb, numba's threading layer). The carried tree, wheels
# included, must stay under the device's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
py=${PY_VERSION:-3.12}
cuda=${CUDA_MAJOR:-13}
dest=${WHEELS:-.whl}
mkdir -p "$dest"
if [ "$dest" = .whl ] && ! git check-ignore -q .whl/x.whl 2>/dev/null; then
  echo "note: .whl/ is not ignored by git; add '/.whl/' to .git/info/exclude so it travels only when carried" >&2
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for req in "transformers==5.24.0" "regex>=2025.10.22" "peft==0.21.*" "crc32c>=2.4" "kvikio-cu${cuda}==26.10.*" \
  "libkvikio-cu${cuda}==26.10.*" "rapids-logger==0.3.*" "tbb==2023.2.*"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d "$dest" "$req"
done
du -sh "$dest"
ls "$dest"
