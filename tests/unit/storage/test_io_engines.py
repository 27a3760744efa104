"""I/O backend selection, the non-descriptor ``pyfile`` engine, and the bounded open-file cache."""

import errno
import os
import threading

import numpy as np
import pytest
import torch

from fuyou.errors import ConfigError, StoreError
from fuyou.storage import ExtentSpec, TensorSpec, TensorStore, io_base, io_select
from fuyou.storage.io_select import IO_ENV, make_io
from fuyou.storage.open_files import FileHandle, OpenFiles, default_capacity
from tests.io_engines import engines_under_test


# ---------------------------------------------------------------- selection
def test_auto_is_posix_even_where_kvikio_is_usable(monkeypatch):
    """kvikio is not yet measured faster: it must be asked for by name."""
    monkeypatch.delenv(IO_ENV, raising=False)
    monkeypatch.setattr(io_select, "kvikio_usable", lambda: True, raising=False)  # wherever the choice looks
    monkeypatch.setattr("fuyou.storage.io_kvikio.kvikio_usable", lambda: True)
    eng = make_io("auto")
    try:
        assert eng.name == "posix"
    finally:
        eng.shutdown()


def test_fuyou_io_names_the_engine_auto_stands_for(monkeypatch):
    monkeypatch.setenv(IO_ENV, "pyfile")
    eng = make_io("auto")
    assert eng.name == "pyfile"
    eng.shutdown()
    eng = make_io("posix")  # an explicit kind wins over the variable
    assert eng.name == "posix"
    eng.shutdown()
    monkeypatch.setenv(IO_ENV, "spdk")
    with pytest.raises(ConfigError, match="FUYOU_IO"):
        make_io("auto")


# ---------------------------------------------------------------- the pyfile engine
def test_pyfile_handles_are_not_descriptors(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    eng = make_io("pyfile", threads=2, block_bytes=4096)
    h = eng.open(str(path), direct=False)
    src = np.arange(8192, dtype=np.uint8)
    eng.write(h, src).result()
    with eng.files.use(h) as raw:
        assert not isinstance(raw, int)
    out = np.zeros(8192, dtype=np.uint8)
    eng.fsync(h).result()
    eng.read(h, out, None, "test").result()
    assert (out == src).all()
    eng.close(h)
    with pytest.raises(StoreError, match="closed"):
        eng.read(h, out, None, "test").result()
    eng.shutdown()


def test_engine_open_refuses_a_missing_file(tmp_path):
    eng = make_io("posix", threads=1)
    with pytest.raises(StoreError, match="does not exist"):
        eng.open(str(tmp_path / "nope"), direct=False)
    eng.shutdown()


# ---------------------------------------------------------------- the open-file cache
class Counting:
    """opener/closer pair that records what is open."""

    def __init__(self) -> None:
        self.open: set[int] = set()
        self.peak = 0
        self.next = 0
        self.lock = threading.Lock()

    def opener(self, path: str, direct: bool) -> int:
        with self.lock:
            self.next += 1
            self.open.add(self.next)
            self.peak = max(self.peak, len(self.open))
            return self.next

    def closer(self, raw: int) -> None:
        with self.lock:
            self.open.remove(raw)


def test_cache_keeps_at_most_capacity_files_open_least_recent_first():
    c = Counting()
    files = OpenFiles(c.opener, c.closer, capacity=3)
    hs = [FileHandle(f"/f{i}", False) for i in range(6)]
    raws = []
    for h in hs[:3]:
        with files.use(h) as raw:
            raws.append(raw)
    with files.use(hs[0]) as raw:  # a hit: no new open, and h0 becomes the most recent
        assert raw == raws[0]
    with files.use(hs[3]):  # evicts h1, the least recently used
        pass
    assert len(files) == 3 and c.open == {raws[0], raws[2], 4}
    for h in hs:
        with files.use(h):
            pass
    assert len(files) == 3 and c.peak <= 4 and files.opens == 9  # h0 hit, then 5 misses


def test_a_pinned_file_is_never_closed_under_its_user():
    c = Counting()
    files = OpenFiles(c.opener, c.closer, capacity=1)
    a, b = FileHandle("/a", False), FileHandle("/b", False)
    with files.use(a) as ra:
        with files.use(b) as rb:  # over capacity while both are pinned
            assert ra in c.open and rb in c.open
            files.forget(a)  # closing a file in use defers the close to its release
            assert ra in c.open
        assert len(files) == 1 and c.open == {ra}  # back within capacity: b (unpinned) was closed
    assert not c.open  # a's deferred close happened at its release
    with pytest.raises(StoreError, match="closed"):
        with files.use(a):
            pass


def test_concurrent_users_stay_within_capacity_plus_threads():
    c = Counting()
    cap, threads = 4, 8
    files = OpenFiles(c.opener, c.closer, capacity=cap)
    hs = [FileHandle(f"/f{i}", False) for i in range(40)]
    errors = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                h = hs[int(rng.integers(len(hs)))]
                with files.use(h) as raw:
                    assert raw in c.open  # never closed while pinned
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]
    assert c.peak <= cap + threads + threads  # capacity, pinned overflow, racing duplicate opens
    assert len(files) <= cap
    files.close_all()
    assert not c.open


def test_default_capacity_is_a_share_of_the_open_file_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    assert default_capacity(16) == 256
    assert default_capacity(16, fds_per_file=2) == 128
    monkeypatch.setattr(resource, "getrlimit", lambda _: (64, 64))
    assert default_capacity(16) == 20  # never fewer than one file per I/O thread plus a few
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert default_capacity(16) == 4096


@pytest.mark.parametrize("io", engines_under_test())
def test_store_with_a_tiny_open_file_cap_keeps_data_and_checkpoint_links(tmp_path, monkeypatch, io):
    """Many more files than the cap: renames of recycled spares, evictions and reopens, commits and
    a hard-linked checkpoint all keep every byte right."""
    monkeypatch.setattr(io_base, "default_capacity", lambda threads, fds_per_file=1: 3)
    d = tmp_path / "s"
    d.mkdir()
    n = 50_000
    exts = [ExtentSpec(f"e{i}", (TensorSpec("w", (n,), torch.float32),)) for i in range(12)]
    with TensorStore.create([str(d)], exts, io=io, block_bytes=64 << 10, threads=4) as st:
        for v in range(1, 5):
            for e in exts:
                st.write(e.name, torch.full((n,), float(v + int(e.name[1:])))).result()
            st.commit({"v": v})
            if v == 2:
                os.makedirs(d / "ck")
                for _, f in st.committed()[1]:  # what a checkpoint links: the committed version's files
                    os.link(d / f, d / "ck" / f)
            assert len(st.io.files) <= 3
        buf = torch.empty(n)
        for e in exts:
            st.read(e.name, buf).result()
            assert (buf == 4 + int(e.name[1:])).all()
        assert st.io.files.opens > 3 * len(exts)  # it really did evict and reopen
    linked = os.listdir(d / "ck")
    assert len(linked) == len(exts)
    assert all(os.stat(d / "ck" / f).st_nlink == 1 for f in linked)  # the store unlinked, never reused, them
    for f in linked:  # the checkpointed version (v == 2) is intact: first float of each file
        e = int(f.split(".")[0])
        assert np.fromfile(d / "ck" / f, dtype=np.float32, count=1)[0] == 2 + e


def test_kvikio_settings_give_it_threads_and_o_direct():
    """What the kvikio backend sets (applied and checked on a GPU machine: tests/gpu): a pool of at least
    the store's threads, never shrunk, and O_DIRECT reads and writes exactly when the store uses them."""
    from fuyou.storage.io_kvikio import kvikio_settings

    assert kvikio_settings(16, True) == {"num_threads": 16, "auto_direct_io_read": True, "auto_direct_io_write": True}
    assert kvikio_settings(16, False, current_threads=32)["num_threads"] == 32
    assert not kvikio_settings(4, False)["auto_direct_io_read"]


@pytest.mark.parametrize(
    "text, code",
    [
        ("KvikIO failure at: posix_io.hpp:141: Cannot write to file: No space left on device", errno.ENOSPC),
        ("KvikIO failure at: posix_io.hpp:141: pwrite failed: Disk quota exceeded", errno.EDQUOT),
        ("KvikIO failure: pread() failed (ENOSPC)", errno.ENOSPC),
        ("KvikIO failure: pread() failed: errno 5", errno.EIO),
        ("KvikIO failure at: file_handle.hpp:88: Too many open files", errno.EMFILE),
        ("KvikIO failure: something nobody expected", errno.EIO),
    ],
)
def test_kvikio_runtime_errors_become_the_stores_one_line_hints(text, code):
    """kvikio raises RuntimeError for failed system calls (it cannot do I/O here without a CUDA driver,
    so the mapper is fed its exceptions directly): each comes out as an OSError with the errno its text
    names, which ``io_base.os_error`` turns into the same hint the POSIX backend gives."""
    from fuyou.errors import StoreSpaceError, SystemLimitError
    from fuyou.storage.io_base import os_error
    from fuyou.storage.io_kvikio import kvikio_os_error

    e = kvikio_os_error(RuntimeError(text), "kvikio pwrite")
    assert isinstance(e, OSError) and e.errno == code and text in str(e)
    hint = os_error(e, "/ssd/w.bin", "writing")
    if code in (errno.ENOSPC, errno.EDQUOT):
        assert isinstance(hint, StoreSpaceError) and "disk full" in str(hint) and "\n" not in str(hint)
    elif code == errno.EMFILE:
        assert isinstance(hint, SystemLimitError)
    else:
        assert "check the disk" in str(hint)


def test_a_kvikio_write_that_fails_reaches_the_caller_as_a_disk_full_store_error(tmp_path):
    """Through the backend's own block write (kvikio's ``pwrite`` future raising as it does on a full
    disk): the store's write future fails with StoreSpaceError, not kvikio's RuntimeError."""
    from fuyou.errors import StoreSpaceError
    from fuyou.storage.io_kvikio import KvikioIO
    from fuyou.storage.io_pyfile import PyFileIO

    class FullDisk:
        def pwrite(self, arr, n, offset):
            raise RuntimeError("KvikIO failure at: posix_io.hpp:141: Cannot write to file: No space left on device")

        def close(self):
            pass

    class FakeKvikio(PyFileIO):  # PyFileIO's pool and files, kvikio's block write
        _write_block = KvikioIO._write_block

        def _open_raw(self, path, direct):
            return FullDisk()

        def _close_raw(self, raw):
            raw.close()

    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 8192)
    io = FakeKvikio(threads=1)
    try:
        h = io.open(str(path), False)
        with pytest.raises(StoreSpaceError, match="disk full"):
            io.write(h, np.zeros(8192, np.uint8)).result()
    finally:
        io.shutdown()
