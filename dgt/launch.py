"""``dgt-launch``: start a dgt (or, for comparison, an MXNet ``dist_sync``) job on this machine.

    dgt-launch -n 2 -s 1 python train.py --kvstore dgt
    dgt-launch --backend mxnet -n 2 python train.py --kvstore dist_sync

Starts S servers and N workers as local processes, gives each its role, rank and the job's
settings through the environment (``DGT_*``; ``DMLC_*`` for ``--backend mxnet``), prefixes every
output line with ``[role rank]``, stops everything on the first failure and exits with that
failure's code.  Ctrl-C stops every process.  The ``DGT_*`` settings are validated before
anything starts, so a bad value fails at once with its name and allowed range.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from .config import Config
from .errors import ConfigError

__all__ = ["main", "free_port"]

_print_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port number free for both TCP and UDP on ``host`` right now."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
            return port
    raise OSError("no port free for both TCP and UDP")


def _free_port_block(host: str, count: int) -> int:
    """First of ``count`` consecutive free ports (MXNet and DMLC_PS_ROOT_PORT+i need them)."""
    for _ in range(200):
        first = free_port(host)
        try:
            for offset in range(1, count):
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    with socket.socket(socket.AF_INET, kind) as s:
                        s.bind((host, first + offset))
            return first
        except OSError:
            continue
    raise OSError(f"no block of {count} free ports")


class _Child:
    """One started process whose output is copied, line by line with a prefix, to ``out``
    (a binary stream; this process's stdout by default)."""

    def __init__(self, role: str, rank: int, argv: List[str], env: Dict[str, str], out=None):
        self.role, self.rank = role, rank
        self.name = f"{role} {rank}"
        self.out = out
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        """Copy the child's output, prefixing every line.  Progress bars redraw their line
        with a carriage return; each redraw gets the prefix too, so they stay readable."""
        prefix = f"[{self.name}] ".encode()
        out = self.out or sys.stdout.buffer
        pending = b""
        while True:
            chunk = self.proc.stdout.read1(65536)
            if not chunk:
                break
            pending += chunk
            pieces = re.split(rb"(\r\n|\n|\r)", pending)
            pending = pieces.pop()  # an unfinished line waits for the rest
            with _print_lock:
                for text, end in zip(pieces[0::2], pieces[1::2]):
                    if text or end != b"\r":
                        out.write(prefix + text + end)
                out.flush()
        if pending:
            with _print_lock:
                out.write(prefix + pending + b"\n")
                out.flush()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _say(text: str) -> None:
    with _print_lock:
        sys.stdout.write(f"[dgt-launch] {text}\n")
        sys.stdout.flush()


def _stop_all(children: List[_Child], grace_s: float = 5.0) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.signal(signal.SIGKILL)
            child.proc.wait()
    for child in children:
        child.reader.join(timeout=2.0)


def _build_children(args, command: List[str], children: List[_Child]) -> None:
    """Start every process, appending each to ``children`` at once, so that the caller can
    stop those already started if a later one cannot start."""
    base = dict(os.environ)
    base["PYTHONUNBUFFERED"] = "1"
    host = args.host
    if args.backend == "dgt":
        config = Config.from_env(base)  # validate every DGT_* setting before starting anything
        first = _free_port_block(host, args.servers) if args.port == 0 else args.port
        addrs = ",".join(f"{host}:{first + i}" for i in range(args.servers))
        job = {"DGT_NUM_WORKERS": str(args.workers), "DGT_NUM_SERVERS": str(args.servers),
               "DGT_SERVER_ADDRS": addrs,
               "DGT_JOB_ID": str(config.job_id or random.SystemRandom().randrange(1, 2 ** 32))}
        for key in ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"):
            base.pop(key, None)
        for index in range(args.servers):
            env = dict(base, **job, DGT_ROLE="server", DGT_SERVER_INDEX=str(index),
                       DGT_BIND_HOST=host)
            children.append(_Child("server", index, [sys.executable, "-m", "dgt.server"], env))
        for rank in range(args.workers):
            env = dict(base, **job, DGT_ROLE="worker", DGT_RANK=str(rank))
            children.append(_Child("worker", rank, command, env))
        return
    # MXNet's own parameter server (dist_sync and friends), for side-by-side comparisons.
    port = _free_port_block(host, 1) if args.port == 0 else args.port
    job = {"DMLC_PS_ROOT_URI": host, "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(args.workers),
           "DMLC_NODE_HOST": host}
    if host.startswith("127."):
        job["DMLC_INTERFACE"] = "lo"
    start = [sys.executable, "-c", "import mxnet"]  # importing mxnet with DMLC_ROLE runs the role
    children.append(_Child("scheduler", 0, start, dict(base, **job, DMLC_ROLE="scheduler")))
    time.sleep(1.0)  # ps-lite servers must not race the scheduler for its port
    for index in range(args.servers):
        children.append(_Child("server", index, start, dict(base, **job, DMLC_ROLE="server")))
    for rank in range(args.workers):
        env = dict(base, **job, DMLC_ROLE="worker", DGT_RANK=str(rank),
                   DGT_NUM_WORKERS=str(args.workers))
        children.append(_Child("worker", rank, command, env))


def supervise(children: List[_Child], timeout_s: float) -> int:
    """Wait for the job: the first failure stops everything and is returned; when every
    worker succeeded the other roles get 15 s to leave, then are stopped; 124 on timeout."""
    return _supervise(children, timeout_s)


def _supervise(children: List[_Child], timeout_s: float) -> int:
    workers = [c for c in children if c.role == "worker"]
    others = [c for c in children if c.role != "worker"]
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    workers_done_at: Optional[float] = None
    while True:
        for child in children:
            code = child.proc.poll()
            if code not in (None, 0):
                _say(f"{child.name} exited with code {code}; stopping the job")
                _stop_all(children)
                return code
        if workers_done_at is None and all(c.proc.poll() == 0 for c in workers):
            workers_done_at = time.monotonic()
        if workers_done_at is not None:
            if all(c.proc.poll() is not None for c in others):
                for child in children:
                    child.reader.join(timeout=2.0)
                return 0
            if time.monotonic() - workers_done_at > 15.0:
                _say("workers finished; stopping the servers")
                _stop_all(children)
                return 0
        if deadline is not None and time.monotonic() > deadline:
            _say(f"job ran past --timeout {timeout_s:g} s; stopping it")
            _stop_all(children)
            return 124
        time.sleep(0.05)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dgt-launch", description="Start a dgt job (servers + workers) on this machine.",
        epilog="Every DGT_* variable in the environment is forwarded to all processes.")
    parser.add_argument("-n", "--workers", type=int, required=True, help="number of workers")
    parser.add_argument("-s", "--servers", type=int, default=1, help="number of servers (1)")
    parser.add_argument("--backend", choices=("dgt", "mxnet"), default="dgt",
                        help="dgt servers (default), or MXNet's own ps-lite scheduler and "
                             "servers for dist_sync baselines")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the servers listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0,
                        help="first server port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="stop the job after this many seconds, exit code 124 (0: none)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="worker command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing the worker command")
    if not 1 <= args.workers <= 65535:
        parser.error(f"-n/--workers={args.workers} is out of range: allowed 1..65535")
    if not 1 <= args.servers <= 256:
        parser.error(f"-s/--servers={args.servers} is out of range: allowed 1..256")
    children: List[_Child] = []

    def terminate(signum, frame):  # a launcher killed by its own launcher stops its job too
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, terminate)
    try:
        _build_children(args, command, children)
        return _supervise(children, args.timeout)
    except ConfigError as exc:
        _say(f"configuration error: {exc}")
        _stop_all(children)
        return 2
    except FileNotFoundError as exc:
        _say(f"cannot start the command: {exc}")
        _stop_all(children)
        return 127
    except KeyboardInterrupt:
        _say("interrupted; stopping every process")
        _stop_all(children)
        return 130


if __name__ == "__main__":
    sys.exit(main())
