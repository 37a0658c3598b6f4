"""Multi-controller runs, emulated on this machine: processes joined by ``jax.distributed``.

A process joins one run for its whole life, so each test starts real processes: the
emulation command (``python -m conformance --processes 2``), or processes joined by
hand where a test needs them to differ.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conformance.cli import launch
from conformance.core import distributed
from tests.faults.installed import FAULTY, install_faulty_family

REPO = Path(__file__).parents[1]
EMULATE = ("--processes", "2", "--devices-per-process", "4", "--timeout", "600")


def conformance(*args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m conformance args`` from the repository, with ``site`` importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (site, REPO) if p))
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "conformance", *args]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )


def joined(index: int, port: int, *args: str) -> subprocess.Popen:
    """Process ``index`` of 2, joined by hand to the run at ``port``."""
    command = [sys.executable, "-m", "conformance", "--family", "gpt3", "--tier", "smoke", *args]
    command += [f"--coordinator=localhost:{port}", "--num-processes=2", f"--process-id={index}"]
    env = launch.process_env(4)
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_a_planted_fault_fails_on_every_process_at_its_leaf(tmp_path):
    site, logs = tmp_path / "site", tmp_path / "logs"
    site.mkdir()
    install_faulty_family(site)
    args = ("--family", FAULTY, "--tier", "smoke", "-k", "test_forward", "--logs", str(logs))
    run = conformance(*EMULATE, *args, site=site)
    assert run.returncode == 1, run.stdout[-5000:] + run.stderr[-3000:]
    assert "process 0: exit 1" in run.stdout
    assert "process 1: exit 1" in run.stdout
    for index in (0, 1):
        log = (logs / f"process-{index}.log").read_text()
        assert f"{FAULTY} forward:" in log, log[-3000:]
        assert "hidden_states[0]" in log, log[-3000:]
    assert "agreement matrix: in process 0's output" in (logs / "process-1.log").read_text()


def test_checkpoints_saved_by_two_processes_restore_byte_exact_and_reshard(tmp_path):
    meshes = ("--mesh", "data=2,fsdp=2,tensor=2", "--mesh", "fsdp=8")
    args = ("--family", "gpt3", "--tier", "smoke", *meshes, "-k", "checkpoint_roundtrip")
    run = conformance(*EMULATE, *args, "--logs", str(tmp_path))
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    assert "4 passed" in run.stdout, "linen and nnx, restored on the saving mesh and on fsdp=8"
    states = sorted((tmp_path / "shared").glob("*fsdp8*/checkpoint/state"))
    assert states, "the resharded round trips saved into the shared directory"
    for state in states:
        assert {p.name for p in state.glob("ocdbt.process_*")} == {
            "ocdbt.process_0",
            "ocdbt.process_1",
        }, "each process wrote its own shards"


def test_an_unreachable_coordinator_fails_fast_naming_the_process():
    port = launch.free_port()
    started = time.monotonic()
    run = conformance(
        "--family",
        "gpt3",
        "--tier",
        "smoke",
        f"--coordinator=localhost:{port}",
        "--num-processes=2",
        "--process-id=1",
        "--connect-timeout=2",
    )
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]
    assert time.monotonic() - started < 60
    message = run.stderr + run.stdout
    assert f"process 1 of 2 (coordinator localhost:{port})" in message
    assert f"cannot reach the coordinator at localhost:{port} within 2 s" in message


def test_processes_with_different_tests_stop_naming_the_difference():
    port = launch.free_port()
    procs = [
        joined(0, port, "-k", "test_forward"),
        joined(1, port, "-k", "test_forward or (init and not vs)"),
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [4, 4], outputs
    for output in outputs:
        assert "collected different tests" in output, output[-3000:]
        only = r"process 1 has \d+, process 0 has \d+: 1 only on process 1 \(first: "
        assert re.search(only, output), output[-3000:]
        assert "test_init.py::test_init[gpt3-" in output


def test_the_launcher_stops_the_others_when_one_fails(monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    try:
        status, why = launch.watch([sleeper, failing], timeout_s=60)
    finally:
        launch.stop([sleeper, failing])
    assert status == 3
    assert why == "process 1 failed (exit 3); stopped process(es) 0"
    assert time.monotonic() - started < 30
    assert sleeper.returncode is not None


def test_the_launcher_stops_every_process_at_its_timeout():
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])]
    try:
        status, why = launch.watch(sleepers, timeout_s=0.5)
    finally:
        launch.stop(sleepers)
    assert status == launch.TIMED_OUT
    assert why == "the run outlived its 0.5 s timeout; stopped process(es) 0"


SLEEPERS = """
import sys
from pathlib import Path
from conformance.cli import launch

pids = Path(sys.argv[1])
sleep = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
launch.commands = lambda emulation, args, port: [
    [sys.executable, "-c", sleep, str(pids / f"{i}.pid")] for i in range(2)
]
sys.exit(launch.run(launch.Emulation(2, 1, 120.0, pids / "logs"), []))
"""


def test_the_launcher_stops_every_process_when_it_is_terminated(tmp_path):
    """A CI runner cancelling the job sends SIGTERM: no emulated process outlives it."""
    launcher = subprocess.Popen([sys.executable, "-c", SLEEPERS, str(tmp_path)], cwd=REPO)
    deadline = time.monotonic() + 60
    files = [tmp_path / f"{i}.pid" for i in range(2)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline
        assert launcher.poll() is None
        time.sleep(0.1)
    launcher.terminate()
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in (int(f.read_text()) for f in files):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_each_emulated_process_gets_its_own_device_count():
    flags = "--xla_dump_to=x --xla_force_host_platform_device_count=8"
    env = launch.process_env(4, {"XLA_FLAGS": flags})
    assert env["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize("bad", ["--processes=0", "--devices-per-process=0"])
def test_a_nonsense_emulation_is_a_usage_error(bad):
    run = conformance(bad, "--family", "gpt3")
    assert run.returncode == 4
    assert "must be at least 1" in run.stderr


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        (distributed.Cluster("localhost:1"), "without both the number of processes"),
        (distributed.Cluster("localhost:1", 2, 2), "process id 2 is not in 0..1"),
        (distributed.Cluster("localhost", 2, 1, timeout_s=1), "'localhost' is not host:port"),
    ],
)
def test_a_malformed_cluster_is_refused_before_jax_starts(cluster, message):
    with pytest.raises(distributed.DistributedError, match=message):
        distributed.initialize(cluster)


def test_with_one_process_the_collectives_are_local():
    array = jax.numpy.arange(6.0).reshape(2, 3)
    assert isinstance(distributed.host_array(array), np.ndarray)
    np.testing.assert_array_equal(distributed.host_array(array), np.arange(6.0).reshape(2, 3))
    assert distributed.gather_ints([3, 4]) == [(3, 4)]
    assert distributed.gather_text("a\nb") == ["a\nb"]
    assert distributed.differences(["t1", "t2"]) == ""
    assert distributed.is_leader()
    assert not distributed.is_multiprocess()


def test_distributed_where_jax_detects_no_cluster_is_a_usage_error():
    run = conformance("--distributed", "--family", "gpt3", "--tier", "smoke")
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]
    assert "this process (cluster detected by JAX) cannot join the run" in run.stderr
