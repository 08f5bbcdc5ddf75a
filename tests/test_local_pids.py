"""A local cluster tells its own daemons from other TierFS processes.

Pids wrap at 32,768 here and in CI. A daemon that died leaves its pid in
the plan; when the kernel hands that pid to another cluster's daemon, a
check that only asked "is it a TierFS process?" took it for ours: CI once
failed because one test's ``stop()`` SIGTERMed the meta replica another
test's cluster was starting."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.local import LocalCluster, pid_alive

pytestmark = pytest.mark.timeout(60)


def _foreign(tmp_path: Path) -> subprocess.Popen[bytes]:
    """A process whose command line looks like another cluster's daemon."""
    other = tmp_path / "other" / "meta-0"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "tierfs.meta.daemon",
                             "--node-id=meta-0", f"--data-dir={other}"])
    end = time.monotonic() + 10
    while b"tierfs" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < end
        time.sleep(0.01)
    return proc


def test_a_reused_pid_is_not_taken_for_a_dead_daemon(tmp_path: Path) -> None:
    proc = _foreign(tmp_path)
    try:
        cl = LocalCluster(tmp_path / "mine", n_meta=1, n_storage=1)
        meta = cl.proc("meta-0")
        meta.pid = proc.pid  # what the plan holds after meta-0 died and its pid was reused
        assert pid_alive(proc.pid)  # a TierFS process...
        assert not meta.alive()  # ...but not this cluster's meta-0
        assert cl.running() == {"meta-0": False, "storage-0": False}
        assert cl.stop(timeout=2) == []
        with pytest.raises(Exception, match="not running"):
            cl.kill("meta-0")
        assert proc.poll() is None, "stop() or kill() signalled another cluster's daemon"
        # The daemon's own command line does identify it.
        meta.pid = proc.pid
        foreign = LocalCluster(tmp_path / "other", n_meta=1, n_storage=1).proc("meta-0")
        foreign.pid = proc.pid
        assert foreign.alive()
    finally:
        proc.kill()
        proc.wait()


def test_a_daemon_that_dies_during_start_up_is_reported_with_how_it_ended(tmp_path: Path) -> None:
    """A daemon killed by a signal during start-up leaves nothing in its
    log; the error names the signal (a meta nemesis once failed a soak with
    only "exited during start-up" and a log that ended mid-start)."""
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=1)
    meta = cl.proc("meta-0")
    args = meta.argv[2:]  # the daemon's own flags (its --data-dir marks it as this cluster's)
    meta.argv = ["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "-m", "tierfs.meta.daemon", *args]
    with pytest.raises(Exception, match=r"meta-0 \(pid \d+\) exited during start-up, killed by signal 9 \(SIGKILL\)"):
        cl.start(timeout=20, names=["meta-0"])
    meta.argv = ["-c", "raise SystemExit(3)", "-m", "tierfs.meta.daemon", *args]
    with pytest.raises(Exception, match="exited during start-up, exited with status 3"):
        cl.start(timeout=20, names=["meta-0"])
