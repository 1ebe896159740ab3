"""dgt-launch end to end, with plain-Python workers (no mxnet)."""
import os
import subprocess
import sys
import time

from dgt.launch import free_port_block


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


# --- several hosts: --hostfile over ssh (tests/integration/fake_ssh.py plays ssh and sshd) ---
FAKE_SSH = " ".join([sys.executable,
                     os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_ssh.py")])

REMOTE_WORKER = WORKER + """
import os
print("rank", worker.rank, "ran on", os.environ["FAKE_SSH_HOST"], "threshold",
      os.environ["DGT_THRESHOLD"], "extra", os.environ.get("EXTRA_SETTING"),
      "unforwarded", os.environ.get("NOT_FORWARDED"))
"""


def launch_on_hosts(tmp_path, hostfile_text, *args, env=None, timeout=120):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hostfile_text)
    port = free_port_block("127.0.0.1", 2)  # servers 0 and 1 listen on port and port + 1
    return launch("--hostfile", str(hostfile), "--ssh", FAKE_SSH, "--port", str(port),
                  *args, env=env, timeout=timeout)


def test_hostfile_job_runs_every_process_over_ssh_round_robin(tmp_path):
    """Two "hosts" (127.0.0.1 and 127.0.0.2, both loopback); the fake sshd starts each process
    with a login environment, so everything the job needs must come through the launcher."""
    env = {"DGT_BIGARRAY_ELEMS": "1024", "DGT_THRESHOLD": "0.5", "EXTRA_SETTING": "yes",
           "NOT_FORWARDED": "leak"}
    proc = launch_on_hosts(tmp_path, "# two hosts\n127.0.0.1\nme@127.0.0.2\n",
                           "-n", "3", "-s", "2", "--env", "EXTRA_SETTING", "--env", "PATH",
                           sys.executable, "-c", REMOTE_WORKER, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank, host in enumerate(["127.0.0.1", "127.0.0.2", "127.0.0.1"]):
        assert f"[worker {rank}] rank {rank} of 3 sum 6" in proc.stdout
        assert (f"[worker {rank}] rank {rank} ran on {host} threshold 0.5 extra yes "
                "unforwarded None") in proc.stdout
    assert "[server 1]" in proc.stdout


def test_a_remote_failure_stops_every_remote_process_and_returns_its_code(tmp_path):
    script = "import os, sys, time\n" \
             "if os.environ['DGT_RANK'] == '1': sys.exit(3)\n" \
             "time.sleep(120)\n"
    start = time.monotonic()
    proc = launch_on_hosts(tmp_path, "127.0.0.1\n127.0.0.2\n", "-n", "2", sys.executable, "-c",
                           script, env={"DGT_JOB_ID": "987003"})
    assert proc.returncode == 3, proc.stdout
    assert "worker 1 on 127.0.0.2 exited with code 3" in proc.stdout
    assert time.monotonic() - start < 30
    # The fake sshd's processes live in sessions of their own, as on a real host: only the
    # closed connection (stdin) can have ended them.
    time.sleep(1.0)
    assert processes_of_job(987003) == []


def test_an_unreachable_host_is_named_and_stops_the_job(tmp_path):
    proc = launch_on_hosts(tmp_path, "127.0.0.1\n127.0.0.2\n", "-n", "2", sys.executable, "-c",
                           "import time; time.sleep(120)",
                           env={"FAKE_SSH_DOWN": "127.0.0.2", "DGT_JOB_ID": "987004"})
    assert proc.returncode == 255
    assert "on 127.0.0.2 exited with code 255 (ssh's code: the host could not be reached" \
        in proc.stdout
    time.sleep(1.0)
    assert processes_of_job(987004) == []


def test_a_killed_launcher_stops_its_remote_processes(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n127.0.0.2\n")
    env = dict(os.environ, DGT_JOB_ID="987005")
    launcher = subprocess.Popen([sys.executable, "-m", "dgt.launch", "--hostfile", str(hostfile),
                                 "--ssh", FAKE_SSH, "-n", "2", sys.executable, "-c",
                                 "import time; time.sleep(120)"], env=env,
                                stdout=subprocess.DEVNULL)
    time.sleep(3)
    assert len(processes_of_job(987005)) >= 4  # launcher, server, 2 workers (+ their shells)
    launcher.terminate()
    launcher.wait(timeout=30)
    time.sleep(1.0)
    assert processes_of_job(987005) == []


def test_a_bad_hostfile_fails_before_anything_starts(tmp_path):
    proc = launch_on_hosts(tmp_path, "node1\nnode two\n", "-n", "1", sys.executable, "-c", "pass")
    assert proc.returncode == 2
    assert "line 2: 'node two' is not a host" in proc.stdout
    assert "[worker" not in proc.stdout and "[server" not in proc.stdout
    proc = launch("--hostfile", str(tmp_path / "missing"), "-n", "1", "true")
    assert proc.returncode == 2 and "cannot be read" in proc.stdout
    proc = launch("--hostfile", str(tmp_path / "hosts"), "--host", "10.0.0.1", "-n", "1", "true")
    assert proc.returncode == 2 and "exclude each other" in proc.stderr
