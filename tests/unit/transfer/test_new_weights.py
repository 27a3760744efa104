"""Adam's new weights handed to the next read of their block (``fuyou.transfer.new_weights``)."""

import torch

from fuyou.engine import Engine, EngineConfig
from fuyou.storage.cpu_meter import CpuMeter
from fuyou.storage.io_posix import PosixIO
from fuyou.timeline import Timeline
from fuyou.transfer.new_weights import NewWeights
from tests.integration.tiny_models import batches, tiny


def hand_off() -> tuple[NewWeights, Timeline, CpuMeter]:
    io = PosixIO()
    io.meter = CpuMeter()
    tl = Timeline()
    return NewWeights(tl, io), tl, io.meter


def test_claims_wait_for_publish_and_stop_at_retire():
    nw, tl, meter = hand_off()
    src = torch.arange(64, dtype=torch.uint8)
    dst, late = torch.zeros(80, dtype=torch.uint8), torch.zeros(80, dtype=torch.uint8)
    assert nw.claim(3, dst) is None  # no update in flight: read the store
    nw.expect(3)
    fut = nw.claim(3, dst)
    assert fut is not None and not fut.done()
    nw.publish(3, "w/layer3", src)
    assert fut.done() and fut.result() is None
    assert torch.equal(dst[:64], src) and not dst[64:].any()  # the extent's bytes, nothing past them
    now = nw.claim(3, late)
    assert now is not None and now.done() and torch.equal(late[:64], src)
    released = []
    nw.retire(3, None, lambda: released.append(3))
    assert released == [3]  # not held: the buffer goes back at its write
    assert nw.claim(3, torch.zeros(64, dtype=torch.uint8)) is None
    assert [s.label for s in tl.spans] == ["adam→host w/layer3"] * 2 and all(s.resource == "ram_copy" for s in tl.spans)
    cost = meter.snapshot()[("ram_handoff", "copy_out")]
    assert cost.nbytes == 128 and cost.tasks == 2


def test_a_failed_update_fails_its_waiting_claims():
    nw, _, _ = hand_off()
    nw.expect(0)
    fut = nw.claim(0, torch.zeros(8, dtype=torch.uint8))
    nw.retire(0, OSError("disk gone"), lambda: None)
    assert isinstance(fut.exception(), OSError)
    nw.expect(1)
    fut = nw.claim(1, torch.zeros(8, dtype=torch.uint8))
    nw.retire(1, None, lambda: None)  # ended without publishing and without an error of its own
    assert isinstance(fut.exception(), RuntimeError) and "block 1" in str(fut.exception())


def test_a_held_buffer_waits_past_its_write_for_the_first_claim_or_drop():
    nw, _, _ = hand_off()
    released = []
    for b in (0, 1):
        nw.expect(b, hold=True)
        nw.publish(b, f"w/{b}", torch.full((16,), b + 1, dtype=torch.uint8))
        nw.retire(b, None, lambda b=b: released.append(b))
    assert released == []  # written, not yet claimed: still held
    dst = torch.zeros(16, dtype=torch.uint8)
    assert nw.claim(0, dst).done() and (dst == 1).all() and released == [0]
    assert nw.claim(0, dst) is None  # the first claim released it: a later read goes to the store
    nw.drop()
    assert released == [0, 1] and nw.claim(1, dst) is None
    nw.expect(2, hold=True)
    nw.publish(2, "w/2", torch.ones(16, dtype=torch.uint8))
    assert nw.claim(2, dst).done()
    nw.retire(2, None, lambda: released.append(2))  # claimed before its write: released at the write
    assert released == [0, 1, 2]


def test_clipping_forward_takes_weights_from_adam_not_the_ssd(tmp_path):
    """Steps after the first: every forward block and the head come from the hand-off (held until
    claimed), only the head's borrowed embedding and backward read ``w/`` from SSD."""
    cfg, model = tiny("llama_tied", layers=3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ec = EngineConfig(
        ssd_dirs=(str(tmp_path),), precision="fp32", lr=1e-3, cpu_memory="256MiB", max_grad_norm=1.0,
        optimizer_state="fp32",  # weight reads counted below: a split master's Adam reads them too
    )  # fmt: skip
    reads = []
    with Engine.from_state_dict(cfg, sd, ec) as eng:
        H = len(eng.layout.blocks) - 1
        for ids, labels in batches(3):
            eng.timeline.clear()
            eng.train_step(ids, labels)
            eng.timeline.resolve()
            spans = eng.timeline.spans
            reads.append(
                (
                    sum(s.resource == "ssd_read" and s.label.startswith("w/") for s in spans),
                    sum(s.label.startswith("adam→host w/") for s in spans),
                )
            )
    order = H + 1 + 1 + H - 1  # forward, head, the tied embedding again, backward but the embedding's
    assert reads[0] == (order, 0)
    for ssd, handed in reads[1:]:
        # blocks 0…H-1 and the head: all handed over; the head's borrowed embedding is read again from the
        # SSD, or claimed too when its hand-off is still held at that moment (timing)
        assert ssd + handed == order and (ssd, handed) in ((order - H - 1, H + 1), (order - H - 2, H + 2))
