#!/usr/bin/env python
"""Write the tables of docs/benchmarks.md from the JSON of one ``make bench`` run.

    .venv-bench/bin/python benchmarks/suite/report.py benchmarks/results/peers.json \\
        benchmarks/results/http.json --docs docs/benchmarks.md --run-id ID

Reads what benchmarks/suite/peers.py and benchmarks/suite/http_stack.py wrote, checks that both come
from the same run (``--run-id``, which ``make bench`` passes to all three), prints the
targets of issue 19 with met or missed, and with ``--docs`` replaces what lies between
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in that page: the run's date,
machine, versions and git commit, then its tables. Nothing else of the page changes,
and nothing is averaged or picked from other runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
GROUPS = {"database": "Database", "redis": "Redis", "exactness": "Exactness", "HTTP": "HTTP"}


def load(path: str, kind: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    if data.get("kind") != kind:
        raise SystemExit(f"{path}: not the JSON of a {kind} run (kind {data.get('kind')!r})")
    return data


def _n(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def table(header: list[str], rows: list[list[str]], right_from: int = 1, right_to: int | None = None) -> str:
    """A Markdown table, its columns from ``right_from`` (up to ``right_to``, excluded) aligned right."""
    end = len(header) if right_to is None else right_to
    align = ["--:" if right_from <= i < end else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(row: dict[str, Any]) -> str:
    if row["met"] is None:
        return "not measured"
    if row["limit"] == 0:
        return "met" if row["met"] else f"**missed**: {row['value']:,} over-admitted"
    share = abs(row["margin"]) * 100
    if row["met"]:
        return f"met ({share:.0f} % to spare)"
    return f"**missed** by {share:.0f} %"


def value_cell(row: dict[str, Any]) -> str:
    if row["value"] is None:
        return "—"
    if row["limit"] == 0:
        return f"{row['value']:,}"
    # A cost in µs (the metrics rows) is no ratio.
    return f"{row['value']:.2f} µs" if row["target"].endswith("(µs)") else f"{row['value']:.2f}×"


def targets_table(rows: list[dict[str, Any]]) -> str:
    body = [[GROUPS.get(row["group"], row["group"]), row["target"], value_cell(row), verdict(row)] for row in rows]
    return table(["store", "target (ratio of this run's figures)", "this run", "met?"], body, right_from=2, right_to=3)


def machine_paragraph(peers: dict[str, Any], http: dict[str, Any]) -> str:
    m = peers["machine"]
    pg = m.get("postgresql_settings", {})
    p = m["packages"]
    commit = f"`{m['commit']}`" + (" plus uncommitted changes" if m.get("dirty") else "")
    cpu = f" ({m['cpu']})" if m.get("cpu") else ""
    memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    load_before = m["load_average"]["before"][0]
    load_after = max(m["load_average"]["after"][0], http["machine"]["load_average"]["after"][0])
    s = peers["settings"]
    hs = http["settings"]
    return (
        f"Run on {m['date']} by `make bench` (peers.py {peers['wall_seconds']} s, http_stack.py "
        f"{http['wall_seconds']} s) at commit {commit}. Machine: {m['cpus']} cores{cpu}{memory}, "
        f"{m['platform']}; load average {load_before} before, {load_after} after. "
        f"Python {m['python']}, Django {m['django']}; PostgreSQL {m['postgresql']} "
        f"(`synchronous_commit = {pg.get('synchronous_commit')}`, `fsync = {pg.get('fsync')}`, "
        f"`shared_buffers = {pg.get('shared_buffers')}`); Redis {m['redis']}; psycopg {p.get('psycopg')} "
        f"({p.get('psycopg implementation', '?')}), redis-py {p.get('redis')}"
        f"{' with hiredis ' + p['hiredis'] if p.get('hiredis') else ' without hiredis'}, "
        f"django-redis {p.get('django-redis')}, DRF {p.get('djangorestframework')}, "
        f"django-ratelimit {p.get('django-ratelimit')}, limits {p.get('limits')}.\n\n"
        f"One process: {s['rounds']} interleaved rounds × {s['seconds']} s per adapter and scenario; "
        f"fresh keys: {s['fresh_keys']:,} keys in turn. {s['processes']} processes: {s['mp_rounds']} "
        f"run{'s' if s['mp_rounds'] > 1 else ''} × "
        f"{s['mp_seconds']} s per adapter. HTTP: {hs['rounds']} rounds × {hs['seconds']} s per view and "
        f"scenario, {hs['keys']:,} clients."
    )


def adapter_rows(peers: dict[str, Any], store: str) -> list[list[str]]:
    single, many, trips = peers["single"], peers["processes"], peers["round_trips"]
    rows = []
    for name, meta in peers["adapters"].items():
        if meta["store"] != store:
            continue
        fresh, hot, mp, rt = single["fresh"][name], single["hot"][name], many.get(name, {}), trips.get(name, {})
        label = f"**{name}**" if meta["family"] == "ours" else name
        if mp.get("allowed") is None:
            admitted = "—"
        else:
            over = mp["over_admitted"]
            admitted = f"{mp['admitted']:,} / {mp['allowed']:,}" + (f" (**+{over:,.0f}**)" if over else "")
        rows.append(
            [
                label,
                meta["algorithm"],
                meta["config"],
                f"{rt.get('sql', 0) + rt.get('redis', 0):.3g}",
                _n(fresh["p50_us"]),
                _n(fresh["p99_us"]),
                _n(fresh["per_second"]),
                _n(hot["p50_us"]),
                _n(hot["p99_us"]),
                f"{_n(hot['per_second'])} ({100 * hot['allowed_share']:.0f} %)",
                _n(single.get("new", {}).get(name, {}).get("p50_us")),
                _n(mp.get("per_second")),
                admitted,
            ]
        )
    return rows


ADAPTER_HEADER = [
    "adapter",
    "algorithm",
    "process",
    "round trips",
    "fresh keys p50 µs",
    "p99 µs",
    "decisions/s",
    "hot key p50 µs",
    "p99 µs",
    "decisions/s (allowed)",
    "new keys p50 µs",
    "8 processes, hot key: decisions/s",
    "admitted / allowed",
]


def scale_section(scale: dict[str, Any] | None) -> str:
    if not scale:
        return ""
    rows = []
    for part in (scale["small"], scale["large"]):
        ours, select = part["tokenbucket db"], part["SELECT 1"]
        rows.append(
            [
                f"{part['rows']:,}",
                _n(ours["p50_us"]),
                _n(ours["p99_us"]),
                _n(select["p50_us"]),
                _n(part["bytes_per_row"]),
                _n(part["rows_added"]),
            ]
        )
    small, large = scale["small"], scale["large"]
    raw = large["tokenbucket db"]["p50_us"] / small["tokenbucket db"]["p50_us"]
    normalized = raw / (large["SELECT 1"]["p50_us"] / small["SELECT 1"]["p50_us"])
    header = ["rows", "p50 µs", "p99 µs", "SELECT 1 p50 µs (same rounds)", "bytes per row", "rows added"]
    return (
        "### Stored keys: 10^3 vs "
        f"{large['rows']:,} rows (database backend)\n\n"
        + table(header, rows)
        + f"\n\nRandom stored keys (loaded in {scale['load_seconds']} s). The two sizes run one after the "
        f"other, so SELECT 1 in the same rounds is the yardstick: {raw:.2f}× raw, {normalized:.2f}× "
        'normalized by it. "rows added" counts rows the decisions inserted (0: every key was found).\n'
    )


def memory_section(memory: dict[str, Any]) -> str:
    if not memory:
        return ""
    rows = [[name, _n(item["bytes"]), _n(item["keys"])] for name, item in memory.items()]
    return "### Redis memory per key (after 10 allowed decisions)\n\n" + table(
        ["limiter", "bytes (`MEMORY USAGE`)", "keys"], rows
    )


def http_section(http: dict[str, Any]) -> str:
    single, trips = http["single"], http["round_trips"]
    rows = []
    for name, view in http["views"].items():
        fresh, hot, rt = single["fresh"][name], single["hot"][name], trips[name]
        base = view["family"] == "baseline"
        rows.append(
            [
                f"**{name}**" if view["family"] == "ours" else name,
                view["store"],
                view["config"],
                f"{rt['sql']:.0f} + {rt['redis']:.0f}",
                _n(fresh["p50_us"]),
                _n(fresh["p99_us"]),
                "—" if base else _n(fresh["overhead_us"]),
                _n(hot["p50_us"]),
                "—" if base else _n(hot["overhead_us"]),
                f"{100 * hot['allowed_share']:.0f} %",
            ]
        )
    header = [
        "view",
        "store",
        "process",
        "round trips (SQL + Redis)",
        "allowed: p50 µs",
        "p99 µs",
        "overhead µs",
        "hot p50 µs",
        "hot overhead µs",
        "hot allowed",
    ]
    ratios = [[row["ours"], row["peer"], _n(row["fresh"], 2), _n(row["hot"], 2)] for row in http["comparisons"]]
    return (
        "### Through the HTTP stack\n\n"
        + table(header, rows, right_from=3)
        + "\n\nOverhead ratios, ours / theirs (below 1: ours adds less):\n\n"
        + table(["ours", "against", "allowed", "hot key"], ratios, right_from=2)
    )


def render(peers: dict[str, Any], http: dict[str, Any]) -> str:
    configs = sorted({meta["config"] for meta in peers["adapters"].values() if meta["family"] == "ours"})
    parts = [
        "<!-- Generated by benchmarks/suite/report.py from the JSON of one `make bench` run: edit the script, "
        "not this section. -->",
        machine_paragraph(peers, http),
        "### Targets of issues 19 and 35\n\n" + targets_table(peers["targets"] + http["targets"]),
        "### PostgreSQL\n\n" + table(ADAPTER_HEADER, adapter_rows(peers, "postgresql"), right_from=3),
        "### Redis\n\n" + table(ADAPTER_HEADER, adapter_rows(peers, "redis"), right_from=3),
        f'"process" names the worker: each adapter of ours ran in its own ({", ".join(configs)}), '
        'configured by its own `TOKENBUCKET`; the others shared `peers`. "decisions/s" of one process is '
        'computed from the time spent inside `decide()`; "allowed" is the share of the hot key\'s decisions '
        "that admitted. Admitted and allowed are summed over the runs; **+N** is over-admission.",
        scale_section(peers.get("scale")),
        memory_section(peers.get("memory", {})),
        http_section(http),
    ]
    return "\n\n".join(part.strip() for part in parts if part) + "\n"


def replace_region(page: Path, content: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between the markers ``begin`` and ``end`` of ``page`` with ``content``."""
    text = page.read_text()
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{page}: needs exactly one {begin} ... {end} region")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    page.write_text(f"{head}{begin}\n{content}{end}{tail}")


def save(result: dict[str, Any], content: str, json_path: Path | None, docs: Path | None, begin: str, end: str) -> None:
    """Write a run's ``result`` as JSON to ``json_path`` and its Markdown ``content`` into the
    ``begin`` ... ``end`` region of the page ``docs`` (each when given)."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    if docs:
        replace_region(docs, content, begin, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peers", help="the JSON of benchmarks/suite/peers.py")
    parser.add_argument("http", help="the JSON of benchmarks/suite/http_stack.py")
    parser.add_argument("--run-id", help="the run both must come from (make bench passes it)")
    parser.add_argument("--docs", metavar="PAGE", help="rewrite the bench region of this Markdown page")
    args = parser.parse_args()
    peers, http = load(args.peers, "peers"), load(args.http, "http")
    ids = {peers.get("run_id"), http.get("run_id")}
    if args.run_id is not None and ids != {args.run_id}:
        raise SystemExit(f"the JSON files come from runs {sorted(map(str, ids))}, not from run {args.run_id}")
    if len(ids) != 1 or None in ids:
        raise SystemExit("the two JSON files do not come from the same run (their run_id differ or are missing)")
    if args.docs and (peers["settings"].get("quick") or http["settings"].get("quick")):
        raise SystemExit(f"a --quick run is too short for {args.docs}: run make bench")
    print("Targets of issues 19 and 35 (ratios from this run):")
    for row in peers["targets"] + http["targets"]:
        mark = "met" if row["met"] else ("n/a" if row["met"] is None else "MISSED")
        print(f"  {mark:6} {value_cell(row):>8}  {GROUPS.get(row['group'], row['group'])}: {row['target']}")
    if args.docs:
        replace_region(Path(args.docs), render(peers, http))
        print(f"wrote the tables of {args.docs}")


if __name__ == "__main__":
    sys.exit(main())
