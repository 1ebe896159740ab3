"""A stand-in for ``ssh HOST COMMAND`` in the launcher's tests: runs COMMAND the way sshd does.

Like sshd, it starts ``sh -c COMMAND`` in a session of its own (killing this process does not
reach it), with a login environment, not the caller's (only PATH, HOME, and
``FAKE_SSH_HOST=<host>`` so that a test can see where a process ran), and with this process's
stdin, which stays open until the caller goes away.  ``FAKE_SSH_NETNS="host=netns,..."`` runs
the command inside that host's network namespace (the testbed's nodes).  ssh's options
(``-o X``, ``-p N``, flags) are skipped.  Exit code: the command's; 255 for an unknown host
(``FAKE_SSH_DOWN`` lists hosts that are unreachable), as ssh does.
"""
import os
import subprocess
import sys


def main(argv):
    args = list(argv)
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if option in ("-o", "-p", "-i", "-l") and args:
            args.pop(0)
    if len(args) < 2:
        sys.stderr.write("fake_ssh: usage: fake_ssh [options] host command\n")
        return 255
    target, command = args[0], " ".join(args[1:])
    host = target.rpartition("@")[2]
    if host in os.environ.get("FAKE_SSH_DOWN", "").split(","):
        sys.stderr.write(f"ssh: connect to host {host} port 22: Connection refused\n")
        return 255
    namespaces = dict(item.split("=", 1)
                      for item in os.environ.get("FAKE_SSH_NETNS", "").split(",") if item)
    prefix = ["ip", "netns", "exec", namespaces[host]] if host in namespaces else []
    login_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                 "HOME": os.environ.get("HOME", "/"), "FAKE_SSH_HOST": host}
    remote = subprocess.Popen([*prefix, "sh", "-c", command], env=login_env,
                              start_new_session=True)
    return remote.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
