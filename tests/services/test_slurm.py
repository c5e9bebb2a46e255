"""``examples/cluster/slurm.sbatch`` submitted to a real Slurm: a one-node cluster on this
machine (munge, slurmctld and slurmd from Debian's ``slurm-wlm``, which CI installs), the
tiny model on CPU. The script starts Ray inside the allocation and runs ``areal-sdk train``
there; the test checks what a user would: the job succeeds and the run trained every step
once. Several nodes need several machines (slurmd runs once per host)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.services.conftest import small_ray_run
from tests.services.test_processes_run import _assert_trained_once

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "cluster" / "slurm.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")

pytestmark = pytest.mark.skipif(
    any(shutil.which(d) is None for d in DAEMONS) or os.geteuid() != 0,
    reason="needs Slurm (apt-get install slurm-wlm) and root to start slurmd",
)


def _config(state: Path, cpus: int) -> str:
    host = socket.gethostname()
    return f"""
ClusterName=arealtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmctldPort=16917
SlurmdPort=16918
AuthType=auth/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/d
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _munge_running() -> bool:
    probe = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster on this machine; yields the environment that reaches it."""
    state = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))
    for sub in ("ctld", "d"):
        (state / sub).mkdir()
    cpus = os.cpu_count() or 2
    conf = state / "slurm.conf"
    conf.write_text(_config(state, cpus))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if not _munge_running():
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["munged", "--force"], check=True, capture_output=True, timeout=30)
        assert _munge_running(), "munged did not start"
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, timeout=30)
    subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True, timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            shown = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
            )
            if shown.stdout.strip() == "idle":
                break
            assert time.monotonic() < deadline, (
                f"the Slurm node is not idle: {shown.stdout} {shown.stderr}\n"
                + (state / "slurmd.log").read_text()[-2000:]
            )
            time.sleep(1)
        yield {**env, "SLURM_CPUS": str(cpus)}
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=30, check=False)
        for daemon in ("slurmd", "slurmctld"):
            pid_file = state / f"{daemon}.pid"
            if pid_file.is_file():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
        time.sleep(2)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_sbatch_example_trains_on_a_slurm_allocation(run_config, slurm, tmp_path):
    # The user's run, at CPU size: the services fit the node's cores.
    config = small_ray_run(run_config)  # the script sets run.placement=ray
    out = config.parent / "job.out"
    # The example asks for 2 nodes with 16 cores and a GPU each: this cluster has one node.
    cpus = slurm["SLURM_CPUS"]
    env = {k: v for k, v in slurm.items() if not k.startswith(("RAY_", "SLURM_CPUS"))}
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short, for Ray's socket paths
    env["RAY_TMPDIR"] = ray_tmp
    try:
        job = subprocess.run(
            ["sbatch", "--wait", "--nodes=1", f"--cpus-per-task={cpus}", "--gpus-per-node=0",
             "--time=00:12:00", f"--output={out}", str(SBATCH), config.name],
            cwd=config.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
        )  # fmt: skip
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = out.read_text() if out.is_file() else ""
    assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{log[-6000:]}"
    _assert_trained_once(config.parent / "run", 2)
    assert "connecting to " in log and ":6379" in log, log[-3000:]
