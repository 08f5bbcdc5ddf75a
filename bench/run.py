"""Run every benchmark in bench/bench_*.py and record the results.

Each module exposes ``run(quick: bool) -> dict`` (see bench/README.md). Every
benchmark measures its own baseline (raw TCP, raw disk, raw pysyncobj) in the
same run and reports a ratio to it, so figures from noisy machines still
compare. Results go to ``bench/results/<name>.json`` and a Markdown table in
``bench/results/README.md``.

    python -m bench.run [--quick] [--only NAME ...] [--out DIR]

A ``--quick`` run writes to ``bench/results/quick/`` unless ``--out`` says
otherwise: its short figures must not replace the committed full ones.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"### {result['name']}", ""]
    if result.get("error"):
        lines += [f"**failed:** `{result['error']}`", ""]
    rows = result.get("rows", [])
    if rows:
        lines += ["| case | value | unit | baseline | baseline is | ratio |", "|---|---:|---|---:|---|---:|"]
        for r in rows:
            ratio = r.get("ratio")
            lines.append(
                f"| {r['case']} | {_fmt(r['value'])} | {r.get('unit', '')} | {_fmt(r.get('baseline'))} "
                f"| {r.get('baseline_name', '')} | {'-' if ratio is None else f'{ratio:.0%}'} |"
            )
        lines.append("")
    if result.get("notes"):
        lines += [result["notes"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK") == "1",
                    help="short runs (each benchmark < 60 s)")
    ap.add_argument("--only", nargs="*", default=None, help="benchmark names (e.g. meta dataplane)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the results go (default: bench/results; bench/results/quick with --quick)")
    ns = ap.parse_args(argv)
    out = ns.out if ns.out is not None else (RESULTS / "quick" if ns.quick else RESULTS)
    names = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    if ns.only is not None:
        unknown = sorted(set(ns.only) - set(names))
        if unknown or not ns.only:
            ap.error(f"--only: no benchmark named {', '.join(unknown) or '(none given)'}; "
                     f"the names are {', '.join(names)}")
        names = [n for n in names if n in ns.only]
    out.mkdir(parents=True, exist_ok=True)
    # The files a benchmark writes itself (bench/common.py's results_dir) go here too.
    os.environ["TIERFS_BENCH_RESULTS"] = str(out.resolve())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sections: list[str] = []
    failed = 0
    for name in names:
        print(f"== bench {name} ({'quick' if ns.quick else 'full'}) ...", flush=True)
        t0 = time.monotonic()
        try:
            mod = importlib.import_module(f"bench.bench_{name}")
            result = mod.run(ns.quick)
        except Exception as exc:
            traceback.print_exc()
            result = {"name": name, "rows": [], "notes": "", "error": f"{type(exc).__name__}: {exc}"}
            failed += 1
        result.update(when=stamp, quick=ns.quick, seconds=round(time.monotonic() - t0, 1),
                      machine=_machine())
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        md = to_markdown(result)
        sections.append(md)
        print(md, flush=True)
    header = [
        "# Benchmark results",
        "",
        f"Written by `python -m bench.run{' --quick' if ns.quick else ''}` (`make bench` runs it) on {stamp}, "
        f"{_machine()['cpus']} CPUs. Each ratio is against a baseline "
        "measured in the same run. A run of some benchmarks (`--only`) keeps the others' latest results; "
        "each section says when it ran.",
        "",
    ]
    if names:
        # Every benchmark's latest result, not only those of this run.
        sections = []
        for path in sorted(out.glob("*.json")):
            result = json.loads(path.read_text())
            if "name" not in result:
                continue  # not a bench_*.py result (bench/engines_*.py write their own .md)
            md = to_markdown(result)
            when = f"{result.get('when', '?')}, {'quick' if result.get('quick') else 'full'}"
            sections.append(md.replace("\n", f"\n\n_run {when}_\n", 1))
        (out / "README.md").write_text("\n".join(header + sections))
        print(f"results: {out}/", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
