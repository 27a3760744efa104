import pytest
import torch

from fuyou.errors import ConfigError
from fuyou.storage.extents import FILE_ALIGN, ExtentSpec, TensorSpec, dtype_from_name, place


def ext(name, *sizes, dtype=torch.float32):
    return ExtentSpec(name, tuple(TensorSpec(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)))


def test_offsets_are_64_byte_aligned_and_views_typed():
    e = ExtentSpec("l0", (TensorSpec("a", (3,), torch.bfloat16), TensorSpec("b", (2, 2), torch.float32)))
    assert e.offsets == (0, 64) and e.nbytes == 64 + 16
    buf = torch.zeros(e.nbytes, dtype=torch.uint8)
    v = e.views(buf)
    v["b"][1, 1] = 2.0
    assert v["a"].dtype == torch.bfloat16 and v["b"].shape == (2, 2)
    assert buf[64 + 12 : 64 + 16].view(torch.float32).item() == 2.0
    with pytest.raises(ConfigError):
        e.views(torch.zeros(10, dtype=torch.uint8))


def test_json_round_trip_and_dtype_names():
    e = ExtentSpec("x", (TensorSpec("w", (4, 5), torch.bfloat16),))
    assert ExtentSpec.from_json(e.to_json()) == e
    with pytest.raises(ConfigError, match="unsupported dtype"):
        dtype_from_name("float8")
    with pytest.raises(ConfigError, match="duplicate"):
        ExtentSpec("x", (TensorSpec("w", (1,), torch.float32),) * 2)


def test_large_extents_stripe_over_all_dirs_small_ones_balance():
    big = ext("big", 3 * (1 << 20) + 5)  # 12 MiB + 20 B
    smalls = [ext(f"s{i}", 1000) for i in range(6)]
    pieces = place([big] + smalls, ndirs=3, stripe_min=1 << 20)
    bp = pieces[0]
    assert sorted(p.dir_index for p in bp) == [0, 1, 2]
    assert sum(p.length for p in bp) == big.nbytes
    assert all(p.start % FILE_ALIGN == 0 for p in bp)
    assert [p.start for p in bp] == sorted(p.start for p in bp)
    small_dirs = [ps[0].dir_index for ps in pieces[1:]]
    assert all(len(ps) == 1 for ps in pieces[1:]) and sorted(set(small_dirs)) == [0, 1, 2]


def test_empty_and_single_dir():
    pieces = place([ext("e"), ext("f", 10)], ndirs=1, stripe_min=1)
    assert pieces[0][0].length == 0 and pieces[0][0].file_bytes == FILE_ALIGN
    assert pieces[1] == (pieces[1][0],) and pieces[1][0].dir_index == 0
