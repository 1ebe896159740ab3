"""The background load's pacing and byte accounting (pure; the testbed tests run it)."""
import pytest

from benchmarks.crosstraffic import (FRAME_BYTES, HEADER_BYTES, SEGMENTS, interface_bytes,
                                     main, send_interval_s)


def test_one_segmented_packet_counts_its_headers_once_on_the_interfaces():
    # A queue counts 44 frames of 1514 bytes; veth and the bridge see one 64 810-byte packet.
    assert interface_bytes(SEGMENTS * FRAME_BYTES, SEGMENTS) == \
        HEADER_BYTES + SEGMENTS * (FRAME_BYTES - HEADER_BYTES) == 64810
    assert interface_bytes(3 * SEGMENTS * FRAME_BYTES, 3 * SEGMENTS) == 3 * 64810
    assert interface_bytes(0, 0) == 0


def test_the_sends_are_paced_to_the_rate_in_frames():
    # 300 Mbit/s of 1514-byte frames, 44 to a send: 24 768 frames, 563 sends a second.
    assert 1 / send_interval_s(300) == pytest.approx(300e6 / 8 / FRAME_BYTES / SEGMENTS)


@pytest.mark.parametrize("flags, named", [(["--rate-mbit", "0"], "--rate-mbit"),
                                          (["--rate-mbit", "10", "--precedence", "8"],
                                           "--precedence")])
def test_bad_settings_are_refused(flags, named, capsys):
    with pytest.raises(SystemExit):
        main(["--peer", "10.0.0.2"] + flags)
    assert named in capsys.readouterr().err
