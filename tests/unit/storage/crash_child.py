"""Child process for the crash test: commit versions of a store forever until killed.

Version v holds, in every extent, bytes generated from seed (v, extent index); ``meta`` = {"v": v}.
Usage: python crash_child.py DIR [DIR ...]
"""

import sys

import torch

from fuyou.storage import ExtentSpec, TensorSpec, TensorStore

EXTENTS = [ExtentSpec(f"e{i}", (TensorSpec("w", (150_000 + 4099 * i,), torch.float32),)) for i in range(6)]


def data(v: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(v * 1000 + i)
    return torch.randn(EXTENTS[i].tensors[0].shape, generator=g)


def main() -> None:
    dirs = sys.argv[1:]
    try:
        st = TensorStore.open(dirs)
    except Exception:
        st = TensorStore.create(dirs, EXTENTS, block_bytes=64 << 10, stripe_min=1 << 16)
    while True:
        v = st.version + 1
        for i, e in enumerate(EXTENTS):
            st.write(e.name, data(v, i))
        st.commit({"v": v})
        print(v, flush=True)


if __name__ == "__main__":
    main()
