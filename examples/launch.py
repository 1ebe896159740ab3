"""Start an example under the right parameter server, picked from its ``--kvstore`` flag.

    python examples/launch.py -n 2 -- python examples/train_alexnet.py --kvstore dgt
    python examples/launch.py -n 2 -- python examples/train_alexnet.py --kvstore dist_sync_p3

``dgt`` runs dgt's servers; ``dist_sync``, ``dist_sync_2bit`` and ``dist_sync_p3`` run MXNet's
own scheduler and servers (``dist_sync_p3`` with ``DMLC_PS_VAN_TYPE=p3``); ``horovod`` runs
``horovodrun --gloo`` on this machine (``-n`` workers); ``local`` runs one process.  Everything
else is ``dgt-launch``'s (``-s``, ``--timeout``, ...).
"""
import os
import sys

from dgt.launch import main as launch


def split(argv):
    if "--" not in argv:
        sys.exit("usage: python examples/launch.py [dgt-launch options] -- COMMAND ...")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def kvstore_of(command):
    for flag, value in zip(command, command[1:]):
        if flag == "--kvstore":
            return value
    for item in command:
        if item.startswith("--kvstore="):
            return item.split("=", 1)[1]
    return "dgt"


def main(argv=None) -> int:
    options, command = split(sys.argv[1:] if argv is None else argv)
    kvstore = kvstore_of(command)
    if kvstore == "local":
        os.execvp(command[0], command)
    if kvstore.startswith("horovod"):
        workers = "2"
        for flag, value in zip(options, options[1:]):
            if flag in ("-n", "--workers"):
                workers = value
        runner = [sys.executable, "-m", "horovod.runner.launch", "--gloo", "-np", workers,
                  "-H", f"localhost:{workers}", "--network-interface", "lo", *command]
        os.execvp(runner[0], runner)
    if kvstore.startswith("dist_sync"):
        if kvstore == "dist_sync_p3":
            os.environ["DMLC_PS_VAN_TYPE"] = "p3"
        options = ["--backend", "mxnet", *options]
    return launch([*options, *command])


if __name__ == "__main__":
    sys.exit(main())
