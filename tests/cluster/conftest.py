"""One real `mlxcel cluster` per test module: a local Ray cluster on 127.0.0.1, 2 replicas of the default model.

Started through the CLI in its own session, so at the end every process it left (Ray's
workers included) can be found by session id and stopped by pid; no Ray process outlives
the module.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.server.test_process import read_address

API_KEY = "cluster-test-key"
READY = re.compile(r"pid=(\d+)\).*replica (\w+) ready")


@dataclass
class Cluster:
    address: str
    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def replica_pids(self) -> dict[str, int]:
        """Replica id -> OS pid, from each replica's "ready" line in the cluster's log."""
        return {m.group(2): int(m.group(1)) for line in list(self.log) for m in [READY.search(line)] if m}


def session_pids(session_id: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session_id:  # field 6 of stat: the session id
                pids.append(int(entry.name))
    return pids


def listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets these processes listen on."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1].split(":")[0])
    return found


def start_cluster(*flags: str) -> Iterator[Cluster]:
    pytest.importorskip("ray.serve", reason="mlxcel[cluster] (ray[serve]) is not installed")
    temp = Path(tempfile.mkdtemp(prefix="mlxr-", dir="/tmp"))  # Ray's socket paths must stay short
    command = [sys.executable, "-c", "import sys; from mlxcel.cli import main; sys.exit(main())", "cluster",
               "--replicas", "2", "--replica-cpus", "1", "--threads", "1", "--no-warmup", "-c", "2048", "-np", "2",
               "--port", "0", "--metrics", "--api-key", API_KEY, "--ray-temp-dir", str(temp / "ray"), *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    log: list[str] = []
    try:
        yield Cluster(read_address(process, log, timeout=300), process, log)
        assert _stop(process) == 0 and any("shutdown complete" in line for line in log)  # A7: a clean exit
    finally:
        _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def _stop(process: subprocess.Popen[str]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    end = time.monotonic() + 20
    while (left := session_pids(process.pid)) and time.monotonic() < end:
        time.sleep(0.5)  # Ray's processes exit on their own once the driver stopped them
    for pid in session_pids(process.pid):
        os.kill(pid, signal.SIGKILL)
    return process.returncode
