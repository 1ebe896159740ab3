"""Shared fixtures: a dgt server in a thread, worker factories, bounded timeouts."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dgt.config import Config


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


class ServerThread:
    """A dgt Server running in a daemon thread on a free localhost port."""

    def __init__(self, config: Config):
        from dgt.server import Server

        self.server = Server(config.replace(role="server", bind_host="127.0.0.1"))
        self.port = self.server.port
        self.exit_code = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.exit_code = self.server.run()

    def stop(self):
        self.server.stop()
        self.thread.join(timeout=10)


@pytest.fixture
def make_job():
    """make_job(num_workers, **config) -> (worker_config, [servers]); stops servers at teardown.
    The wire dtype is native unless ``config`` names one."""
    started = []

    def factory(num_workers: int, num_servers: int = 1, **settings):
        settings.setdefault("timeout_s", 30.0)
        # The socket tests' oracles are exact float32 sums; the tests of the bfloat16 wire and
        # of the defaults ask for their dtype by name.
        settings.setdefault("wire_dtype", "native")
        base = Config(num_workers=num_workers, num_servers=num_servers, job_id=4242,
                      server_addrs=",".join(["127.0.0.1:0"] * num_servers), **settings)
        servers = []
        for index in range(num_servers):
            servers.append(ServerThread(base.replace(server_index=index)))
        started.extend(servers)
        addrs = ",".join(f"127.0.0.1:{s.port}" for s in servers)
        return base.replace(server_addrs=addrs), servers

    yield factory
    for server in started:
        server.stop()


def run_workers(config: Config, body, num_workers: int):
    """Run body(worker) for every rank in its own thread; return the results by rank."""
    from dgt.worker import Worker

    results, errors = {}, []

    def target(rank):
        try:
            with Worker(config.replace(rank=rank)) as worker:
                results[rank] = body(worker)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    assert len(results) == num_workers, "a worker thread did not finish"
    return results
