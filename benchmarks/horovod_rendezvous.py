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
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    plan = get_host_assignments(parse_hosts(",".join(f"worker{r}:1" for r in range(workers))),
                                workers)
    # horovodrun's RendezvousServer picks a free port itself; the ranks here must be told the
    # port before this process could report it, so the HTTP server is built on a given one.
    server = RendezvousHTTPServer(("", port), RendezvousHandler, 0)
    server.init(plan)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
