"""A one-node SLURM cluster on 127.0.0.1 in a temporary folder, for rehearsing the SLURM launcher for real.

`LocalCluster(work).start()` writes a munge key and a ``slurm.conf`` for this machine's cores and memory
(``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, ``SelectType=select/cons_tres``, one
partition ``debug`` whose CPUs up to 4 jobs share), starts munged, slurmctld and slurmd as the current user, each bound
to 127.0.0.1 only (``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``), on ports found free, and waits for the node
to be idle; `stop()` ends exactly the daemons it started, by their PIDs. Every file stays under ``work``; the SLURM
commands find the cluster through ``env()`` (``SLURM_CONF`` and the munge socket).

`ensure_installed()` installs Debian's ``slurm-wlm`` and ``munge`` with apt-get when they are missing (root
only). Anything that keeps the cluster from starting raises `ClusterUnavailable` with the reason, so a caller
can skip rather than fail.
"""

from __future__ import annotations

import argparse
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")
PARTITION = "debug"
NODE = "localhost"


class ClusterUnavailable(RuntimeError):
    """The local cluster cannot be installed or started here (the message says why)."""


def _sbin(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


def missing_programs() -> list[str]:
    """The SLURM and munge programs this machine lacks.

    Returns:
        Their names."""
    return [n for n in (*DAEMONS, "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel") if not _sbin(n)]


def ensure_installed(log=print) -> None:
    """apt-get install slurm-wlm munge when a program of theirs is missing.

    Args:
        log: where progress lines go.

    Raises:
        ClusterUnavailable: they are missing and cannot be installed."""
    missing = missing_programs()
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"{', '.join(missing)} not installed and not root to apt-get install "
                                 f"{' '.join(PACKAGES)}")
    if not shutil.which("apt-get"):
        raise ClusterUnavailable(f"{', '.join(missing)} not installed and no apt-get to install {' '.join(PACKAGES)}")
    log(f"installing {' '.join(PACKAGES)} with apt-get (missing: {', '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if out.returncode:
            raise ClusterUnavailable(f"{' '.join(cmd)} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    still = missing_programs()
    if still:
        raise ClusterUnavailable(f"after installing {' '.join(PACKAGES)}, still missing: {', '.join(still)}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking.

    Returns:
        The port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_resources() -> tuple[int, int]:
    """What this machine gives the node: every core, 90 % of the memory.

    Returns:
        ``(CPUs, MB of memory)``."""
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    return os.cpu_count() or 1, max(mem_kb * 9 // 10 // 1024, 256)


def slurm_conf(work: Path, user: str, ports: tuple[int, int], cpus: int, mem_mb: int) -> str:
    """The one-node configuration (a pure function of its arguments).

    Args:
        work: the cluster's folder.
        user: the user the daemons run as.
        ports: (slurmctld port, slurmd port).
        cpus: the node's CPUs.
        mem_mb: the node's memory in MB.

    Returns:
        The text of slurm.conf."""
    ctl, slurmd = ports
    return "\n".join([
        "ClusterName=hif8rehearse",
        f"SlurmctldHost={NODE}(127.0.0.1)",
        f"SlurmctldPort={ctl}",
        f"SlurmdPort={slurmd}",
        # bind every listening socket to the address the host resolves to (127.0.0.1), not to all interfaces
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        "MailProg=/bin/true",
        f"SrunPortRange={ports[1] + 1}-{ports[1] + 200}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        # cred_expire also holds a requeued job back (default 120 s + 1): 30 s is enough to launch a step here
        f"AuthInfo=socket={work / 'munge' / 'munge.socket'},cred_expire=30",
        "CredType=cred/munge",
        f"StateSaveLocation={work / 'state'}",
        f"SlurmdSpoolDir={work / 'spool'}",
        f"SlurmctldPidFile={work / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={work / 'run' / 'slurmd.pid'}",
        f"SlurmctldLogFile={work / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={work / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        # SLURM's default: the SIGTERM of a requeue or cancel leaves a job this long to checkpoint its step
        # before SIGKILL (a 2-core machine running five jobs at once can need more than a few seconds)
        "KillWait=30",
        "MinJobAge=600",
        f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN",
        # up to 4 jobs share a CPU: a job paused or waiting on a requeue holds no core back from the others
        f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        "",
    ])


class LocalCluster:
    def __init__(self, work: Path, log=print):
        self.work, self.log = Path(work), log
        self.pids: dict[str, int] = {}

    def env(self) -> dict[str, str]:
        """Variables the SLURM commands need to find this cluster (added to os.environ by start()).

        Returns:
            ``{SLURM_CONF: path}``."""
        return {"SLURM_CONF": str(self.work / "slurm.conf")}

    def _munge(self) -> None:
        d = self.work / "munge"
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        out = subprocess.run([_sbin("munged"), "--force", f"--socket={d / 'munge.socket'}", f"--key-file={key}",
                              f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                              f"--seed-file={d / 'munged.seed'}"], capture_output=True, text=True, timeout=60)
        if out.returncode:
            raise ClusterUnavailable(f"munged did not start: {(out.stderr or out.stdout).strip()[-500:]}")
        self.pids["munged"] = self._read_pid(d / "munged.pid", "munged")

    def _read_pid(self, path: Path, name: str, timeout: float = 20) -> int:
        end = time.time() + timeout
        while time.time() < end:
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            time.sleep(0.2)
        raise ClusterUnavailable(f"{name} wrote no PID file ({path}); see {self.work / 'log'}")

    def start(self, timeout: float = 120) -> LocalCluster:
        """Install what is missing, write the configuration and start the daemons; wait for the node to be idle.

        Args:
            timeout: seconds to wait for the node.

        Returns:
            The cluster itself.

        Raises:
            ClusterUnavailable: the daemons cannot be installed or started here."""
        ensure_installed(self.log)
        t0 = time.time()
        for sub in ("state", "spool", "run", "log"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        cpus, mem = node_resources()
        ports = (free_port(), free_port())
        (self.work / "slurm.conf").write_text(slurm_conf(self.work, getpass.getuser(), ports, cpus, mem))
        os.environ.update(self.env())
        try:
            self._munge()
            conf = str(self.work / "slurm.conf")
            for name, args in (("slurmctld", ["-c", "-f", conf]), ("slurmd", ["-N", NODE, "-f", conf])):
                out = subprocess.run([_sbin(name), *args], capture_output=True, text=True, timeout=60,
                                     env={**os.environ, **self.env()})
                if out.returncode:
                    raise ClusterUnavailable(f"{name} did not start (exit {out.returncode}): "
                                             f"{(out.stderr or out.stdout).strip()[-500:]}; {self._log_tail(name)}")
                self.pids[name] = self._read_pid(self.work / "run" / f"{name}.pid", name)
            self._wait_idle(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.log(f"local SLURM cluster up in {time.time() - t0:.0f} s: partition {PARTITION}, node {NODE}, "
                 f"{cpus} CPUs, {mem} MB, slurmctld on 127.0.0.1:{ports[0]} ({self.work})")
        return self

    def _log_tail(self, name: str) -> str:
        path = self.work / "log" / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines()[-5:] if path.exists() else []
        return f"{path}: " + " | ".join(lines) if lines else f"no {path}"

    def _wait_idle(self, deadline: float) -> None:
        state = ""
        while time.time() < deadline:
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise ClusterUnavailable(f"{name} (PID {pid}) exited; {self._log_tail(name)}")
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30,
                                 env={**os.environ, **self.env()})
            state = out.stdout.strip() or out.stderr.strip()
            if state.rstrip("*") == "idle":
                return
            time.sleep(1)
        raise ClusterUnavailable(f"the node did not become idle (last state: {state!r}); "
                                 f"{self._log_tail('slurmctld')}; {self._log_tail('slurmd')}")

    def _drain(self, timeout: float = 60) -> None:
        """Cancel the cluster's jobs and wait for them to end: a job step still exiting when munged stops
        would retry its last message for ever."""
        env = {**os.environ, **self.env()}
        end = time.time() + timeout
        while time.time() < end:
            out = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, timeout=30, env=env)
            jobs = out.stdout.split()
            if out.returncode or not jobs:
                return
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=30, env=env)
            time.sleep(1)

    def _leftovers(self) -> list[int]:
        """Processes started for this cluster (job steps, their tasks) that outlived it: they carry its
        SLURM_CONF. This process and its ancestors are never among them."""
        mark = f"SLURM_CONF={self.work / 'slurm.conf'}".encode()
        keep, pid = set(), os.getpid()
        while pid > 1:
            keep.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) not in keep:
                try:
                    if mark in (entry / "environ").read_bytes().split(b"\0") and _alive(int(entry.name)):
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def stop(self) -> None:
        """Cancel the jobs, end the daemons this object started by their PIDs (slurmd and slurmctld first,
        munged last), then any job process of this cluster still alive, by PID."""
        if self.pids.get("slurmctld") and _alive(self.pids["slurmctld"]):
            try:
                self._drain()
            except (OSError, subprocess.SubprocessError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None or not _alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            end = time.time() + 20
            while _alive(pid) and time.time() < end:
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in self._leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m hif8qat.rehearse.slurm_cluster [--work DIR] -- COMMAND...``: COMMAND with the cluster up, then
    down.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        COMMAND's exit status (``sinfo`` when none is given); 0 when the cluster cannot start here."""
    ap = argparse.ArgumentParser(prog="python -m hif8qat.rehearse.slurm_cluster",
                                 description=main.__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="folder for the cluster's files (default: a new temporary folder)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    work = Path(args.work or tempfile.mkdtemp(prefix="hif8qat-slurm-"))
    cluster = LocalCluster(work / "cluster")
    try:
        cluster.start()
    except ClusterUnavailable as err:
        print(f"skipped: the local SLURM cluster cannot start here: {err}")
        return 0
    try:
        return subprocess.run(command or ["sinfo"], env={**os.environ, **cluster.env()}).returncode
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
