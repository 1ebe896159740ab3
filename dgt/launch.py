"""``dgt-launch``: start a dgt (or, for comparison, an MXNet ``dist_sync``) job.

    dgt-launch -n 2 -s 1 python train.py --kvstore dgt
    dgt-launch --backend mxnet -n 2 python train.py --kvstore dist_sync
    dgt-launch -n 4 -s 4 --hostfile hosts python train.py --kvstore dgt

Starts S servers and N workers, as local processes or, with ``--hostfile``, over ssh on the
listed hosts (see :mod:`dgt.hosts`); gives each its role, rank and the job's settings through
the environment (``DGT_*``; ``DMLC_*`` for ``--backend mxnet``), prefixes every output line with
``[role rank]``, stops everything on the first failure and exits with that failure's code.
Ctrl-C stops every process, remote ones included.  The ``DGT_*`` settings are validated before
anything starts, so a bad value fails at once with its name and allowed range.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from . import hosts as hostfile
from .config import Config
from .errors import ConfigError

__all__ = ["main", "free_port", "free_port_block"]

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


def free_port_block(host: str, count: int) -> int:
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

    def __init__(self, role: str, rank: int, argv: List[str], env: Dict[str, str], out=None,
                 host: Optional[str] = None):
        self.role, self.rank, self.host = role, rank, host
        self.name = f"{role} {rank}"
        self.out = out
        # A remote process is ended by closing its ssh's stdin (see dgt.hosts), so that pipe
        # stays open, unwritten, for the process's life.
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE if host else subprocess.DEVNULL,
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
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
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


DEFAULT_REMOTE_PORT = 9091  # first server port with --hostfile (remote ports cannot be probed)
DEFAULT_SSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"  # never prompt, never wait forever


class _Spawner:
    """Starts one process per call, here or (with a hostfile) over ssh on a given host, and
    appends it to ``children`` at once, so that the caller can stop those already started if a
    later one cannot start."""

    def __init__(self, args, base: Dict[str, str], children: List[_Child]):
        self.args, self.base, self.children = args, base, children
        self.hosts = hostfile.read_hostfile(args.hostfile) if args.hostfile else None
        if self.hosts is not None:
            self.ssh = shlex.split(args.ssh)
            if not self.ssh:
                raise ConfigError("--ssh is empty: it must name the command that reaches a host")
            self.forwarded = dict(hostfile.forwarded_env(base, args.env),
                                  PYTHONUNBUFFERED="1")

    def hosts_of(self, count: int) -> List[Optional[hostfile.Host]]:
        return hostfile.place(self.hosts, count) if self.hosts else [None] * count

    def address(self, host: Optional[hostfile.Host]) -> str:
        return host.address if host else self.args.host

    def first_port(self, count: int) -> int:
        """``--port``, or else the first of ``count`` ports free here; remote hosts cannot be
        probed, so they get :data:`DEFAULT_REMOTE_PORT`."""
        if self.args.port:
            return self.args.port
        return DEFAULT_REMOTE_PORT if self.hosts else free_port_block(self.args.host, count)

    def start(self, role: str, rank: int, argv: List[str], env: Dict[str, str],
              host: Optional[hostfile.Host]) -> None:
        if host is None:
            self.children.append(_Child(role, rank, argv, dict(self.base, **env)))
            return
        command = hostfile.remote_command(argv, dict(self.forwarded, **env), self.args.workdir)
        self.children.append(_Child(role, rank, [*self.ssh, host.target, command],
                                    dict(os.environ), host=host.target))


def _build_children(args, command: List[str], children: List[_Child]) -> None:
    """Start every process (see :class:`_Spawner`)."""
    base = dict(os.environ)
    base["PYTHONUNBUFFERED"] = "1"
    if args.backend == "dgt":
        config = Config.from_env(base)  # validate every DGT_* setting before starting anything
        for key in ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"):
            base.pop(key, None)
        spawn = _Spawner(args, base, children)
        server_hosts = spawn.hosts_of(args.servers)
        first = spawn.first_port(args.servers)
        addrs = ",".join(f"{spawn.address(h)}:{first + i}" for i, h in enumerate(server_hosts))
        job = {"DGT_NUM_WORKERS": str(args.workers), "DGT_NUM_SERVERS": str(args.servers),
               "DGT_SERVER_ADDRS": addrs,
               "DGT_JOB_ID": str(config.job_id or random.SystemRandom().randrange(1, 2 ** 32))}
        for index, host in enumerate(server_hosts):
            env = dict(job, DGT_ROLE="server", DGT_SERVER_INDEX=str(index))
            if host is None:
                env["DGT_BIND_HOST"] = args.host
            spawn.start("server", index, [args.python, "-m", "dgt.server"], env, host)
        for rank, host in enumerate(spawn.hosts_of(args.workers)):
            spawn.start("worker", rank, command, dict(job, DGT_ROLE="worker", DGT_RANK=str(rank)),
                        host)
        return
    # MXNet's own parameter server (dist_sync and friends), for side-by-side comparisons.
    spawn = _Spawner(args, base, children)
    root = spawn.hosts_of(1)[0]
    job = {"DMLC_PS_ROOT_URI": spawn.address(root), "DMLC_PS_ROOT_PORT": str(spawn.first_port(1)),
           "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(args.workers)}

    def node(host: Optional[hostfile.Host]) -> Dict[str, str]:
        address = spawn.address(host)
        extra = {"DMLC_NODE_HOST": address}
        if address.startswith("127."):
            extra["DMLC_INTERFACE"] = "lo"
        return dict(job, **extra)

    start = [args.python, "-c", "import mxnet"]  # importing mxnet with DMLC_ROLE runs the role
    spawn.start("scheduler", 0, start, dict(node(root), DMLC_ROLE="scheduler"), root)
    time.sleep(1.0)  # ps-lite servers must not race the scheduler for its port
    for index, host in enumerate(spawn.hosts_of(args.servers)):
        spawn.start("server", index, start, dict(node(host), DMLC_ROLE="server"), host)
    for rank, host in enumerate(spawn.hosts_of(args.workers)):
        env = dict(node(host), DMLC_ROLE="worker", DGT_RANK=str(rank),
                   DGT_NUM_WORKERS=str(args.workers))
        spawn.start("worker", rank, command, env, host)


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
                where = f" on {child.host}" if child.host else ""
                hint = (" (ssh's code: the host could not be reached, or the connection broke)"
                        if child.host and code == 255 else "")
                _say(f"{child.name}{where} exited with code {code}{hint}; stopping the job")
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
        prog="dgt-launch",
        description="Start a dgt job (servers + workers), here or over ssh on several hosts.",
        epilog="Every DGT_* variable in the environment is forwarded to all processes (with "
               "--hostfile also DMLC_*, MXNET_*, PS_* and the --env names).")
    parser.add_argument("-n", "--workers", type=int, required=True, help="number of workers")
    parser.add_argument("-s", "--servers", type=int, default=1, help="number of servers (1)")
    parser.add_argument("--backend", choices=("dgt", "mxnet"), default="dgt",
                        help="dgt servers (default), or MXNet's own ps-lite scheduler and "
                             "servers for dist_sync baselines")
    parser.add_argument("--host", default=None,
                        help="address the servers listen on, without --hostfile (127.0.0.1)")
    parser.add_argument("--hostfile", default=None,
                        help="file of hosts, one [user@]host per line: start every process over "
                             "ssh on them, servers and workers round-robin in file order")
    parser.add_argument("--ssh", default=DEFAULT_SSH,
                        help=f"command that runs a command on a host (default: '{DEFAULT_SSH}')")
    parser.add_argument("--env", action="append", default=[], metavar="NAME",
                        help="with --hostfile: also forward this environment variable "
                             "(repeatable)")
    parser.add_argument("--workdir", default=os.getcwd(),
                        help="with --hostfile: directory the remote processes start in "
                             "(default: this one; every host needs the same paths)")
    parser.add_argument("--python", default=sys.executable,
                        help="Python that runs the servers (default: this one, %(default)s)")
    parser.add_argument("--port", type=int, default=0,
                        help="first server port (default: a free one; "
                             f"{DEFAULT_REMOTE_PORT} with --hostfile)")
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
    if not 0 <= args.port <= 65535 - args.servers:
        parser.error(f"--port={args.port} is out of range: allowed 0..{65535 - args.servers}")
    if args.hostfile and args.host:
        parser.error("--host and --hostfile exclude each other: with a hostfile every server "
                     "listens on its host's address")
    args.host = args.host or "127.0.0.1"
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
