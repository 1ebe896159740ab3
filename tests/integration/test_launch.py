"""dgt-launch end to end, with plain-Python workers (no mxnet)."""
import os
import subprocess
import sys
import time


WORKER = """
import sys, numpy as np
from dgt.config import Config
from dgt.worker import Worker
config = Config.from_env()
with Worker(config) as worker:
    out = worker.pushpull(0, np.full(5000, worker.rank + 1, np.float32)).wait()
    print("rank", worker.rank, "of", config.num_workers, "sum", int(out[0]))
"""


def launch(*args, env=None, timeout=120):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dgt.launch", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def test_launch_runs_servers_and_workers_and_prefixes_lines():
    proc = launch("-n", "3", "-s", "2", sys.executable, "-c", WORKER,
                  env={"DGT_BIGARRAY_ELEMS": "1024", "DGT_THRESHOLD": "0.5"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(3):
        assert f"[worker {rank}] rank {rank} of 3 sum 6" in proc.stdout
    assert "[server 1]" in proc.stdout


def test_launch_stops_everything_on_the_first_failure_and_returns_its_code():
    script = "import os, sys, time\n" \
             "if os.environ['DGT_RANK'] == '1': sys.exit(3)\n" \
             "time.sleep(120)\n"
    start = time.monotonic()
    proc = launch("-n", "2", sys.executable, "-c", script)
    assert proc.returncode == 3
    assert time.monotonic() - start < 30
    assert "worker 1 exited with code 3" in proc.stdout


def test_launch_rejects_bad_settings_before_starting():
    proc = launch("-n", "2", sys.executable, "-c", "pass", env={"DGT_UDP_CHANNELS": "9"})
    assert proc.returncode == 2
    assert "DGT_UDP_CHANNELS=9 is out of range: allowed 1..7" in proc.stdout
    assert "[worker" not in proc.stdout


def processes_of_job(job_id):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"DGT_JOB_ID={job_id}".encode() in f.read().split(b"\0"):
                    found.append(pid)
        except (OSError, ValueError):
            continue
    return found


def test_launch_reports_a_missing_command_and_leaves_no_server_behind():
    proc = launch("-n", "1", "no-such-command-dgt", env={"DGT_JOB_ID": "987001"})
    assert proc.returncode == 127 and "cannot start the command" in proc.stdout
    time.sleep(0.5)
    assert processes_of_job(987001) == []


def test_a_killed_launcher_stops_its_job():
    full_env = dict(os.environ, DGT_JOB_ID="987002")
    launcher = subprocess.Popen([sys.executable, "-m", "dgt.launch", "-n", "2", sys.executable,
                                 "-c", "import time; time.sleep(120)"], env=full_env,
                                stdout=subprocess.DEVNULL)
    time.sleep(3)
    assert len(processes_of_job(987002)) >= 4  # launcher, server, 2 workers
    launcher.terminate()
    launcher.wait(timeout=30)
    time.sleep(0.5)
    assert processes_of_job(987002) == []


def test_a_server_nobody_joins_gives_up_after_the_timeout():
    env = dict(os.environ, DGT_ROLE="server", DGT_TIMEOUT_S="1", DGT_SERVER_ADDRS="127.0.0.1:0")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dgt.server"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 1 and "no worker connected" in proc.stderr
    assert time.monotonic() - start < 20


def test_launch_timeout_stops_a_hung_job():
    proc = launch("--timeout", "3", "-n", "1", sys.executable, "-c", "import time; time.sleep(60)")
    assert proc.returncode == 124


def test_server_module_fails_clearly_on_bad_environment():
    env = dict(os.environ, DGT_ROLE="server", DGT_GRACE_MS="-1")
    proc = subprocess.run([sys.executable, "-m", "dgt.server"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2
    assert "DGT_GRACE_MS=-1.0 is out of range" in proc.stderr
