"""Prefix hit ratios of the KV eviction policies against LRU and Belady's optimum, on several traces.

    python -m bench.kv_policies [--trace PATH] [--held-out PATH ...] [--out bench/results]

Writes ``kv_policies.json`` and ``kv_policies.md`` (the table in docs/kv_policies.md).
Pure simulation (tierfs.kv.trace.simulate): no daemons, no I/O, about two minutes
on one core.

Traces (fixed before the policies were compared on the held-out ones):

* ``public``: the Mooncake FAST'25 trace (``../shared/traces/``), whole;
* ``public-1st`` / ``public-2nd``: its first and second halves by request count.
  Policy parameters were chosen on ``public-1st`` (tuning); ``public-2nd`` is held out;
* ``syn-0``: ``synthetic_trace(0)`` with default parameters (tuning);
* ``syn-1``: ``synthetic_trace(1)``, default parameters (held out);
* ``syn-docs``: ``synthetic_trace(2, DOCS)``: document-heavy, more re-asked documents,
  longer conversations (held out);
* ``--held-out PATH`` (repeatable): any other trace in the Mooncake format, named
  by its file's stem, e.g. the FAST'25 release's ``conversation_trace.jsonl``
  (docs/kv_policies.md, "A trace none of the policies was built on").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from tierfs.kv.policy import policy_names
from tierfs.kv.trace import (
    Request,
    SyntheticParams,
    belady,
    infinite_cache_hit_ratio,
    load_trace,
    simulate,
    split_trace,
    synthetic_trace,
    total_blocks,
    unique_blocks,
)

HERE = Path(__file__).resolve().parent
CAPACITIES = ("1%", "2%", "5%", "10%", "20%")
TRACE_NAME = "mooncake_synthetic_trace.jsonl"
DOCS = SyntheticParams(p_document=0.6, p_new_conversation=0.15, p_document_reask=0.4, mean_turns=6.0)
ROLE = {
    "public": "reference (contains the tuning half)",
    "public-1st": "tuning",
    "public-2nd": "held out",
    "syn-0": "tuning",
    "syn-1": "held out",
    "syn-docs": "held out",
}
#: A three-tier stack on the public trace, to show per-tier accounting.
STACK = {"dram": "2%", "ssd": "10%", "cluster": "20%"}


def find_public_trace() -> Path:
    for d in HERE.parents:
        cand = d / "shared" / "traces" / TRACE_NAME
        if cand.is_file():
            return cand
    raise SystemExit(f"{TRACE_NAME} not found under any shared/traces/ above {HERE}; pass --trace")


def traces(public_path: Path) -> dict[str, list[Request]]:
    pub = load_trace(public_path)
    first, second = split_trace(pub)
    return {
        "public": pub,
        "public-1st": first,
        "public-2nd": second,
        "syn-0": synthetic_trace(0),
        "syn-1": synthetic_trace(1),
        "syn-docs": synthetic_trace(2, DOCS),
    }


def measure(name: str, tr: list[Request], policies: list[str], role: str | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows = []
    for cap in CAPACITIES:
        row: dict[str, Any] = {"capacity": cap}
        for pol in policies:
            r = simulate(tr, {"dram": cap}, pol)
            row[pol] = round(r["hit_ratio"]["total"], 4)
            row.setdefault("blocks", r["capacities"]["dram"])
        row["optimum"] = round(belady(tr, cap), 4)
        rows.append(row)
    return {
        "trace": name,
        "role": role or ROLE[name],
        "requests": len(tr),
        "blocks": total_blocks(tr),
        "unique_blocks": unique_blocks(tr),
        "infinite_cache": round(infinite_cache_hit_ratio(tr), 4),
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def stack_rows(tr: list[Request], policies: list[str]) -> list[dict[str, Any]]:
    out = []
    for pol in policies:
        r = simulate(tr, STACK, pol, prefill_tokens_per_s=10_000, load_gbps=10)
        out.append(
            {
                "policy": pol,
                "hit_ratio": {k: round(v, 4) for k, v in r["hit_ratio"].items()},
                "net_saved_s": round(r["prefill"]["net_saved_s"], 1),
            }
        )
    return out


def to_markdown(result: dict[str, Any]) -> str:
    pols: list[str] = result["policies"]
    lines = [
        "### kv_policies",
        "",
        f"Prefix hit ratio (hit blocks / requested blocks), one tier, capacity in % of the trace's "
        f"unique blocks. `optimum`: Belady (`tierfs.kv.trace.belady`). Generated {result['date']} "
        f"by `python -m bench.kv_policies`.",
        "",
    ]
    for t in result["traces"]:
        lines += [
            f"**{t['trace']}** ({t['role']}): {t['requests']:,} requests, {t['blocks']:,} blocks, "
            f"{t['unique_blocks']:,} unique; infinite cache {t['infinite_cache']:.3f}",
            "",
            "| capacity | blocks | " + " | ".join(pols) + " | optimum | chain / lru |",
            "|---|---:|" + "---:|" * (len(pols) + 2),
        ]
        for row in t["rows"]:
            best = max(row[p] for p in pols)
            cells = [f"**{row[p]:.3f}**" if row[p] == best else f"{row[p]:.3f}" for p in pols]
            ratio = row["chain"] / row["lru"] if row["lru"] else float("nan")
            lines.append(
                f"| {row['capacity']} | {row['blocks']:,} | " + " | ".join(cells) + f" | {row['optimum']:.3f} | {ratio:.2f} |"
            )
        lines.append("")
    lines += [
        f"**Three tiers on `public`** ({', '.join(f'{k} {v}' for k, v in STACK.items())}; "
        "write-through; prefill 10k tokens/s, load 10 GB/s, 64 MiB blocks):",
        "",
        "| policy | dram | ssd | cluster | total | net prefill saved (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in result["stack"]:
        h = s["hit_ratio"]
        lines.append(
            f"| {s['policy']} | {h['dram']:.3f} | {h['ssd']:.3f} | {h['cluster']:.3f} | {h['total']:.3f} | {s['net_saved_s']:,.1f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=None, help="the public Mooncake trace")
    ap.add_argument("--held-out", type=Path, action="append", default=[], metavar="PATH",
                    help="another Mooncake-format trace to measure as held out (repeatable)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    path = args.trace or find_public_trace()
    policies = policy_names()
    all_traces = traces(path)
    measured = []
    for name, tr in all_traces.items():
        m = measure(name, tr, policies)
        print(f"{name}: {m['seconds']} s", file=sys.stderr, flush=True)
        measured.append(m)
    for extra in args.held_out:
        m = measure(extra.stem, load_trace(extra), policies, role=f"held out, external: {extra.name}")
        print(f"{extra.stem}: {m['seconds']} s", file=sys.stderr, flush=True)
        measured.append(m)
    result = {
        "name": "kv_policies",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "public_trace": str(path),
        "policies": policies,
        "capacities": list(CAPACITIES),
        "traces": measured,
        "stack": stack_rows(all_traces["public"], policies),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_policies.json").write_text(json.dumps(result, indent=1) + "\n")
    md = to_markdown(result)
    (args.out / "kv_policies.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
