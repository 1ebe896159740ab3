"""MXNet integration: real 2-worker jobs under dgt-launch, compared with MXNet's dist_sync."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mxnet")

from dgt.launch import free_port_block  # noqa: E402
from dgt.mxnet.fused import STALL_S  # noqa: E402

JOBS = Path(__file__).parent / "jobs"


FAKE_SSH = Path(__file__).parent.parent / "integration" / "fake_ssh.py"


def launch(job, out, kvstore, *extra, backend="dgt", env=None, hosts=None):
    """``hosts``: start every process over (a stand-in for) ssh on these loopback addresses."""
    on_hosts = []
    if hosts:
        hostfile = out / "hosts"
        hostfile.write_text("".join(f"{h}\n" for h in hosts))
        on_hosts = ["--hostfile", str(hostfile), "--ssh", f"{sys.executable} {FAKE_SSH}",
                    "--port", str(free_port_block("127.0.0.1", 2))]
    cmd = [sys.executable, "-m", "dgt.launch", "--timeout", "240", "--backend", backend, "-n", "2",
           *on_hosts, sys.executable, str(JOBS / job), "--kvstore", kvstore, "--out", str(out),
           *extra]
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr, [np.load(out / f"{kvstore}-{rank}.npy") for rank in range(2)]


def test_gluon_string_dgt_on_one_device_trains_identical_replicas(tmp_path):
    stdout, (w0, w1) = launch("gluon_job.py", tmp_path, "dgt", "--report-loss",
                              env={"DGT_THRESHOLD": "0.3", "DGT_UDP_DROP": "0.1",
                                   "DGT_BLOCK_ELEMS": "512"})
    assert "type dist_sync_dgt" in stdout  # the store was used, not silently dropped
    np.testing.assert_array_equal(w0, w1)


@pytest.mark.parametrize("extra,fusion", [((), True), ((), False),
                                          (("--update-on-kvstore", "0"), True),
                                          (("--devices", "2"), True)],
                         ids=["server-optimizer", "server-optimizer-unfused", "worker-update",
                              "two-devices"])
def test_gluon_dgt_all_reliable_equals_synchronous_sgd(tmp_path, extra, fusion):
    env = {"DGT_ENABLE": "0", "DGT_FUSION_ELEMS": str(1 << 18 if fusion else 0)}
    stdout, (d0, d1) = launch("gluon_job.py", tmp_path, "dgt", *extra, env=env)
    # The job's six tensors are small: after the first step they travel as one bucket.
    assert ("fused keys per step [0, 6, 6," in stdout) == fusion, stdout[-2000:]
    np.testing.assert_array_equal(d0, d1)
    np.testing.assert_allclose(d0, synchronous_sgd(tmp_path, *extra), rtol=1e-5, atol=1e-6)


def synchronous_sgd(out, *extra, workers=2):
    """The oracle: the same job in one process, each worker's batch on its own devices of a
    local kvstore, which sums the gradients as a synchronous parameter server does.

    Not MXNet's dist_sync itself: with worker-side updates it ended, in 2 runs of 8, in a
    different state (both replicas alike, the weights off by up to 4.7), so one run of it is no
    oracle.  The module test below compares with dist_sync with the optimizer on the server,
    which repeated to the bit (6 runs of 6)."""
    cmd = [sys.executable, str(JOBS / "gluon_job.py"), "--kvstore", "device", "--out", str(out),
           "--simulate-workers", str(workers), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return np.load(out / "device-0.npy")


def test_fusion_survives_a_step_that_pushes_fewer_keys(tmp_path):
    """Freezing the last layer removes the bucket's last members.  The job reads new weights
    before it calls the store again, so only the watchdog can send the round they leave open
    (member by member); fusion stops, and training matches synchronous SGD doing the same."""
    extra = ("--steps", "8", "--freeze-head-after", "4", "--read-weights")
    started = time.monotonic()
    stdout, (d0, d1) = launch("gluon_job.py", tmp_path, "dgt", *extra, env={"DGT_ENABLE": "0"})
    assert time.monotonic() - started >= STALL_S  # the watchdog, not a later call, sent it
    assert "fused keys per step [0, 6, 6, 6, 0, 0, 0, 0]" in stdout, stdout[-2000:]
    np.testing.assert_array_equal(d0, d1)
    np.testing.assert_allclose(d0, synchronous_sgd(tmp_path, *extra), rtol=1e-5, atol=1e-6)


def test_module_fit_string_dgt_equals_dist_sync_with_server_optimizer(tmp_path):
    stdout, (d0, d1) = launch("module_job.py", tmp_path, "dgt", env={"DGT_ENABLE": "0"})
    assert "update_on_kvstore True" in stdout
    _, (m0, _) = launch("module_job.py", tmp_path, "dist_sync", backend="mxnet")
    np.testing.assert_array_equal(d0, d1)
    np.testing.assert_allclose(d0, m0, rtol=1e-5, atol=1e-6)


def test_dist_sync_over_a_hostfile_equals_dist_sync_on_this_machine(tmp_path):
    """--backend mxnet --hostfile: the scheduler on the first host, every node announcing its
    own address (DMLC_NODE_HOST); MXNet's server-side optimizer repeats to the bit."""
    _, (local, _) = launch("module_job.py", tmp_path, "dist_sync", backend="mxnet")
    _, (w0, w1) = launch("module_job.py", tmp_path, "dist_sync", backend="mxnet",
                         hosts=["127.0.0.1", "127.0.0.2"])
    np.testing.assert_array_equal(w0, w1)
    np.testing.assert_array_equal(w0, local)


def test_module_fit_with_differential_transmission_keeps_replicas_identical(tmp_path):
    _, (d0, d1) = launch("module_job.py", tmp_path, "dgt",
                         env={"DGT_THRESHOLD": "0.3", "DGT_BLOCK_ELEMS": "256",
                              "DGT_UDP_DROP": "0.2"})
    np.testing.assert_array_equal(d0, d1)


def resume(tmp_path, env):
    """(straight 10 steps, resumed at step 5 from the states and parameters saved there,
    the other replica of the resumed run)."""
    _, (straight, _) = launch("gluon_job.py", tmp_path, "dgt", "--steps", "10", env=env)
    states = str(tmp_path / "ckpt")
    launch("gluon_job.py", tmp_path, "dgt", "--steps", "5", "--states", states, env=env)
    _, (resumed, other) = launch("gluon_job.py", tmp_path, "dgt", "--steps", "10",
                                 "--first-step", "5", "--states", states, env=env)
    return straight, resumed, other


def test_trainer_states_saved_from_the_servers_resume_training_exactly(tmp_path):
    """With float32 weights in the replies the parameters a worker saves are the servers'."""
    straight, resumed, other = resume(tmp_path, {"DGT_WEIGHTS_REPLY": "full"})
    np.testing.assert_array_equal(resumed, other)
    np.testing.assert_allclose(resumed, straight, rtol=1e-6, atol=1e-7)


def test_resume_with_delta_replies_loses_only_the_last_steps_rounding(tmp_path):
    """With bfloat16 deltas (the default) a worker holds the servers' weights up to one
    rounding of one step's change; a checkpoint taken from a worker leaves that remainder
    behind, so the resumed run starts a rounding away and ends close to the straight one,
    not equal to it (the replicas still agree to the bit)."""
    straight, resumed, other = resume(tmp_path, {})
    np.testing.assert_array_equal(resumed, other)
    relative = np.linalg.norm(resumed - straight) / np.linalg.norm(straight)
    # Measured: 1.9e-4 (5 steps after the resume), the same in every run; the 20-step
    # bfloat16 wire test below differs from its float32 oracle by 2.1e-3.
    assert 0 < relative < 2e-3, relative


@pytest.mark.parametrize("extra", [(), ("--update-on-kvstore", "0")],
                         ids=["server-optimizer", "worker-update"])
def test_bfloat16_wire_trains_like_synchronous_sgd_up_to_its_rounding(tmp_path, extra):
    """Gradients travel as bfloat16 (every block reliable, so the only difference from the
    oracle is the rounding).  The replicas stay identical; the weights come back as float32
    and differ from synchronous SGD by rounding-sized amounts only."""
    env = {"DGT_ENABLE": "0", "DGT_WIRE_DTYPE": "bfloat16"}
    _, (d0, d1) = launch("gluon_job.py", tmp_path, "dgt", *extra, env=env)
    np.testing.assert_array_equal(d0, d1)
    oracle = synchronous_sgd(tmp_path, *extra)
    assert d0.dtype == np.float32
    # Measured: 0.21 % (optimizer on the server, bfloat16 delta replies; 0.34 % with float32
    # weights, DGT_WEIGHTS_REPLY=full) and 0.67 % (on the workers) after 20 steps;
    # with DGT_WIRE_DTYPE=native the same job matches the oracle to the bit (the test above).
    # The exact arithmetic is checked against a numpy oracle in tests/integration.
    relative = np.linalg.norm(d0 - oracle) / np.linalg.norm(oracle)
    assert 0 < relative < 0.02, relative
