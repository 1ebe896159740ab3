"""The emulated network (root only): rate shaping, priority, loss, clean teardown."""
import os
import subprocess
import sys
import time

import tempfile

import pytest

from benchmarks.testbed import MTU_FRAME_BYTES, QUEUE_FRAMES, Testbed, available, \
    queue_limits_bytes

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"testbed: {REASON}")

RECEIVE_TCP = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 5001)); srv.listen(1); conn, _ = srv.accept()
total, start = 0, time.time()
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    total += len(data)
print(total * 8 / (time.time() - start) / 1e6)
"""

SEND_TCP = """
import socket, sys
tos = int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
s.connect((sys.argv[1], 5001)); chunk = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])):
    s.sendall(chunk)
s.close()
"""

FLOOD_UDP = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0)
end = time.time() + float(sys.argv[2]); payload = b"u" * 1400
while time.time() < end:
    s.sendto(payload, (sys.argv[1], 5002))
"""


def tcp_transfer(bed, megabytes, tos=0x60, sender="a"):
    receiver = subprocess.Popen(bed.exec_prefix("b") + [sys.executable, "-c", RECEIVE_TCP],
                                stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    subprocess.run(bed.exec_prefix(sender) + [sys.executable, "-c", SEND_TCP,
                                              bed.addresses["b"], str(tos), str(megabytes)],
                   check=True, timeout=120)
    out, _ = receiver.communicate(timeout=120)
    return float(out.strip())


def test_every_class_has_the_same_queue_unless_the_low_ones_are_shortened():
    """By default the unmarked class (MXNet's TCP) queues as much as dgt's reliable one."""
    with Testbed(["a", "b"], rate_mbit=100, udp_channels=3) as bed:
        for prefix, dev in (([], bed.bridge_side("a")), (bed.exec_prefix("a"), "e0")):
            assert queue_limits_bytes(prefix, dev) == {
                c: QUEUE_FRAMES * MTU_FRAME_BYTES for c in ("1:10", "1:11", "1:12", "1:13",
                                                            "1:30")}
    with Testbed(["a", "b"], rate_mbit=100, udp_channels=3, low_queue_frames=100) as bed:
        limits = queue_limits_bytes(bed.exec_prefix("b"), "e0")
    assert limits["1:10"] == QUEUE_FRAMES * MTU_FRAME_BYTES
    assert limits["1:11"] == limits["1:13"] == limits["1:30"] == 100 * MTU_FRAME_BYTES


def test_a_link_carries_about_its_configured_rate():
    with Testbed(["a", "b"], rate_mbit=100) as bed:
        mbit = tcp_transfer(bed, 12)
    assert 80 <= mbit <= 105, mbit


def test_low_priority_udp_yields_to_the_reliable_class_and_is_dropped():
    # Incast, as at a parameter server: c floods b with unmarked UDP while a sends TCP marked
    # as dgt's reliable channel; both meet in the queue of b's incoming link.
    with Testbed(["a", "b", "c"], rate_mbit=100, udp_channels=3) as bed:
        flood = subprocess.Popen(bed.exec_prefix("c") + [sys.executable, "-c", FLOOD_UDP,
                                                         bed.addresses["b"], "6"])
        time.sleep(0.5)
        mbit = tcp_transfer(bed, 30, tos=3 << 5)  # precedence 3 = reliable channel when C=3
        flood.wait(timeout=30)
        classes = bed.class_drops("b")
        both_ways = bed.drops_by_class("b")
    assert mbit > 75, f"TCP got only {mbit:.1f} Mbit/s beside the flood"
    assert classes["1:13"]["dropped"] > 0, classes  # the flood's class lost packets
    assert classes["1:10"]["dropped"] == 0, classes  # the reliable class lost none
    # b sent only ACKs: its link's drops, both directions together, are the incoming ones.
    assert both_ways == {c: classes[c]["dropped"] for c in ("1:10", "1:11", "1:12", "1:13")}


def test_each_node_resolves_this_hosts_name_to_its_own_address():
    with Testbed(["x", "y"], rate_mbit=50) as bed:
        for node in bed.nodes:
            resolved = subprocess.run(
                bed.exec_prefix(node) + [sys.executable, "-c",
                                         "import socket; print(socket.gethostbyname("
                                         "socket.gethostname()))"],
                capture_output=True, text=True, check=True).stdout.strip()
            assert resolved == bed.addresses[node]


def test_teardown_leaves_nothing_behind():
    with Testbed(["x", "y"], rate_mbit=50) as bed:
        names = [bed.netns(n) for n in bed.nodes]
        hosts_dirs = [bed.hosts_dir(n) for n in bed.nodes]
        bridge = bed.bridge
    assert not any(os.path.exists(d) for d in hosts_dirs)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert bridge not in links


def test_teardown_runs_when_the_body_fails():
    with pytest.raises(RuntimeError):
        with Testbed(["p"], rate_mbit=50) as bed:
            name = bed.netns("p")
            raise RuntimeError("boom")
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                      text=True).stdout


SUM_WORKER = """
import os, numpy as np
from dgt.config import Config
from dgt.worker import Worker
with Worker(Config.from_env()) as worker:
    out = worker.pushpull(0, np.full(300000, worker.rank + 1, np.float32)).wait()
    print("rank", worker.rank, "on", os.environ["FAKE_SSH_HOST"], "sum", out.min(), out.max())
"""


def test_a_hostfile_job_spans_the_testbeds_nodes():
    """dgt-launch --hostfile with one server next to each worker, every process in its own
    node's namespace (tests/integration/fake_ssh.py plays ssh), reaching the others over the
    shaped links by the addresses the hostfile names."""
    fake_ssh = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "integration", "fake_ssh.py")
    with Testbed(["a", "b"], rate_mbit=100) as bed, \
            tempfile.NamedTemporaryFile("w", suffix=".hosts") as hostfile:
        hostfile.write("".join(f"{bed.addresses[n]}\n" for n in bed.nodes))
        hostfile.flush()
        # Everything reliable: the link's finite UDP queues could drop datagrams, and the sum
        # must be exact here (loss over the testbed is benchmarks/compare.py's subject).
        env = dict(os.environ, DGT_THRESHOLD="1", DGT_BIGARRAY_ELEMS="65536",
                   FAKE_SSH_NETNS=",".join(f"{bed.addresses[n]}={bed.netns(n)}"
                                           for n in bed.nodes))
        proc = subprocess.run([sys.executable, "-m", "dgt.launch", "--hostfile", hostfile.name,
                               "--ssh", f"{sys.executable} {fake_ssh}", "-n", "2", "-s", "2",
                               "--timeout", "90", sys.executable, "-c", SUM_WORKER],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for rank, node in enumerate(bed.nodes):
            # Half the parts live on the other node's server: they crossed the shaped link.
            assert f"rank {rank} on {bed.addresses[node]} sum 3.0 3.0" in proc.stdout, proc.stdout
            assert bed.link_bytes(node)["rx"] > 300000 * 4 // 2


def test_background_load_takes_its_share_from_best_effort_not_from_the_reliable_class():
    """Open-loop cross traffic at best effort: a best-effort TCP flow gets what the load
    leaves of the link, one marked as dgt's reliable channel gets the whole link, and the
    load's bytes are counted apart from the job's."""
    with Testbed(["a", "b"], rate_mbit=50, udp_channels=3) as bed:
        bed.start_cross_traffic(["a", "b"], 20)
        time.sleep(1.0)
        job_before, cross_before = bed.link_bytes("b"), bed.cross_bytes("b")
        started = time.time()
        best_effort = tcp_transfer(bed, 4, tos=0)
        reliable = tcp_transfer(bed, 6, tos=3 << 5)
        elapsed = time.time() - started
        job_after, cross_after = bed.link_bytes("b"), bed.cross_bytes("b")
    assert 20 <= best_effort <= 38, f"best effort got {best_effort:.1f} of 50 - 20 Mbit/s"
    assert reliable > 42, f"the reliable class got only {reliable:.1f} Mbit/s beside the load"
    cross_mbit = (cross_after["rx"] - cross_before["rx"]) * 8 / elapsed / 1e6
    assert 3 < cross_mbit <= 21, cross_mbit  # the load, squeezed while the reliable flow ran
    assert cross_after["tx"] > cross_before["tx"]  # b's own flow to a left on b's link
    # 10 MiB of TCP payload plus headers: the load's bytes are not counted as the job's.
    job = job_after["rx"] - job_before["rx"]
    assert 10.4e6 <= job <= 11.6e6, job


def test_background_load_is_refused_out_of_range():
    with pytest.raises(ValueError, match="cross_precedence must be within 0..3"):
        Testbed(["a", "b"], cross_precedence=4)
    with Testbed(["a", "b"], rate_mbit=50) as bed:
        with pytest.raises(ValueError, match=r"within \(0, 50\] Mbit/s"):
            bed.start_cross_traffic(["a", "b"], 80)
        with pytest.raises(ValueError, match="two or more"):
            bed.start_cross_traffic(["a"], 10)
