"""Multi-host jobs for ``dgt-launch --hostfile``: the hostfile, who runs where, and the command
line that starts one process on another host over ssh.

Pure: nothing here opens a connection or starts a process (``dgt.launch`` does).

A hostfile names one host per line, as ssh reaches it (``[user@]host``); blank lines and
``#`` comments are skipped.  Servers and workers are placed round-robin in file order: server i
on host ``i mod H``, worker r on host ``r mod H``, so ``-n H -s H`` puts one server next to each
worker (the deployment where every link carries one model per direction, like a ring
allreduce).  The host part of each line (without ``user@``) is also the address the others use
to reach it, so it must resolve on every host.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Dict, List, Sequence

from .errors import ConfigError

__all__ = ["Host", "read_hostfile", "parse_hosts", "place", "forwarded_env", "remote_command",
           "FORWARDED_PREFIXES"]

# What a remote process gets from the launcher's environment besides what the launcher sets:
# dgt's own settings, MXNet's and ps-lite's (a dist_sync baseline must see the same knobs).
FORWARDED_PREFIXES = ("DGT_", "DMLC_", "MXNET_", "PS_")

# [user@]host, where host is a DNS name or an IPv4 address; nothing a shell would interpret.
_HOST_LINE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9._-]+)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Runs the command on the remote host and ends it when the launcher goes away.  sshd keeps the
# command's stdin open for as long as the connection lives (the launcher never writes to it),
# so EOF on stdin means the launcher or its ssh is gone: the command then gets SIGTERM.
# Without this, killing the local ssh leaves the remote process running.  fd 3 carries stdin
# to the watcher because sh gives background jobs /dev/null as stdin.
_WATCHED = ('exec 3<&0; "$@" </dev/null & child=$!; '
            '{ cat <&3 >/dev/null 2>&1; kill -TERM "$child" 2>/dev/null; } >/dev/null 2>&1 & '
            'watcher=$!; wait "$child"; code=$?; kill "$watcher" 2>/dev/null; exit "$code"')


@dataclass(frozen=True)
class Host:
    target: str  # what ssh is given: [user@]host
    address: str  # how the other processes reach it: host


def parse_hosts(text: str, source: str = "hostfile") -> List[Host]:
    """Hosts of a hostfile's ``text``; raises ConfigError naming the first bad line."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            raise ConfigError(f"{source} line {number}: {line!r} is not a host; expected "
                              "one [user@]host per line (a name or an IPv4 address)")
        hosts.append(Host(line, match.group("host")))
    if not hosts:
        raise ConfigError(f"{source} names no host")
    return hosts


def read_hostfile(path: str) -> List[Host]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path!r} cannot be read: {exc.strerror}") from exc
    return parse_hosts(text, f"--hostfile {path}")


def place(hosts: Sequence[Host], count: int) -> List[Host]:
    """The host of each of ``count`` processes of one role: round-robin in file order."""
    return [hosts[i % len(hosts)] for i in range(count)]


def forwarded_env(env: Dict[str, str], extra_names: Sequence[str] = ()) -> Dict[str, str]:
    """The part of the launcher's environment a remote process gets: every variable with a
    :data:`FORWARDED_PREFIXES` prefix and the ``extra_names`` (``--env NAME``) that are set."""
    for name in extra_names:
        if not _ENV_NAME.match(name):
            raise ConfigError(f"--env {name!r} is not a variable name")
    return {k: v for k, v in env.items()
            if k.startswith(FORWARDED_PREFIXES) or k in extra_names}


def remote_command(argv: Sequence[str], env: Dict[str, str], workdir: str) -> str:
    """The one string ssh hands to the remote shell: change to ``workdir``, set ``env``, run
    ``argv`` watched (see :data:`_WATCHED`).  Every piece is quoted, so values and arguments
    reach the process byte for byte whatever they contain."""
    for name in env:
        if not _ENV_NAME.match(name):
            raise ConfigError(f"environment variable name {name!r} cannot be forwarded")
    assignments = [shlex.quote(f"{k}={v}") for k, v in sorted(env.items())]
    return " ".join(["cd", shlex.quote(workdir), "&&", "exec", "env", *assignments,
                     "sh", "-c", shlex.quote(_WATCHED), "dgt-remote",
                     *(shlex.quote(a) for a in argv)])
