"""The CPU cost of moving bytes: CRC32C implementations agree, runs of blocks keep per-block checksums,
and the CPU meter charges each stage."""

import numpy as np
import pytest
import torch

from fuyou.errors import ChecksumError, ConfigError
from fuyou.storage import ExtentSpec, TensorSpec, TensorStore, checksum, crc_fast
from fuyou.storage.cpu_meter import CpuMeter, stage_of_path
from fuyou.storage.io_select import make_io
from fuyou.storage.store import stage_of_extent

LENGTHS = [0, 1, 7, 8, 9, 100, 4095, 4096, 12287, 12288, 12289, 3 * 12288 + 13, 1 << 20, (1 << 20) + 5]


# ---------------------------------------------------------------- CRC32C
@pytest.mark.skipif(not crc_fast.available(), reason="the interleaved kernel needs x86-64 with SSE4.2")
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_interleaved_crc_equals_the_reference_bit_for_bit(offset):
    import crc32c

    data = np.frombuffer(np.random.default_rng(offset).bytes((3 << 20) + 64), dtype=np.uint8)
    for n in LENGTHS:
        buf = data[offset : offset + n]
        assert crc_fast.crc32c(buf) == crc32c.crc32c(buf), n
    assert crc_fast.crc32c(np.frombuffer(b"123456789", dtype=np.uint8)) == 0xE3069283  # the standard check value


@pytest.mark.parametrize("mode", ["lib", "fast", "auto"])
def test_every_choice_gives_the_same_checksums(mode):
    data = np.frombuffer(np.random.default_rng(1).bytes(70_001), dtype=np.uint8)
    try:
        name = checksum.choose(mode)
        assert name in ("lib", "fast") and (name == "lib" if mode == "lib" else True)
        assert checksum.crc(data) == checksum.crc(data.tobytes()) == checksum.crc(memoryview(data.tobytes()))
        import crc32c

        assert checksum.crc(data) == crc32c.crc32c(data.tobytes())
    finally:
        checksum.choose()


def test_an_unknown_crc_mode_is_refused():
    with pytest.raises(ConfigError, match="FUYOU_CRC"):
        checksum.choose("sse9")


# ---------------------------------------------------------------- runs of blocks
@pytest.mark.parametrize("request_blocks", [1, 3, 64])
@pytest.mark.parametrize("direct", [False, True])
def test_runs_of_blocks_keep_one_checksum_per_block(tmp_path, request_blocks, direct):
    """However many blocks one system call moves, the CRCs are per block (the manifest's format) and a
    corrupted block is named by its own byte range."""
    bb, n = 4096, 10 * 4096 + 1000
    io = make_io("posix", threads=3, block_bytes=bb, request_bytes=request_blocks * bb)
    path = tmp_path / "f"
    path.write_bytes(bytes(11 * 4096))
    try:
        h = io.open(str(path), direct)
        src = np.frombuffer(np.random.default_rng(2).bytes(n), dtype=np.uint8).copy()
        crcs = io.write(h, src).result()
        assert crcs == [checksum.crc(src[s : s + bb]) for s in range(0, n, bb)]
        out = np.zeros(n, dtype=np.uint8)
        assert io.read(h, out, crcs, "test").result() == crcs and (out == src).all()
        odd = np.zeros(n + 1, dtype=np.uint8)[1:]  # misaligned: through the bounce buffer
        io.read(h, odd, crcs, "test").result()
        assert (odd == src).all()
        bad = list(crcs)
        bad[7] ^= 1
        with pytest.raises(ChecksumError, match=f"at bytes {7 * bb}..{8 * bb} "):
            io.read(h, out, bad, "test").result()
    finally:
        io.shutdown()


# ---------------------------------------------------------------- the meter
def test_stages_are_named_from_extents_and_paths():
    assert stage_of_extent("w/layers.3") == "weights"
    assert stage_of_extent("s/layers.3/1") == "state"
    assert stage_of_extent("x") == "other"
    assert stage_of_path("/ssd/gradients/b3.grad") == "grad_park"
    assert stage_of_path("/ssd/activations/b3.k0.act") == "activations"
    assert stage_of_path("/ssd/000001.0.1.fy") == "other"


def test_the_meter_charges_each_stage_its_bytes_and_cpu(tmp_path):
    exts = [
        ExtentSpec("w/b0", (TensorSpec("x", (300_000,), torch.float32),)),
        ExtentSpec("s/b0/0", (TensorSpec("master", (300_000,), torch.float32),)),
    ]
    with TensorStore.create([str(tmp_path)], exts, block_bytes=64 << 10, threads=2) as st:
        assert st.io.meter is None  # off unless attached
        meter = st.io.meter = CpuMeter()
        buf = torch.ones(300_000)
        for e in exts:
            st.write(e.name, buf).result()
        st.commit()
        before = meter.snapshot()
        for e in exts:
            st.read(e.name, buf).result()
        costs = meter.snapshot()
    for stage in ("weights", "state"):
        w, r = costs[(stage, "write")], costs[(stage, "read")]
        assert w.nbytes == r.nbytes == 1_200_000 and w.cpu_s > 0 and r.cpu_s > 0 and r.cpu_s_per_gb > 0
        assert costs[(stage, "fsync")].nbytes == 0
    d = CpuMeter.diff(costs, before)
    assert set(d) == {"state.read", "weights.read"} and d["state.read"]["bytes"] == 1_200_000
    meter.reset()
    assert meter.snapshot() == {}
