"""The table of scripts/gpu_bench_disagg.sh: every case's bench JSON and both servers' /metrics
in $OUT -> disagg.json and disagg.md (per request: admission bytes, the decode side's host
memory, remote bytes read; TTFT, TPOT, output tok/s; each against full transfer over the same
transport)."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def metrics(path: Path) -> dict[str, float]:
    """Samples summed over labels; {} if the file is missing or empty."""
    out: dict[str, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r"\{.*\}", "", name)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def row(out_dir: Path, name: str) -> dict | None:
    bench_path = out_dir / f"bench_{name}.json"
    if not bench_path.exists():
        return None
    bench = json.loads(bench_path.read_text())
    d = metrics(out_dir / f"metrics_{name}_decode.txt")
    admitted = d.get("oasiskv:disagg_admissions_total", 0.0)
    finished = d.get("oasiskv:disagg_request_host_bytes_count", 0.0)
    per = lambda v, n: v / n if n else None  # noqa: E731
    mode, transport, *gbps = name.split("_")
    return {"case": name, "mode": mode, "transport": transport, "link_gbps": gbps[0][:-1] if gbps else None,
            "completed": bench["completed"], "failed": bench["failed"],
            "admission_bytes_per_request": per(d.get("oasiskv:disagg_admission_bytes_total", 0.0), admitted),
            "decode_host_bytes_per_request": per(d.get("oasiskv:disagg_request_host_bytes_sum", 0.0), finished),
            "decode_host_bytes_peak": d.get("oasiskv:disagg_host_bytes_peak"),
            "remote_bytes_per_request": per(d.get("oasiskv:disagg_remote_read_bytes_total", 0.0), admitted),
            "items_no_room": d.get("oasiskv:disagg_items_no_room_total", 0.0),
            "items_evicted_per_request": per(d.get("oasiskv:disagg_items_evicted_total", 0.0), admitted),
            "mean_ttft_ms": bench["mean_ttft_ms"], "median_ttft_ms": bench["median_ttft_ms"],
            "median_tpot_ms": bench["median_tpot_ms"], "output_throughput": bench["output_throughput"]}


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", type=int, default=0)
    ap.add_argument("--input-len", type=int, default=0)
    ap.add_argument("--output-len", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--tcp-tls", default=None, help="the UCX_TLS the tcp cases ran with")
    args = ap.parse_args()
    names = sorted(p.name[len("bench_"):-len(".json")] for p in args.out_dir.glob("bench_*.json"))
    rows = [r for r in (row(args.out_dir, n) for n in names) if r is not None]
    full = {r["transport"]: r for r in rows if r["mode"] == "full"}
    lines = [f"{args.prompts} x {args.input_len}-token prompts, {args.output_len} out, {args.model}, K = {args.top_k}"
             + (f"; tcp: UCX_TLS={args.tcp_tls}" if args.tcp_tls else ""), "",
             "| case | done | admission MB / req | x fewer | decode host MB / req (its peak) | decode host GB (load's peak) "
             "| x less | remote MB / req | items given back / req | TTFT mean ms | TPOT median ms | out tok/s | vs full |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = full.get(r["transport"])
        ratio = lambda k: (base[k] / r[k] if base and base.get(k) and r.get(k) else None)  # noqa: E731
        speed = (r["output_throughput"] / base["output_throughput"] if base and base["output_throughput"] else None)
        r.update(admission_fewer=ratio("admission_bytes_per_request"),
                 host_less=ratio("decode_host_bytes_peak"), throughput_vs_full=speed)
        mb = lambda v: None if v is None else v / 1e6  # noqa: E731
        lines.append(f"| {r['case']} | {r['completed']}/{r['completed'] + r['failed']} "
                     f"| {fmt(mb(r['admission_bytes_per_request']), ',.0f')} | {fmt(r['admission_fewer'], '.2f')} "
                     f"| {fmt(mb(r['decode_host_bytes_per_request']), ',.0f')} "
                     f"| {fmt(None if r['decode_host_bytes_peak'] is None else r['decode_host_bytes_peak'] / 1e9, ',.2f')} "
                     f"| {fmt(r['host_less'], '.2f')} "
                     f"| {fmt(mb(r['remote_bytes_per_request']), ',.0f')} "
                     f"| {fmt(r['items_evicted_per_request'], ',.0f')} | {r['mean_ttft_ms']:,.0f} "
                     f"| {r['median_tpot_ms']:.1f} | {r['output_throughput']:.1f} | {fmt(speed, '.3f')} |")
    (args.out_dir / "disagg.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                                   if k != "out_dir"}, "rows": rows}, indent=2))
    (args.out_dir / "disagg.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
