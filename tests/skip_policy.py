"""A skipped test is a failure unless it was allowed (docs/testing.md, "Skips").

"Power-loss tested" must not silently become untrue on a machine that lost
``/dev/fuse``: every skip is put in a category by its reason, and a skip
fails the run unless its category is allowed:

* ``rdma`` is always allowed (no RDMA device is the normal case), so is
  ``cuda`` (the GPU path's tests: no GPU, or no torch, is the normal case
  here; they say "needs CUDA"), and so is ``cpu``: hardware this machine lacks, said as such by the probe (the
  liburing wheel is built for AVX-512 and dies of SIGILL without it, so
  the io_uring backend cannot run here; any other io_uring skip is
  ``uring`` and fails); and ``soak``, the long checker walks that only
  ``make soak`` asks for (``make test`` runs the bounded checker set);
* ``deployment`` (tests that must start or kill local replicas) is allowed
  when ``TIERFS_TEST_META`` points the suite at a deployment;
* anything else only through ``TIERFS_ALLOW_SKIP``: a comma-separated list of
  categories, or ``all``.

A skip whose reason matches no pattern is ``other``: a new kind of skip
fails until it is added here, which is the point.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Generator
from typing import Any

import pytest

#: category -> pattern matched against the skip reason; the first match wins
CATEGORIES: dict[str, str] = {
    "rdma": r"RDMA",
    "cuda": r"needs CUDA",
    "cpu": r"does not run on this CPU",
    "soak": r"make soak sets",
    "deployment": r"needs a local cluster|local replica|starts its own replicas|TIERFS_TEST_META",
    "fuse": r"/dev/fuse|fusermount|LazyFS",
    "netns": r"netns|10\.200\.",
    "uring": r"io_uring|liburing",
    "mount": r"mount|mkfs",
    "root": r"needs root",
    "tools": r"not installed",
    "other": r"",
}
ALWAYS_ALLOWED = frozenset({"rdma", "cuda", "cpu", "soak"})
ENV = "TIERFS_ALLOW_SKIP"

_allowed_seen: collections.Counter[str] = collections.Counter()


def category(reason: str) -> str:
    """The category of a skip with this reason."""
    for name, pattern in CATEGORIES.items():
        if re.search(pattern, reason):
            return name
    return "other"


def allowed_categories(env: dict[str, str] | os._Environ[str] = os.environ) -> frozenset[str]:
    """What may be skipped in this run; ``pytest.UsageError`` on an unknown name."""
    names = {n.strip() for n in env.get(ENV, "").split(",") if n.strip()}
    if "all" in names:
        return frozenset(CATEGORIES)
    unknown = names - set(CATEGORIES)
    if unknown:
        raise pytest.UsageError(f"{ENV}: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                                f"{', '.join(sorted(unknown))} (known: {', '.join(CATEGORIES)}, all)")
    out = set(ALWAYS_ALLOWED) | names
    if env.get("TIERFS_TEST_META", "").strip():
        out.add("deployment")
    return frozenset(out)


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _enforce(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    cat = category(reason)
    if cat in allowed_categories():
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped, and a skip is an error here: [{cat}] {reason}\n"
                       f"(if this machine really cannot run it, set {ENV}={cat} or {ENV}=all; "
                       f"docs/testing.md, \"Skips\")")


def pytest_configure(config: pytest.Config) -> None:
    allowed_categories()  # a typo in the variable stops the run at once


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    _enforce(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _enforce(outcome.get_result())


def _count(report: pytest.TestReport | pytest.CollectReport) -> None:
    # Counted where the reports are logged: with pytest-xdist (make test
    # runs -n 2) that is the controller, which prints the summary.
    if report.skipped and not hasattr(report, "wasxfail"):
        _allowed_seen[category(_skip_reason(report))] += 1


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _count(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _count(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _allowed_seen:
        terminalreporter.write_line(
            "allowed skips: " + ", ".join(f"{c} x{n}" for c, n in sorted(_allowed_seen.items()))
            + f" (always allowed: {', '.join(sorted(ALWAYS_ALLOWED))}; {ENV}={os.environ.get(ENV, '')!r})")
