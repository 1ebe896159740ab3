"""Horovod's Gloo rendezvous for a job whose ranks run in separate network namespaces.

    python benchmarks/horovod_rendezvous.py PORT WORKERS

``horovodrun --gloo`` starts this server itself and its ranks over ssh; on the testbed
(``benchmarks/compare.py``) each rank runs in its own namespace instead, with the variables
horovodrun would set, host ``worker<rank>`` with one slot each.  Runs until SIGTERM.
"""
import signal
import sys
import threading


def main() -> int:
    port, workers = int(sys.argv[1]), int(sys.argv[2])
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(",".join(f"worker{r}:1" for r in range(workers))),
                                workers)
    server = RendezvousServer(verbose=0)
    server.start(port=port)
    server.init(plan)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
