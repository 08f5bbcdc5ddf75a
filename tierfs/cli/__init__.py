"""The ``tierfs`` admin CLI: ``main``/``run`` (the command line) over functions
that return data (``cluster_up``, ``cluster_status``, ``put``, ``ls``, ...),
which tests and scripts can call directly."""

from tierfs.cli.cluster import cluster_down, cluster_status, cluster_up
from tierfs.cli.fs import LocalFileError, cat, get, ls, mkdir, mv, put, rm, set_layout, stat
from tierfs.cli.main import build_parser, main, render_status, run
from tierfs.cli.tree import get_tree, put_tree
from tierfs.cli.usage import df, du
from tierfs.cli.util import resolve_meta

__all__ = [
    "LocalFileError",
    "build_parser",
    "cat",
    "cluster_down",
    "cluster_status",
    "cluster_up",
    "df",
    "du",
    "get",
    "get_tree",
    "ls",
    "main",
    "mkdir",
    "mv",
    "put",
    "put_tree",
    "render_status",
    "resolve_meta",
    "rm",
    "run",
    "set_layout",
    "stat",
]
