import os
import threading

import numpy as np
import pytest
import torch

from fuyou.device import host_aligned_empty
from fuyou.errors import (
    ChecksumError,
    ConfigError,
    DirectIOError,
    FuyouWarning,
    ManifestError,
    StoreDirError,
    StoreError,
    StoreSpaceError,
)
from fuyou.storage import ExtentSpec, TensorSpec, TensorStore
from fuyou.storage.io_select import make_io

ODD = [1, 4095, 4096, 4097, (1 << 20) + 3]


def byte_extent(name, n):
    return ExtentSpec(name, (TensorSpec("b", (n,), torch.uint8),))


def pattern(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def dirs(tmp_path, k):
    out = []
    for i in range(k):
        p = tmp_path / f"ssd{i}"
        p.mkdir()
        out.append(str(p))
    return out


def store(tmp_path, extents, ndirs=1, **kw):
    kw.setdefault("block_bytes", 64 << 10)  # small blocks: many per extent even at test sizes
    kw.setdefault("stripe_min", 8192)
    return TensorStore.create(dirs(tmp_path, ndirs), extents, **kw)


@pytest.mark.parametrize("direct", ["on", "off"])
@pytest.mark.parametrize("aligned", [True, False])
def test_round_trip_odd_sizes(tmp_path, direct, aligned):
    exts = [byte_extent(f"e{n}", n) for n in ODD]
    with store(tmp_path, exts, direct=direct) as st:
        assert st.direct == [direct == "on"]
        for n in ODD:
            src = pattern(n, n)
            buf = host_aligned_empty(n) if aligned else torch.empty(n + 1, dtype=torch.uint8)[1:]
            buf.copy_(src)
            st.write(f"e{n}", buf).result()
            out = host_aligned_empty(n) if aligned else torch.empty(n + 7, dtype=torch.uint8)[3 : 3 + n]
            st.read(f"e{n}", out).result()
            assert torch.equal(out, src), n


@pytest.mark.parametrize("ndirs", [2, 3])
def test_striped_round_trip_and_reopen(tmp_path, ndirs):
    exts = [
        ExtentSpec(f"l{i}", (TensorSpec("w", (300, 77), torch.float32), TensorSpec("b", (5,), torch.bfloat16)))
        for i in range(4)
    ]
    st = store(tmp_path, exts, ndirs)
    data = {e.name: pattern(e.nbytes, i) for i, e in enumerate(exts)}
    for name, src in data.items():
        st.write(name, src)
    assert st.commit({"step": 1}) == 1
    for d in st.dirs:  # every directory holds a piece of every striped extent
        assert len([f for f in os.listdir(d) if f.endswith(".fy")]) == len(exts)
    st.close()
    with TensorStore.open(st.dirs) as st2:
        assert (st2.version, st2.meta) == (1, {"step": 1})
        for name, src in data.items():
            out = torch.empty_like(src)
            st2.read(name, out).result()
            assert torch.equal(out, src)
        typed = st2.spec("l0").views(out)
        assert typed["w"].shape == (300, 77)


def test_many_concurrent_futures(tmp_path):
    exts = [byte_extent(f"e{i}", 10_000 + 4093 * i) for i in range(64)]
    with store(tmp_path, exts, ndirs=2, threads=8) as st:
        srcs = [pattern(e.nbytes, i) for i, e in enumerate(exts)]
        futs = [st.write(e.name, s) for e, s in zip(exts, srcs)]
        [f.result() for f in futs]
        st.commit()
        outs = [torch.empty_like(s) for s in srcs]
        futs = [st.read(e.name, o) for e, o in zip(exts, outs)]
        [f.result() for f in futs]
        assert all(torch.equal(o, s) for o, s in zip(outs, srcs))


def test_read_your_writes_and_versions(tmp_path):
    e = byte_extent("x", 100_000)
    with store(tmp_path, [e]) as st:
        with pytest.raises(StoreError, match="never been written"):
            st.read("x", torch.empty(100_000, dtype=torch.uint8))
        v1, v2 = pattern(100_000, 1), pattern(100_000, 2)
        st.write("x", v1)
        out = torch.empty_like(v1)
        st.read("x", out).result()  # uncommitted but visible
        assert torch.equal(out, v1)
        st.commit()
        st.write("x", v2)
        st.read("x", out).result()
        assert torch.equal(out, v2)
        st.abort()  # back to v1
        st.read("x", out).result()
        assert torch.equal(out, v1)
        st.write("x", v2)
        st.write("x", v1)  # a second write before commit overwrites the pending copy, in order
        st.commit()
        st.read("x", out).result()
        assert torch.equal(out, v1) and st.version == 2


def test_uncommitted_writes_are_discarded_on_reopen(tmp_path):
    e = byte_extent("x", 50_000)
    st = store(tmp_path, [e])
    st.write("x", pattern(50_000, 1))
    st.commit()
    st.write("x", pattern(50_000, 2)).result()
    st.io.shutdown()  # as if the process died: no commit, no close
    with TensorStore.open(st.dirs) as st2:
        out = torch.empty(50_000, dtype=torch.uint8)
        st2.read("x", out).result()
        assert torch.equal(out, pattern(50_000, 1))
        assert len([f for f in os.listdir(st2.dirs[0]) if f.endswith(".fy")]) == 1


def corrupt_one_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corruption_is_detected_with_file_offset_and_extent(tmp_path):
    e = byte_extent("layer7", 300_000)
    st = store(tmp_path, [e])
    st.write("layer7", pattern(300_000, 3))
    st.commit()
    st.close()
    (fname,) = [f for f in os.listdir(st.dirs[0]) if f.endswith(".fy")]
    corrupt_one_byte(os.path.join(st.dirs[0], fname), 200_000)
    out = torch.empty(300_000, dtype=torch.uint8)
    with TensorStore.open(st.dirs) as st2:
        with pytest.raises(ChecksumError, match=rf"{fname} at bytes 196608\.\.262144 \(extent 'layer7'"):
            st2.read("layer7", out).result()
    with TensorStore.open(st.dirs, checksums=False) as st3:  # switchable: off reads without checking
        st3.read("layer7", out).result()
        assert (out != pattern(300_000, 3)).sum().item() == 1


def test_truncated_file_and_missing_file(tmp_path):
    e = byte_extent("x", 200_000)
    st = store(tmp_path, [e])
    st.write("x", pattern(200_000, 1))
    st.commit()
    st.close()
    (fname,) = [f for f in os.listdir(st.dirs[0]) if f.endswith(".fy")]
    path = os.path.join(st.dirs[0], fname)
    os.truncate(path, 100_000)
    with TensorStore.open(st.dirs) as st2:
        with pytest.raises(StoreError, match="truncated"):
            st2.read("x", torch.empty(200_000, dtype=torch.uint8)).result()
    os.unlink(path)
    with pytest.raises(ManifestError, match="missing"):
        TensorStore.open(st.dirs)


def test_corrupted_manifest(tmp_path):
    st = store(tmp_path, [byte_extent("x", 10)])
    st.close()
    path = os.path.join(st.dirs[0], "manifest.json")
    text = open(path).read()
    open(path, "w").write(text.replace('"version":0', '"version":5'))
    with pytest.raises(ManifestError, match="checksum"):
        TensorStore.open(st.dirs)
    open(path, "w").write("{not json")
    with pytest.raises(ManifestError, match="unreadable"):
        TensorStore.open(st.dirs)


def test_directory_errors(tmp_path, readonly_dir):
    e = [byte_extent("x", 10)]
    with pytest.raises(StoreDirError, match="does not exist.*mkdir -p"):
        TensorStore.create([str(tmp_path / "nope")], e)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(StoreDirError, match="not a directory"):
        TensorStore.create([str(f)], e)
    with pytest.raises(StoreDirError, match="not writable"):
        TensorStore.create([readonly_dir], e)
    st = store(tmp_path, e, ndirs=2)
    st.close()
    with pytest.raises(StoreDirError, match="already holds a Fuyou store"):
        TensorStore.create(st.dirs, e)
    with pytest.raises(StoreDirError, match="creation order"):
        TensorStore.open(st.dirs[::-1])
    with pytest.raises(StoreDirError, match="striped over 2"):
        TensorStore.open(st.dirs[:1])
    with pytest.raises(ManifestError, match="no Fuyou store"):
        TensorStore.open([str(tmp_path)])
    TensorStore.create(st.dirs, e, overwrite=True).close()


def test_bad_buffers_and_names(tmp_path):
    with store(tmp_path, [byte_extent("x", 100)]) as st:
        with pytest.raises(ConfigError, match="buffer holds 99 bytes"):
            st.write("x", torch.zeros(99, dtype=torch.uint8))
        with pytest.raises(ConfigError, match="contiguous"):
            st.write("x", torch.zeros(200, dtype=torch.uint8)[::2])
        with pytest.raises(ConfigError, match="no extent 'y'"):
            st.write("y", torch.zeros(100, dtype=torch.uint8))
        st.write("x", np.arange(100, dtype=np.uint8)).result()  # numpy buffers work too


def test_space_checked_up_front(small_tmpfs):
    big = byte_extent("big", 5 << 20)  # two versions need 10 MiB > 8 MiB
    with pytest.raises(StoreSpaceError, match=rf"not enough free space in {small_tmpfs}.*2 versions"):
        TensorStore.create([small_tmpfs], [big])
    assert os.listdir(small_tmpfs) == []


def test_disk_full_during_write_keeps_previous_version(small_tmpfs):
    e = byte_extent("x", 2 << 20)
    st = TensorStore.create([small_tmpfs], [e], direct="off")
    st.write("x", pattern(2 << 20, 1))
    st.commit()
    with open(os.path.join(small_tmpfs, "filler"), "wb") as f:  # someone else fills the disk
        try:
            f.write(b"\0" * (8 << 20))
        except OSError:
            pass
    with pytest.raises(StoreSpaceError, match="disk full.*--ssd"):
        st.write("x", pattern(2 << 20, 2))
    out = torch.empty(2 << 20, dtype=torch.uint8)
    st.read("x", out).result()
    assert torch.equal(out, pattern(2 << 20, 1)) and st.version == 1
    st.close()
    os.unlink(os.path.join(small_tmpfs, "filler"))


def test_odirect_unsupported(ramfs_dir):
    e = [byte_extent("x", 5000)]
    with pytest.raises(DirectIOError, match="refuses O_DIRECT"):
        TensorStore.create([ramfs_dir], e, direct="on")
    with pytest.warns(FuyouWarning, match="buffered I/O"):
        st = TensorStore.create([ramfs_dir], e, direct="auto", overwrite=True)
    with st:
        assert st.direct == [False]
        st.write("x", pattern(5000, 1)).result()
        out = torch.empty(5000, dtype=torch.uint8)
        st.read("x", out).result()
        assert torch.equal(out, pattern(5000, 1))


def test_writes_from_another_thread(tmp_path):
    """The Adam worker writes while the main thread reads other extents."""
    exts = [byte_extent(f"e{i}", 70_000) for i in range(16)]
    with store(tmp_path, exts, threads=4) as st:

        def writer():
            for i in range(0, 16, 2):
                st.write(f"e{i}", pattern(70_000, i)).result()

        for i in range(16):
            st.write(f"e{i}", pattern(70_000, 100 + i))
        st.commit()
        t = threading.Thread(target=writer)
        t.start()
        out = torch.empty(70_000, dtype=torch.uint8)
        for i in range(1, 16, 2):
            st.read(f"e{i}", out).result()
            assert torch.equal(out, pattern(70_000, 100 + i))
        t.join()
        st.commit()
        for i in range(16):
            st.read(f"e{i}", out).result()
            assert torch.equal(out, pattern(70_000, i if i % 2 == 0 else 100 + i))


def test_engine_selection_on_cpu():
    assert make_io("posix").name == "posix"
    with pytest.raises(ConfigError):
        make_io("spdk")
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert make_io("auto").name == "posix"
        with pytest.raises(StoreError, match="kvikio"):
            make_io("kvikio")
