"""The io_uring probe's verdict cache: a daemon start reuses the verdict of a
child probe that ran on this CPU with this interpreter and liburing build
(it came through, or the wheel died of SIGILL), and probes again in a child
for anything else."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tierfs.storage.io import uring

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if uring.L is None:
        pytest.skip(f"liburing not importable: {uring._IMPORT_ERROR}")
    monkeypatch.setenv("TIERFS_CACHE_DIR", str(tmp_path))
    return tmp_path


def _children(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    real = subprocess.run

    def counting(argv, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(list(argv))
        return real(argv, *a, **kw)

    monkeypatch.setattr(uring.subprocess, "run", counting)
    return calls


def test_first_probe_runs_a_child_and_the_second_reuses_its_verdict(cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _children(monkeypatch)
    first = uring.probe_uring()
    assert len(calls) == 1
    stamp = uring._probe_stamp()
    assert stamp is not None and stamp.parent == cache
    assert stamp.read_text() in (uring._PASSED, first)
    second = uring.probe_uring()
    assert len(calls) == 1, "the cached verdict should spare the second child"
    assert second == first


def test_a_cached_sigill_is_returned_without_a_child(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = uring._probe_stamp()
    assert stamp is not None
    stamp.write_text("io_uring probe died of SIGILL (the liburing wheel does not run on this CPU)")
    calls = _children(monkeypatch)
    assert uring.probe_uring() == stamp.read_text()
    assert calls == []


@pytest.mark.parametrize("junk", ["", "garbage", "ok\n"])
def test_a_torn_or_foreign_stamp_means_a_new_child_probe(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                         junk: str) -> None:
    stamp = uring._probe_stamp()
    assert stamp is not None
    stamp.write_text(junk)
    calls = _children(monkeypatch)
    uring.probe_uring()
    assert len(calls) == 1
    assert stamp.read_text() != junk


def test_the_stamp_depends_on_the_interpreter(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = uring._probe_stamp()
    monkeypatch.setattr(uring.sys, "executable", "/elsewhere/python3")
    assert uring._probe_stamp() != a
