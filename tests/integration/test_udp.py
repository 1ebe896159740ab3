"""The UDP channel over localhost: segmentation offload and its fallback."""
import errno
import socket
import time

import numpy as np
import pytest

from dgt.transport.udp import UdpReceiver, UdpSender


def rows_of(count, row_bytes):
    rows = np.zeros((count, row_bytes), dtype=np.uint8)
    rows[:, :4] = np.arange(count, dtype="<u4").view(np.uint8).reshape(count, 4)
    rows[:, 4:] = np.random.RandomState(0).randint(0, 256, (count, row_bytes - 4))
    return rows


def receive(receiver, count, row_bytes, timeout_s=5.0):
    got = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        n = receiver.receive_batch()
        for i in range(n):
            assert receiver.sizes[i] == row_bytes
            row = receiver.rows[i, :row_bytes].copy()
            got[int(row[:4].view("<u4")[0])] = row
        if not n:
            time.sleep(0.001)
    return got


class RefusesSegmentation:
    """A socket whose kernel refuses UDP_SEGMENT with ``code``, as a route whose MTU is below
    the segment size does (EMSGSIZE) or a kernel without GSO (EINVAL)."""

    def __init__(self, sock, code):
        self.sock, self.code, self.refused = sock, code, 0

    def sendmsg(self, buffers, ancillary, flags, addr):
        if ancillary:
            self.refused += 1
            raise OSError(self.code, "refused")
        return self.sock.sendmsg(buffers, ancillary, flags, addr)


def receiver_of(batched, **kwargs):
    """A receiver on a free port that reads with recvmmsg (``batched``) or one recv_into per
    datagram, the fallback where recvmmsg is missing."""
    receiver = UdpReceiver("127.0.0.1", 0, 1 << 24, **kwargs)
    if batched and receiver._recvmmsg is None:
        receiver.close()
        pytest.skip("recvmmsg needs 64-bit Linux")
    if not batched:
        receiver._recvmmsg = None
    return receiver


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("row_bytes", [1464, 8256])
@pytest.mark.parametrize("refusal", [None, errno.EMSGSIZE, errno.EINVAL])
def test_every_row_arrives_with_or_without_segmentation_offload(row_bytes, refusal, batched,
                                                                monkeypatch):
    receiver = receiver_of(batched, row_bytes=row_bytes, batch_rows=256)
    sender = UdpSender(1, 1 << 24)
    real = sender._socks[0]
    fake = RefusesSegmentation(real, refusal)
    if refusal:
        monkeypatch.setattr(sender, "_socks", [fake])
    try:
        rows = rows_of(150, row_bytes)
        sent, refused = sender.send_rows(1, receiver.sock.getsockname(), rows)
        assert (sent, refused) == (150, 0)
        assert sender.gso == (refusal is None)
        assert fake.refused == (1 if refusal else 0)  # learnt once, not retried per call
        got = receive(receiver, 150, row_bytes)
        assert sorted(got) == list(range(150))
        for index, row in got.items():
            np.testing.assert_array_equal(row, rows[index])
    finally:
        real.close()
        receiver.close()


def test_an_unexpected_send_error_is_raised_not_hidden(monkeypatch):
    sender = UdpSender(1, 1 << 20)
    real = sender._socks[0]
    monkeypatch.setattr(sender, "_socks", [RefusesSegmentation(real, errno.EBADF)])
    try:
        with pytest.raises(OSError):
            sender.send_rows(1, ("127.0.0.1", 9), rows_of(4, 1464))
    finally:
        real.close()


@pytest.mark.parametrize("batched", [True, False])
def test_an_oversized_datagram_is_counted_and_dropped_and_the_rest_kept_in_order(batched):
    receiver = receiver_of(batched, row_bytes=64, batch_rows=8)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        addr = receiver.sock.getsockname()
        sizes = [10, 64, 65, 30, 200, 1, 64, 12, 40, 50]  # 65 and 200 do not fit a row
        for i, size in enumerate(sizes):
            sender.sendto(bytes([i]) * size, addr)
        kept, deadline = [], time.monotonic() + 5.0
        while len(kept) < 8 and time.monotonic() < deadline:
            n = receiver.receive_batch()
            assert n <= 8
            for row, size in zip(receiver.rows[:n], receiver.sizes[:n]):
                assert (row[:size] == row[0]).all()  # the row holds its own datagram's bytes
                kept.append((int(row[0]), int(size)))
            if not n:
                time.sleep(0.001)
        assert kept == [(i, size) for i, size in enumerate(sizes) if size <= 64]
        assert receiver.oversized == 2
        assert receiver.receive_batch() == 0  # nothing waiting: no error, no wait
    finally:
        sender.close()
        receiver.close()
