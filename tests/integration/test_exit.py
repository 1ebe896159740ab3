"""What a worker still owes when its process exits goes out: a crash in the training script
ends the process instead of leaving it waiting on a dead I/O thread."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dgt.errors import PeerLost

from ..conftest import run_workers

AT_EXIT = textwrap.dedent("""
    import atexit
    import numpy as np
    import zmq
    from dgt.transport.links import ServerLinks

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    errors = []
    links = ServerLinks(context, [("127.0.0.1", port)], 3, on_message=lambda *a: None,
                        on_tick=lambda now: None, on_error=errors.append)

    def close_at_exit():  # as the MXNet kvstore closes: registered once it exists
        links.send(0, [np.full(100_000, 2.0, np.float32)])  # a zero-copy send
        got = router.recv_multipart() if router.poll(5000) else []
        links.close()
        print("at exit: frames", len(got), "errors", errors, flush=True)

    atexit.register(close_at_exit)
    links.send(0, [np.ones(100_000, np.float32)])  # training traffic before the crash
    assert router.poll(5000)
    router.recv_multipart()
    raise RuntimeError("the training script crashed")
""")


def test_a_send_at_exit_after_a_crash_still_leaves():
    proc = subprocess.run([sys.executable, "-c", AT_EXIT], capture_output=True, text=True,
                          timeout=60)
    assert "the training script crashed" in proc.stderr
    assert "at exit: frames 2 errors []" in proc.stdout, proc.stdout + proc.stderr


def test_a_push_after_the_io_thread_failed_raises_at_once(make_job):
    """_fail_all can empty the in-flight table between a call's usability check and its
    registration; the call must then fail, not wait for replies nobody will read."""
    config, _ = make_job(1, timeout_s=30.0)
    error = PeerLost("the I/O thread failed")

    def body(worker):
        worker.pushpull(0, np.ones(4096, np.float32)).wait()
        worker._check_usable = lambda: None  # the check passed just before the failure
        worker._fail_all(error)
        with pytest.raises(PeerLost):
            worker.pushpull(0, np.ones(4096, np.float32))
        return None

    run_workers(config, body, 1)
