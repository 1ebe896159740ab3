"""dgt.hosts: hostfile parsing, placement, and the remote command line (run through a real sh)."""
import json
import os
import subprocess
import sys
import time

import pytest

from dgt.errors import ConfigError
from dgt.hosts import Host, forwarded_env, parse_hosts, place, remote_command


def test_hostfile_lines_comments_and_users():
    hosts = parse_hosts("# the cluster\nnode1\n\n  alice@10.0.0.2   # second\nnode-3.example\n")
    assert hosts == [Host("node1", "node1"), Host("alice@10.0.0.2", "10.0.0.2"),
                     Host("node-3.example", "node-3.example")]


@pytest.mark.parametrize("text, line", [("node1\nnode 2\n", 2), ("a;rm -rf /\n", 1),
                                        ("ok\n\n$(boom)\n", 3), ("x@@y\n", 1)])
def test_a_bad_hostfile_line_is_named(text, line):
    with pytest.raises(ConfigError, match=f"line {line}: .* is not a host"):
        parse_hosts(text)


def test_an_empty_hostfile_is_refused():
    with pytest.raises(ConfigError, match="names no host"):
        parse_hosts("# nothing\n\n")


def test_processes_go_round_robin_in_file_order():
    a, b, c = (Host(n, n) for n in "abc")
    assert place([a, b, c], 5) == [a, b, c, a, b]
    assert place([a], 2) == [a, a]
    assert place([a, b], 0) == []


def test_forwarded_environment_is_dgt_mxnet_pslite_and_the_named_ones():
    env = {"DGT_THRESHOLD": "0.5", "DMLC_INTERFACE": "eth0", "MXNET_ENGINE_TYPE": "x",
           "PS_VERBOSE": "1", "HOME": "/root", "PYTHONPATH": "/src", "SECRET": "s"}
    assert forwarded_env(env, ["PYTHONPATH", "UNSET"]) == {
        "DGT_THRESHOLD": "0.5", "DMLC_INTERFACE": "eth0", "MXNET_ENGINE_TYPE": "x",
        "PS_VERBOSE": "1", "PYTHONPATH": "/src"}
    with pytest.raises(ConfigError, match="not a variable name"):
        forwarded_env(env, ["BAD-NAME"])


REPORT = ("import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
          "'env': {k: v for k, v in os.environ.items() if k.startswith('T_')}}))")


def run_remote(command):
    """What sshd does with the string: hand it to the login shell, with a stdin that stays
    open while the connection lives."""
    return subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={"PATH": os.environ["PATH"]})


def finish(proc, timeout_s=30):
    """Wait for the command to exit on its own, the connection still open."""
    proc.wait(timeout=timeout_s)
    out = proc.stdout.read()
    proc.stdin.close()
    return out


def test_the_remote_command_delivers_arguments_environment_and_directory_byte_for_byte(tmp_path):
    odd = ["plain", "two words", "it's", '"dq"', "$HOME", "`id`", "a;b|c&d", "*", "", "ü"]
    env = {"T_QUOTE": "x'y\"z", "T_SPACE": "a b", "T_DOLLAR": "$PATH", "T_EMPTY": "",
           "T_NEWLINE": "one\ntwo"}
    workdir = tmp_path / "dir with 'quote'"
    workdir.mkdir()
    proc = run_remote(remote_command([sys.executable, "-c", REPORT, *odd], env, str(workdir)))
    out = finish(proc)
    assert proc.returncode == 0
    report = json.loads(out)
    assert report == {"argv": odd, "cwd": str(workdir), "env": env}


def test_the_remote_command_keeps_the_exit_code():
    proc = run_remote(remote_command([sys.executable, "-c", "import sys; sys.exit(7)"], {}, "/"))
    finish(proc)
    assert proc.returncode == 7


def test_closing_stdin_ends_the_remote_process():
    """The connection going away (stdin EOF) stops the command, as killing ssh must."""
    proc = run_remote(remote_command([sys.executable, "-c", "import time; time.sleep(120)"],
                                     {}, "/"))
    time.sleep(1.0)
    assert proc.poll() is None  # an open stdin keeps it running
    start = time.monotonic()
    proc.stdin.close()
    proc.wait(timeout=30)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + 15  # SIGTERM


def test_environment_names_that_a_shell_cannot_take_are_refused():
    with pytest.raises(ConfigError, match="cannot be forwarded"):
        remote_command(["true"], {"A-B": "1"}, "/")
