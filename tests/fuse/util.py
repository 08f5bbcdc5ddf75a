"""Helpers for the FUSE tests: ``tierfs mount`` run as the real command (a
subprocess), and unmounting that always happens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tierfs.fuse import find_mount

__all__ = ["Mount", "run_tierfs", "wait_gone", "wait_unmounted"]

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TIERFS_META", None)
    return env


def run_tierfs(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierfs.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=REPO)


def wait_unmounted(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while find_mount(str(path)) is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} still mounted after {timeout} s")
        time.sleep(0.05)


def wait_gone(pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A zombie child of ours counts as gone once reaped.
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still running after {timeout} s")
        time.sleep(0.05)


class Mount:
    """A daemon-mode ``tierfs mount`` at ``path``; :meth:`close` always
    leaves it unmounted and the daemon gone (``fusermount3 -uz`` and
    SIGKILL if ``tierfs umount`` does not do it)."""

    def __init__(self, path: Path, meta: list[str], log: Path, *extra: str) -> None:
        self.path, self.log = path, log
        path.mkdir(parents=True, exist_ok=True)
        r = run_tierfs("mount", str(path), "--meta", ",".join(meta), "--log", str(log), *extra)
        if r.returncode != 0:
            raise AssertionError(f"tierfs mount failed ({r.returncode}): {r.stderr}\nlog:\n{self.log_text()}")
        m = re.search(r"mounted .* pid (\d+)", self.log_text())
        if m is None:
            subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True, timeout=30)
            raise AssertionError(f"no pid in the mount log:\n{self.log_text()}")
        self.pid = int(m.group(1))

    def log_text(self) -> str:
        try:
            return self.log.read_text()
        except OSError:
            return ""

    def close(self) -> None:
        if find_mount(str(self.path)) is not None:
            r = run_tierfs("umount", str(self.path), timeout=30)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True, timeout=30)
        try:
            wait_gone(self.pid, 20)
        except AssertionError:
            os.kill(self.pid, 9)
            wait_gone(self.pid, 10)
            subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True, timeout=30)
