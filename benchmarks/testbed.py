"""An emulated congested cluster on one Linux machine (root only).

    python -m benchmarks.testbed check                 # can this machine build it?
    python -m benchmarks.testbed demo --rate 100       # build, measure, tear down

One network namespace per node, each joined by a veth pair to one bridge; addresses in a
private /24 used only by the testbed.  Every link is shaped in *both* directions (the node's
``e0`` for what it sends, the bridge-side ``v..`` for what it receives, where a parameter
server's incast builds up) with HTB at ``rate_mbit``:

* one class per priority level, matched with ``u32`` on the IP precedence bits of the TOS byte
  that dgt sets per channel (``IP_TOS``, no privilege needed): the reliable channel (precedence
  C) gets the highest HTB priority, UDP channel i (precedence C - i) priority i, so that a
  class only gets what the classes above it leave;
* everything else (precedence 0: ARP, MXNet's and Horovod's unmarked TCP) lands in the lowest
  class, which still gets the whole link when it is alone;
* every class has a finite queue, a byte-limited ``bfifo`` (senders hand the kernel 64 KB
  GSO/TSO super-packets) of ``top_queue_frames`` full frames for the top class and
  ``low_queue_frames`` for the others -- both ``QUEUE_FRAMES`` by default, the same for every
  class, so that the systems differ only by their marks: MXNet's unmarked TCP gets the queue
  that dgt's reliable TCP gets.  Under congestion the kernel drops in the classes that the
  higher ones starve -- real loss, as in a switch with priority queues.  A shorter
  ``low_queue_frames`` emulates a shallow-buffered switch; it also shortens the queue of the
  unmarked TCP of the other systems, and slows them (benchmarks/RESULTS.md, 2026-12-04);
* optional background load (:meth:`Testbed.start_cross_traffic`, ``benchmarks/crosstraffic.py``):
  an open-loop UDP flow into and out of every loaded node, queued in a class of its own with
  the priority and queue length of its precedence (``cross_precedence``, best effort by
  default), as another tenant's traffic would be.  Its bytes are counted in that class and
  left out of :meth:`Testbed.link_bytes`, so the job's bytes stay the job's.

Set-up and teardown are one context manager; teardown always runs (``finally`` and SIGTERM/
SIGINT) and deletes the namespaces and the bridge, which takes the veths and qdiscs with them.
The kernel needs htb, bfifo and u32 (no netem, no prio: they are not everywhere).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from benchmarks.crosstraffic import DISCARD_PORT, interface_bytes

__all__ = ["Testbed", "available", "TestbedUnavailable"]

MTU_FRAME_BYTES = 1514
QUEUE_FRAMES = 1000  # every class's queue by default, in full frames (12 ms at 1 Gbit/s)
CROSS_CLASS = "1:30"  # the background load's own HTB class on every shaped device
HTB_QUANTUM_BYTES = 100_000  # > a 64 KB GSO/TSO packet, < HTB's 200 000 ceiling
NETNS_ETC = "/etc/netns"  # per-namespace /etc files that `ip netns exec` mounts


class TestbedUnavailable(RuntimeError):
    """This machine cannot build the testbed; the message says why."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def available() -> Optional[str]:
    """None when the testbed can be built here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (Debian package iproute2)"
    name = f"dgtp{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", name)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "handle",
             "1:", "htb", "default", "10")
        _run("ip", "netns", "exec", name, "tc", "class", "add", "dev", "lo", "parent", "1:",
             "classid", "1:10", "htb", "rate", "1mbit")
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "parent", "1:10",
             "bfifo", "limit", "15140")
        _run("ip", "netns", "exec", name, "tc", "filter", "add", "dev", "lo", "parent", "1:",
             "protocol", "ip", "u32", "match", "ip", "tos", "0x00", "0xe0", "flowid", "1:10")
    except RuntimeError as exc:
        return f"the kernel lacks htb, bfifo or u32: {exc}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


@dataclass
class Testbed:
    """A star of ``nodes`` (names) around one bridge, every link shaped to ``rate_mbit``."""

    __test__ = False  # not a pytest test class, despite its name

    nodes: List[str]
    rate_mbit: float = 1000.0
    udp_channels: int = 3
    top_queue_frames: int = QUEUE_FRAMES
    low_queue_frames: int = QUEUE_FRAMES  # every class below the top one
    subnet: str = "10.213.77"  # private, testbed-only addresses: <subnet>.<1..>
    cross_precedence: int = 0  # IP precedence of the background load, 0..udp_channels
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    addresses: Dict[str, str] = field(default_factory=dict)
    _up: bool = False
    _cross: List[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.cross_precedence <= self.udp_channels:
            raise ValueError(f"cross_precedence must be within 0..{self.udp_channels} (the "
                             f"precedence levels of the classes), got {self.cross_precedence}")

    # -- naming -------------------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return f"dgt{self.tag}-{node}"

    def bridge_side(self, node: str) -> str:
        return f"v{self.tag}{self.nodes.index(node)}"

    @property
    def bridge(self) -> str:
        return f"br{self.tag}"

    def exec_prefix(self, node: str) -> List[str]:
        """Prefix a command with this to run it inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.netns(node)]

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        reason = available()
        if reason:
            raise TestbedUnavailable(reason)
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in self._previous:
            signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()
        for sig, handler in getattr(self, "_previous", {}).items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.teardown()
        raise KeyboardInterrupt(f"signal {signum}")

    def _build(self) -> None:
        self._up = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for index, node in enumerate(self.nodes):
            ns, outside = self.netns(node), self.bridge_side(node)
            address = f"{self.subnet}.{index + 1}"
            self.addresses[node] = address
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "e0", "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            inside = ["ip", "netns", "exec", ns]
            _run(*inside, "ip", "addr", "add", f"{address}/24", "dev", "e0")
            _run(*inside, "ip", "link", "set", "e0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            self._write_hosts(node)
            self._shape([], outside)
            self._shape(inside, "e0")

    def hosts_dir(self, node: str) -> str:
        return os.path.join(NETNS_ETC, self.netns(node))

    def _write_hosts(self, node: str) -> None:
        """Inside a node, this machine's host name resolves to the node's own address, as on
        a real cluster (``ip netns exec`` mounts /etc/netns/<ns>/hosts over /etc/hosts).
        Gloo, under Horovod, finds its address that way for some of its contexts."""
        os.makedirs(self.hosts_dir(node), exist_ok=True)
        with open(os.path.join(self.hosts_dir(node), "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{self.addresses[node]} {socket.gethostname()} "
                    f"{node}\n")

    def _shape(self, prefix: List[str], dev: str) -> None:
        """HTB with one class per precedence level; see the module docstring."""
        rate = f"{self.rate_mbit}mbit"
        levels = self.udp_channels + 1  # precedence C (reliable) .. 0 (last UDP channel)
        lowest = 10 + levels - 1
        tc = [*prefix, "tc"]
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default",
             str(lowest), "r2q", "100")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", rate, "ceil", rate)
        def leaf(classid: str, level: int, handle: str) -> None:
            assured = rate if level == 0 else "1mbit"
            # Classes of one priority (a level and the background load) share what they
            # borrow round-robin, one quantum per turn: a quantum above the largest GSO/TSO
            # packet makes that share fair in bytes, not in packets.
            _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", classid, "htb",
                 "rate", assured, "ceil", rate, "prio", str(min(level, 7)),
                 "quantum", str(HTB_QUANTUM_BYTES))
            # A byte limit, not a packet one: senders hand the kernel GSO/TSO super-packets of
            # up to 64 KB, and a packet-counted queue would hold 40x more data than intended.
            queue = self.top_queue_frames if level == 0 else self.low_queue_frames
            _run(*tc, "qdisc", "add", "dev", dev, "parent", classid, "handle", handle,
                 "bfifo", "limit", str(queue * MTU_FRAME_BYTES))

        for level in range(levels):  # level 0 = reliable channel = highest priority
            classid = f"1:{10 + level}"
            precedence = self.udp_channels - level
            leaf(classid, level, f"{20 + level}:")
            _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2",
                 "u32", "match", "ip", "tos", f"{precedence << 5:#04x}", "0xe0",
                 "flowid", classid)
        # The background load, matched on its port before the TOS filters: the priority of
        # its precedence, but a queue apart, so that its bytes can be told from the job's.
        leaf(CROSS_CLASS, self.udp_channels - self.cross_precedence, "30:")
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "protocol", "17", "0xff", "match", "ip", "dport",
             str(DISCARD_PORT), "0xffff", "flowid", CROSS_CLASS)

    def start_cross_traffic(self, nodes: List[str], rate_mbit: float) -> None:
        """Load every link of ``nodes`` with ``rate_mbit`` of background traffic in each
        direction until teardown: the nodes form a ring, each sending one open-loop flow to
        the next (``benchmarks/crosstraffic.py``)."""
        if len(nodes) < 2 or not set(nodes) <= set(self.nodes):
            raise ValueError(f"cross traffic needs two or more of the testbed's nodes "
                             f"{self.nodes}, got {nodes}")
        if not 0 < rate_mbit <= self.rate_mbit:
            raise ValueError(f"cross traffic rate must be within (0, {self.rate_mbit:g}] "
                             f"Mbit/s (the link rate), got {rate_mbit:g}")
        for index, node in enumerate(nodes):
            peer = self.addresses[nodes[(index + 1) % len(nodes)]]
            self._cross.append(subprocess.Popen(
                self.exec_prefix(node) + [sys.executable, "-m", "benchmarks.crosstraffic",
                                          "--peer", peer, "--rate-mbit", str(rate_mbit),
                                          "--precedence", str(self.cross_precedence)],
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                stdout=subprocess.DEVNULL))

    def teardown(self) -> None:
        if not self._up:
            return
        self._up = False
        for proc in self._cross:
            proc.kill()
            proc.wait()
        for node in self.nodes:
            pids = _run("ip", "netns", "pids", self.netns(node), check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", self.netns(node), check=False)
            shutil.rmtree(self.hosts_dir(node), ignore_errors=True)
        _run("ip", "link", "del", self.bridge, check=False)

    # -- measurements -------------------------------------------------------------------------
    def link_bytes(self, node: str) -> Dict[str, int]:
        """Bytes the node received (``rx``) and sent (``tx``) so far, from the bridge side,
        without the background load's (:meth:`cross_bytes`)."""
        base = f"/sys/class/net/{self.bridge_side(node)}/statistics"
        with open(f"{base}/tx_bytes") as f:
            received = int(f.read())
        with open(f"{base}/rx_bytes") as f:
            sent = int(f.read())
        cross = self.cross_bytes(node)
        return {"rx": received - cross["rx"], "tx": sent - cross["tx"]}

    def cross_bytes(self, node: str) -> Dict[str, int]:
        """Background-load bytes the node's link carried so far: ``rx`` towards the node
        (sent by its bridge-side queue), ``tx`` from it (sent by its own ``e0`` queue)."""
        towards = _class_stats([], self.bridge_side(node)).get(CROSS_CLASS, {})
        away = _class_stats(self.exec_prefix(node), "e0").get(CROSS_CLASS, {})
        return {direction: interface_bytes(stats.get("bytes", 0), stats.get("packets", 0))
                for direction, stats in (("rx", towards), ("tx", away))}

    def job_classes(self) -> List[str]:
        """The job's HTB classes, top (dgt's reliable channel) to lowest (its last UDP
        channel, and every unmarked packet)."""
        return [f"1:{10 + level}" for level in range(self.udp_channels + 1)]

    def drops_by_class(self, node: str) -> Dict[str, int]:
        """Packets the node's link dropped so far in each of :meth:`job_classes`, both
        directions together (the bridge side for what it receives, ``e0`` for what it
        sends). A GSO/TSO super-packet dropped whole counts once."""
        totals = dict.fromkeys(self.job_classes(), 0)
        for prefix, dev in (([], self.bridge_side(node)), (self.exec_prefix(node), "e0")):
            for classid, stats in _class_stats(prefix, dev).items():
                if classid in totals:
                    totals[classid] += stats["dropped"]
        return totals

    def class_drops(self, node: str) -> Dict[str, Dict[str, int]]:
        """Per-class sent bytes and drops on the node's incoming link (bridge side)."""
        return _class_stats([], self.bridge_side(node))


def queue_limits_bytes(prefix: List[str], dev: str) -> Dict[str, int]:
    """``{classid: limit}``: the byte limit of the queue under each HTB class on ``dev``, as
    the kernel holds it (``tc qdisc show``)."""
    text = _run(*prefix, "tc", "qdisc", "show", "dev", dev).stdout
    limits = {}
    for line in text.splitlines():
        words = line.split()
        if words[:2] == ["qdisc", "bfifo"] and "parent" in words and "limit" in words:
            limit = words[words.index("limit") + 1]
            scale = {"Kb": 1024, "Mb": 1024 ** 2}.get(limit.lstrip("0123456789"), 1)
            limits[words[words.index("parent") + 1]] = int(limit.rstrip("bKM")) * scale
    return limits


def _class_stats(prefix: List[str], dev: str) -> Dict[str, Dict[str, int]]:
    """``{classid: {"bytes": .., "packets": .., "dropped": ..}}`` sent and dropped by the HTB
    classes on ``dev`` (a segmented packet counts as its segments)."""
    text = _run(*prefix, "tc", "-s", "class", "show", "dev", dev).stdout
    out, current = {}, None
    for line in text.splitlines():
        words = line.split()
        if words[:2] == ["class", "htb"]:
            current = words[2]
        elif words[:1] == ["Sent"] and current:
            where = [i for i, w in enumerate(words) if w.strip("(") == "dropped"][0]
            dropped = int(words[where + 1].rstrip(","))
            out[current] = {"bytes": int(words[1]), "packets": int(words[3]),
                            "dropped": dropped}
    return out


def _measure_demo(rate: float) -> int:
    """Build a 2-node testbed and show shaping and priority at work."""
    server_code = ("import socket,time,sys\n"
                   "t=socket.socket();t.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                   "t.bind(('0.0.0.0',5001));t.listen(1);c,_=t.accept();n=0;s=time.time()\n"
                   "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
                   "print(f'tcp {n*8/(time.time()-s)/1e6:.1f} Mbit/s')\n")
    with Testbed(["a", "b"], rate_mbit=rate) as bed:
        receiver = subprocess.Popen(bed.exec_prefix("b") + [sys.executable, "-c", server_code],
                                    stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        sender_code = ("import socket;s=socket.create_connection(('%s',5001));"
                       "d=b'x'*(1<<20)\nfor _ in range(%d): s.sendall(d)\ns.close()"
                       % (bed.addresses["b"], max(4, int(rate / 8))))
        start = time.time()
        subprocess.run(bed.exec_prefix("a") + [sys.executable, "-c", sender_code], check=True)
        out, _ = receiver.communicate(timeout=120)
        sys.stdout.write(f"configured {rate} Mbit/s; measured {out.strip()} "
                         f"({time.time() - start:.1f} s)\n")
        sys.stdout.write(f"classes on b's link: {bed.class_drops('b')}\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.testbed")
    parser.add_argument("action", choices=("check", "demo"))
    parser.add_argument("--rate", type=float, default=1000.0, help="link rate, Mbit/s")
    args = parser.parse_args(argv)
    reason = available()
    if args.action == "check":
        sys.stdout.write("testbed available\n" if reason is None else f"unavailable: {reason}\n")
        return 0 if reason is None else 1
    if reason:
        sys.stdout.write(f"unavailable: {reason}\n")
        return 1
    return _measure_demo(args.rate)


if __name__ == "__main__":
    sys.exit(main())
