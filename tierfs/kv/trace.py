"""Prefix-reuse traces: the Mooncake format, an I/O-free tier simulator, Belady's optimum, a generator.

Trace format (Mooncake FAST'25 release): one JSON object per line with
``timestamp`` (ms since the start), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``, the hashes of the prompt's 512-token blocks in
order. A hash names the whole prefix up to its block (two requests share a hash
only if they share everything before it), so block *i* of a request is useful
only while blocks *0..i-1* are cached too.

The model every function here uses (the prefix-hit model):

* a request's **prefix hit** is the run of leading blocks found in the cache
  (in any tier of a stack); the first block not found ends it, and blocks after
  it count as misses even if cached;
* after the request, all its blocks are stored, as prefill would;
* hit ratio = prefix-hit blocks / blocks requested (the sum of ``len(hash_ids)``).

:func:`simulate` replays a trace against a stack of tiers (``dram`` → ``ssd`` →
``cluster``) with the same :mod:`tierfs.kv.policy` objects the real tiers use,
without I/O; the CLI's ``tierfs kv replay --simulate`` calls it.
:func:`belady` is the offline optimum for one tier (see its docstring for why
it is exact in this model). :func:`synthetic_trace` builds traces with a known
structure for checking that a policy holds off the trace it was tuned on.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from pathlib import Path
from typing import Any

from tierfs.errors import InternalError, InvalidArgumentError
from tierfs.kv.policy import EvictionPolicy, make_policy

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_BLOCK_BYTES",
    "TIERS",
    "Request",
    "SyntheticParams",
    "belady",
    "block_key",
    "hit_tokens_of",
    "infinite_cache_hit_ratio",
    "load_trace",
    "parse_trace",
    "prefill_accounting",
    "resolve_capacity",
    "simulate",
    "split_trace",
    "synthetic_trace",
    "total_blocks",
    "unique_blocks",
    "write_trace",
]

BLOCK_TOKENS = 512
#: A 512-token block of an 8B model (32 layers x 8 KV heads x 128 dims x K,V x fp16).
DEFAULT_BLOCK_BYTES = 64 * 1024 * 1024
#: Tier names, top (fastest) first.
TIERS = ("dram", "ssd", "cluster")


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: int  # ms since the trace's start
    input_length: int  # tokens
    output_length: int  # tokens
    hash_ids: tuple[int, ...]  # prefix hashes of the prompt's 512-token blocks


Trace = Sequence[Request]


def block_key(hash_id: int) -> bytes:
    """The KV key the simulator (and a live replay) uses for a trace block."""
    return b"%d" % hash_id


# -- parsing -------------------------------------------------------------------


def _int_field(obj: dict[str, Any], name: str, where: str) -> int:
    if name not in obj:
        raise InvalidArgumentError(f"{where}: missing field {name!r}")
    v = obj[name]
    # bool is an int subclass; a float timestamp with a fraction is not a ms count.
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not v.is_integer()):
        raise InvalidArgumentError(f"{where}: {name!r} must be an integer, got {v!r}")
    if v < 0:
        raise InvalidArgumentError(f"{where}: {name!r} must be >= 0, got {v!r}")
    return int(v)


def _parse_line(line: str, where: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = _int_field(obj, "timestamp", where)
    inp = _int_field(obj, "input_length", where)
    out = _int_field(obj, "output_length", where)
    if "hash_ids" not in obj:
        raise InvalidArgumentError(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise InvalidArgumentError(f"{where}: 'hash_ids' must be a list, got {type(ids).__name__}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int):
            raise InvalidArgumentError(f"{where}: hash_ids[{i}] must be an integer, got {h!r}")
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"{where}: 'hash_ids' repeats a hash (a prefix cannot contain itself)")
    return Request(ts, inp, out, tuple(ids))


def parse_trace(lines: Iterable[str], *, source: str = "trace") -> list[Request]:
    """Parse Mooncake-format lines; blank lines are skipped. Errors name ``source:line``."""
    out: list[Request] = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            out.append(_parse_line(line, f"{source}:{n}"))
    if not out:
        raise InvalidArgumentError(f"{source}: no requests in the trace")
    return out


def load_trace(path: str | Path) -> list[Request]:
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            return parse_trace(f, source=str(p))
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{p}: not UTF-8 text ({e.reason})") from None


def write_trace(trace: Trace, path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for r in trace:
            f.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


# -- trace facts -----------------------------------------------------------------


def unique_blocks(trace: Trace) -> int:
    return len({h for r in trace for h in r.hash_ids})


def total_blocks(trace: Trace) -> int:
    return sum(len(r.hash_ids) for r in trace)


def resolve_capacity(spec: int | str, unique: int) -> int:
    """A capacity in blocks from ``N`` (blocks) or ``"N%"`` (of ``unique`` blocks, rounded down)."""
    if isinstance(spec, bool):
        raise InvalidArgumentError(f"capacity must be a block count or 'N%', got {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise InvalidArgumentError(f"capacity must be >= 0 blocks, got {spec}")
        return spec
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            pct = float(s[:-1])
            if not math.isfinite(pct) or pct < 0:
                raise ValueError
            # Tiny epsilon: 10% of 43,924 is 4392.4 and must not become 4391 through float error.
            return int(unique * pct / 100 + 1e-9)
        n = int(s)
    except ValueError:
        raise InvalidArgumentError(f"capacity must be a block count or 'N%', got {spec!r}") from None
    if n < 0:
        raise InvalidArgumentError(f"capacity must be >= 0 blocks, got {spec!r}")
    return n


def infinite_cache_hit_ratio(trace: Trace) -> float:
    """Prefix hit ratio of a cache that never evicts: the ceiling for every policy."""
    seen: set[int] = set()
    hits = 0
    for r in trace:
        ids = r.hash_ids
        i = 0
        while i < len(ids) and ids[i] in seen:
            i += 1
        hits += i
        seen.update(ids)
    total = total_blocks(trace)
    return hits / total if total else 0.0


def split_trace(trace: Trace, fraction: float = 0.5) -> tuple[list[Request], list[Request]]:
    """The first ``fraction`` of the requests and the rest (e.g. tune on one, report on the other)."""
    if not 0.0 < fraction < 1.0:
        raise InvalidArgumentError(f"fraction must be in (0, 1), got {fraction}")
    cut = int(len(trace) * fraction)
    return list(trace[:cut]), list(trace[cut:])


# -- simulator -------------------------------------------------------------------


class _SimTier:
    """What a real tier does with its policy, minus the bytes: residency, capacity, counters."""

    __slots__ = (
        "capacity",
        "demotions",
        "evictions",
        "hits",
        "inserts",
        "lower",
        "misses",
        "name",
        "policy",
        "promotions",
        "rejected",
        "resident",
        "size",
    )

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy, size: int) -> None:
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.size = size
        self.resident: set[bytes] = set()
        self.lower: _SimTier | None = None
        self.hits = self.misses = self.evictions = self.inserts = 0
        self.rejected = self.promotions = self.demotions = 0

    def insert(self, key: bytes, parent: bytes | None, parents: Mapping[bytes, bytes]) -> bool:
        if not self.policy.admit(key, self.size):
            self.rejected += 1
            return False
        self.policy.on_insert(key, self.size, parent)
        self.resident.add(key)
        self.inserts += 1
        while len(self.resident) > self.capacity:
            victim = self.policy.pop_victim()
            if victim is None or victim not in self.resident:
                raise InternalError(
                    f"policy {self.policy.name!r} in tier {self.name}: pop_victim returned "
                    f"{victim!r} with {len(self.resident)} resident objects"
                )
            self.resident.discard(victim)
            self.evictions += 1
            low = self.lower
            if low is not None and victim not in low.resident and low.insert(victim, parents.get(victim), parents):
                low.demotions += 1
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "policy": self.policy.name,
            "hits": self.hits,
            "misses": self.misses,
            "inserts": self.inserts,
            "rejected": self.rejected,
            "evictions": self.evictions,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "resident": len(self.resident),
        }


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[i]


def prefill_accounting(
    hit_tokens: int,
    hit_bytes: int,
    *,
    prefill_tokens_per_s: float,
    load_gbps: float,
) -> dict[str, float]:
    """Prefill time the hits saved against the time spent loading them.

    ``prefill_saved_s = hit_tokens / prefill_tokens_per_s`` (the prefill the hit
    blocks did not recompute), ``load_s = hit_bytes / (load_gbps * 1e9)``
    (``load_gbps`` is in gigaBYTES per second, 10^9 B/s), ``net_saved_s`` the
    difference, ``load_fraction = load_s / prefill_saved_s`` (below 1: loading pays).
    Loads are assumed serial and not overlapped with compute: an upper bound on the
    load cost.
    """
    if prefill_tokens_per_s <= 0 or load_gbps <= 0:
        raise InvalidArgumentError(
            f"prefill_tokens_per_s and load_gbps must be > 0, got {prefill_tokens_per_s}, {load_gbps}"
        )
    saved = hit_tokens / prefill_tokens_per_s
    load = hit_bytes / (load_gbps * 1e9)
    return {
        "hit_tokens": hit_tokens,
        "prefill_saved_s": saved,
        "load_s": load,
        "net_saved_s": saved - load,
        "load_fraction": load / saved if saved else 0.0,
    }


def _policy_per_tier(policy: str | Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    if isinstance(policy, str):
        return dict.fromkeys(names, policy)
    unknown = set(policy) - set(TIERS)
    if unknown:
        raise InvalidArgumentError(f"unknown tier(s) in policy map: {sorted(unknown)}; tiers are {TIERS}")
    # A tier left out takes the default policy, lru, as in a live replay.
    return {n: policy.get(n, "lru") for n in names}


def hit_tokens_of(hit_blocks: int, input_length: int, tokens_per_block: int) -> int:
    """Prefill tokens a request's prefix hit of ``hit_blocks`` saves: its
    blocks' tokens, at most the request's input (its last block is partial).
    The simulated and the live replay both count this way (stop 47: the
    live one took no cap, and the simulated one no --tokens-per-block)."""
    n = hit_blocks * tokens_per_block
    return min(n, input_length) if input_length else n


def simulate(
    trace: Trace,
    capacities: Mapping[str, int | str],
    policy: str | Mapping[str, str] = "lru",
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    prefill_tokens_per_s: float | None = None,
    load_gbps: float | None = None,
    tokens_per_block: int = BLOCK_TOKENS,
) -> dict[str, Any]:
    """Replay ``trace`` against a stack of tiers without I/O.

    ``capacities`` maps tier names (``dram``, ``ssd``, ``cluster``, top first) to
    blocks or ``"N%"`` of the trace's unique blocks; a tier with capacity 0 (or
    not named) is absent. ``policy`` is one name for every tier or one per tier.

    Per request, block by block: the block is looked up top-down (each tier that
    misses gets ``on_miss``); the first tier holding it serves it (``on_access``)
    and the tiers above get a copy (a promotion, through their admission). The
    first block no tier holds ends the prefix hit. Then every block of the
    request is put into every tier that lacks it (write-through; each tier's
    ``admit`` decides). A tier over capacity evicts through ``pop_victim`` and
    the victim is demoted into the tier below when that one lacks it.

    With ``load_gbps`` (GB/s), ``load_latency_ms`` is the modelled per-request load
    time of its hit blocks (``hit blocks x block_bytes / bandwidth``; requests
    without a hit count as 0); with ``prefill_tokens_per_s`` as well, ``prefill``
    holds :func:`prefill_accounting` for the whole trace.
    """
    if block_bytes <= 0:
        raise InvalidArgumentError(f"block_bytes must be > 0, got {block_bytes}")
    unknown = set(capacities) - set(TIERS)
    if unknown:
        raise InvalidArgumentError(f"unknown tier(s) {sorted(unknown)}; tiers are {', '.join(TIERS)}")
    uniq = unique_blocks(trace)
    caps = {n: resolve_capacity(capacities[n], uniq) for n in TIERS if n in capacities}
    present = [n for n in TIERS if caps.get(n, 0) > 0]
    if not present:
        raise InvalidArgumentError("every tier has capacity 0: nothing to simulate")
    names = _policy_per_tier(policy, present)
    tiers = [_SimTier(n, caps[n], make_policy(names[n], capacity_bytes=caps[n] * block_bytes), block_bytes) for n in present]
    for upper, lower in itertools.pairwise(tiers):
        upper.lower = lower

    parents: dict[bytes, bytes] = {}
    blocks = 0
    hit_tokens = 0
    req_hits: list[int] = []
    for r in trace:
        keys = [block_key(h) for h in r.hash_ids]
        blocks += len(keys)
        prev: bytes | None = None
        for k in keys:
            if prev is not None:
                parents[k] = prev
            prev = k
        hit = 0
        for j, k in enumerate(keys):
            served = -1
            for t, tier in enumerate(tiers):
                if k in tier.resident:
                    served = t
                    break
                tier.misses += 1
                tier.policy.on_miss(k)
            if served < 0:
                break
            src = tiers[served]
            src.hits += 1
            src.policy.on_access(k)
            parent = keys[j - 1] if j else None
            for t in range(served):
                if k not in tiers[t].resident and tiers[t].insert(k, parent, parents):
                    tiers[t].promotions += 1
            hit += 1
        req_hits.append(hit)
        hit_tokens += hit_tokens_of(hit, r.input_length, tokens_per_block)
        for j, k in enumerate(keys):
            parent = keys[j - 1] if j else None
            for tier in tiers:
                if k not in tier.resident:
                    tier.insert(k, parent, parents)

    total_hits = sum(req_hits)
    ratio = {n: 0.0 for n in TIERS}
    for tier in tiers:
        ratio[tier.name] = tier.hits / blocks if blocks else 0.0
    ratio["total"] = total_hits / blocks if blocks else 0.0
    distinct = sorted(set(names.values()))
    result: dict[str, Any] = {
        "requests": len(trace),
        "blocks": blocks,
        "unique_blocks": uniq,
        "hit_blocks": total_hits,
        "hit_ratio": ratio,
        "policy": distinct[0] if len(distinct) == 1 else ",".join(f"{n}:{names[n]}" for n in present),
        "policies": names,
        "capacities": {n: caps.get(n, 0) for n in TIERS},
        "block_bytes": block_bytes,
        "bytes_loaded": total_hits * block_bytes,
        "load_latency_ms": None,
        "tiers": {t.name: t.stats() for t in tiers},
        "infinite_cache_hit_ratio": infinite_cache_hit_ratio(trace),
    }
    if load_gbps is not None:
        if load_gbps <= 0:
            raise InvalidArgumentError(f"load_gbps must be > 0, got {load_gbps}")
        per_req = sorted(h * block_bytes / (load_gbps * 1e9) * 1e3 for h in req_hits)
        result["load_latency_ms"] = {"p50": _percentile(per_req, 0.50), "p99": _percentile(per_req, 0.99)}
        if prefill_tokens_per_s is not None:
            result["prefill"] = prefill_accounting(
                hit_tokens, total_hits * block_bytes, prefill_tokens_per_s=prefill_tokens_per_s, load_gbps=load_gbps
            )
    elif prefill_tokens_per_s is not None:
        raise InvalidArgumentError("prefill_tokens_per_s needs load_gbps too (the time saved is weighed against the load)")
    return result


# -- Belady ----------------------------------------------------------------------


def belady(trace: Trace, capacity: int | str) -> float:
    """Prefix hit ratio of the offline optimum for one tier of ``capacity`` blocks (or ``"N%"``).

    Belady's MIN over the block reference sequence (each request references all its
    blocks, in order): when over capacity, drop the block whose next reference is
    farthest, ties broken by evicting the deeper block; a block never referenced
    again is not kept at all.

    Why this is the optimum of the *prefix-hit* model, not just a bound: a block's
    hash names its whole prefix, so a block's next reference is never earlier than
    its parent's, and with the depth tie-break MIN never keeps a block without its
    parent. Its cache is always prefix-closed, so every block it finds is a prefix
    hit and its prefix hits equal its ordinary hits. Any other policy's prefix hits
    are at most its ordinary hits on the same reference sequence, which MIN
    maximises (unit-sized blocks, bypass allowed). The promise needs blocks of one
    size and traces whose hashes are prefix hashes (checked: a hash seen with two
    different predecessors raises ``InvalidArgumentError``).
    """
    uniq = unique_blocks(trace)
    cap = resolve_capacity(capacity, uniq)
    never = 1 << 62
    n = len(trace)
    parent_of: dict[int, int | None] = {}
    for i, r in enumerate(trace):
        prev: int | None = None
        for h in r.hash_ids:
            if h in parent_of and parent_of[h] != prev:
                raise InvalidArgumentError(
                    f"request {i}: block {h} follows {prev}, earlier it followed {parent_of[h]}: "
                    "hash_ids are not prefix hashes, the prefix-closed optimum does not apply"
                )
            parent_of[h] = prev
            prev = h
    next_use: list[list[int]] = [[] for _ in range(n)]
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        ids = trace[i].hash_ids
        next_use[i] = [last.get(h, never) for h in ids]
        for h in ids:
            last[h] = i
    cache: dict[int, tuple[int, int]] = {}
    heap: list[tuple[tuple[int, int], int]] = []
    hits = 0
    total = 0
    for i, r in enumerate(trace):
        ids = r.hash_ids
        total += len(ids)
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hits += k
        if cap == 0:
            continue
        for j, h in enumerate(ids):
            nu = next_use[i][j]
            if nu == never:
                # Bypass: keeping a block that is never asked for again only costs room.
                cache.pop(h, None)
                continue
            prio = (-nu, -j)  # heap top: farthest next use, then deepest
            cache[h] = prio
            heappush(heap, (prio, h))
            while len(cache) > cap:
                p, victim = heappop(heap)
                if cache.get(victim) == p:
                    del cache[victim]
    return hits / total if total else 0.0


# -- synthetic traces ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyntheticParams:
    """Shape of :func:`synthetic_trace`. Lengths are in 512-token blocks, rates per second.

    Requests arrive as a Poisson process (``rate_per_s``). Each is, with the given
    probabilities, a new conversation, the next turn of a live conversation, or a
    one-shot document; every prompt starts with one of ``system_prompts`` shared
    system prompts (picked Zipf-like, ``system_prompt_zipf``).
    """

    requests: int = 4000
    rate_per_s: float = 4.0
    system_prompts: int = 4  # distinct shared system prompts
    system_prompt_blocks: tuple[int, int] = (2, 8)  # length range of a system prompt
    system_prompt_zipf: float = 1.2  # popularity skew of the system prompts
    p_new_conversation: float = 0.25
    p_document: float = 0.35  # a long one-shot document (re-asked with p_document_reask)
    p_document_reask: float = 0.15  # a document is queried again later (document QA)
    document_blocks: tuple[int, int] = (8, 120)
    first_turn_blocks: tuple[int, int] = (1, 12)  # user text of a conversation's first turn
    turn_blocks: tuple[int, int] = (1, 4)  # what each later turn adds (previous answer + new question)
    mean_turns: float = 4.0  # conversation length (geometric)
    live_conversations: int = 1000  # conversations open at a time; the oldest is closed beyond that
    max_blocks: int = 400  # a prompt is capped (an engine's context limit); the conversation ends there


def synthetic_trace(seed: int, params: SyntheticParams | None = None) -> list[Request]:
    """A Mooncake-format trace with a known structure (shared system prompts, growing chats, documents).

    The remaining probability mass after ``p_new_conversation`` and ``p_document``
    goes to the next turn of a live conversation picked uniformly (a new
    conversation when none is live), so conversations interleave the way many
    users on one engine do. Deterministic for a given ``seed`` and ``params``.
    """
    p = params or SyntheticParams()
    if p.requests <= 0 or p.rate_per_s <= 0 or p.system_prompts <= 0:
        raise InvalidArgumentError("requests, rate_per_s and system_prompts must be > 0")
    if p.p_new_conversation + p.p_document > 1.0:
        raise InvalidArgumentError("p_new_conversation + p_document must be <= 1")
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def draw(bounds: tuple[int, int]) -> int:
        return rng.randint(bounds[0], bounds[1])

    systems = [fresh(draw(p.system_prompt_blocks)) for _ in range(p.system_prompts)]
    weights = [1.0 / (i + 1) ** p.system_prompt_zipf for i in range(p.system_prompts)]
    live: list[tuple[list[int], int]] = []  # (prompt so far, turns left)
    reask: list[list[int]] = []
    out: list[Request] = []
    t_ms = 0.0
    end_p = 1.0 / max(p.mean_turns, 1.0)
    for _ in range(p.requests):
        t_ms += rng.expovariate(p.rate_per_s) * 1000.0
        u = rng.random()
        system = rng.choices(systems, weights)[0]
        if u < p.p_document:
            if reask and rng.random() < 0.5:
                ids = reask.pop(rng.randrange(len(reask)))
            else:
                ids = system + fresh(draw(p.document_blocks))
                if rng.random() < p.p_document_reask:
                    reask.append(ids)
            ids = ids + fresh(1)  # the question about the document
        elif u < p.p_document + p.p_new_conversation or not live:
            ids = system + fresh(draw(p.first_turn_blocks))
            turns = 1
            while rng.random() > end_p:
                turns += 1
            if turns > 1:
                live.append((ids, turns - 1))
                if len(live) > p.live_conversations:
                    live.pop(0)
        else:
            i = rng.randrange(len(live))
            prev, left = live[i]
            ids = prev + fresh(draw(p.turn_blocks))
            if left > 1 and len(ids) < p.max_blocks:
                live[i] = (ids, left - 1)
            else:
                live.pop(i)
        ids = ids[: p.max_blocks]
        out.append(Request(int(t_ms), len(ids) * BLOCK_TOKENS, rng.randint(16, 512), tuple(ids)))
    return out
