"""Results out: one JSON per run, PNG plots, a ratio table and `bench/RESULTS.md`.

Mental model: a `SystemResult` is one system at one or more rates (the sweep), each rate holding
its `Summary` and the raw per-request latencies for the CDFs. The headline row of a system is its
run at the knee (the highest rate whose attainment meets the target) or its only run. Ratios are
taken against the first system present (ferry disaggregated by default), so "x vs peer" reads as
ferry's goodput / the peer's goodput. Plots need matplotlib; without it they are skipped.
"""

from __future__ import annotations

import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import format_table
from bench.loadgen.metrics import ClientRecord, Summary
from bench.loadgen.probe import PROBE_PROMPT, ProbeAnswer
from bench.loadgen.stages import STAGE_COLUMNS, stage_row

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RatePoint:
    rate_rps: float
    summary: Summary
    ttft_s: list[float]
    e2el_s: list[float]
    # worker -> resident MiB (before the rate, after it), from the server's /health; {} if it says none
    memory_mib: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    # batch rows preempted and resumed during the rate (the ingress's counts); None if it says none
    preemptions: tuple[int, int] | None = None
    # where the time went, from the server's own timelines (bench/loadgen/stages.py); None without
    stages: dict[str, Any] | None = None
    # healthy workers per kind at the end of the rate (the replica counts when they are scaled); {} if none said
    workers: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def of(rate: float, summary: Summary, records: list[ClientRecord],
           memory_mib: dict[str, tuple[int | None, int | None]] | None = None,
           preemptions: tuple[int, int] | None = None, stages: dict[str, Any] | None = None,
           workers: dict[str, int] | None = None) -> "RatePoint":
        ok = [r for r in records if r.success and r.chunk_s]
        return RatePoint(rate, summary, [r.ttft_s for r in ok], [r.e2el_s for r in ok], memory_mib or {}, preemptions,
                         stages, workers or {})

    def worker_counts(self) -> str | None:
        """"prefill/decode" (or "colocated N") healthy at the end of the rate; None if not reported."""
        w = self.workers
        if not w:
            return None
        if "colocated" in w:
            return f"colocated {w['colocated']}"
        return f"{w.get('prefill', 0)}/{w.get('decode', 0)}"


@dataclass(slots=True)
class SystemResult:
    name: str
    points: list[RatePoint] = field(default_factory=list)
    skipped: str = ""  # why the system did not run
    probe: ProbeAnswer | None = None  # its answer to the greedy probe, asked before measuring

    def knee(self, target: float) -> RatePoint | None:
        """Highest rate meeting the attainment target; else the best goodput seen."""
        if not self.points:
            return None
        meeting = [p for p in self.points if p.summary.attainment >= target]
        return max(meeting, key=lambda p: p.rate_rps) if meeting else max(self.points, key=lambda p: p.summary.goodput)


def machine() -> str:
    import os
    return f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}"


def table(results: list[SystemResult], target: float, bound_rps: float | None = None,
          compute_rps: float | None = None) -> str:
    """The headline row of each system; with the machine's prefill bound (bench/loadgen/bound.py),
    also its knee as a fraction of it ("-" when no rate met the attainment target), and of the
    compute bound (prefill + decode) when that was measured."""
    bounds = [b for b in (bound_rps, compute_rps) if b is not None]
    ran = [r for r in results if r.points]
    base = ran[0].knee(target) if ran else None
    rows: list[list[Any]] = []
    for r in results:
        p = r.knee(target)
        if p is None:
            rows.append([r.name, "skipped", *[None] * (7 + len(bounds))])
            continue
        s = p.summary
        ratio = (base.summary.goodput / s.goodput) if base and s.goodput > 0 else None
        row = [r.name, p.rate_rps, round(s.goodput, 3), round(s.attainment, 3), round(s.output_throughput, 1),
               round(s.ttft_ms["p99"], 1), round(s.tpot_ms["p99"], 1), round(s.e2el_ms["p99"], 1),
               round(ratio, 2) if ratio is not None else None]
        row += [round(p.rate_rps / b, 2) if s.attainment >= target else "-" for b in bounds]
        rows.append(row)
    head = ["system", "rate rps", "goodput rps", "attain", "out tok/s", "P99 TTFT ms", "P99 TPOT ms",
            "P99 E2E ms", f"{ran[0].name if ran else 'base'} / system goodput"]
    if bound_rps is not None:
        head.append("knee / prefill bound")
    if compute_rps is not None:
        head.append("knee / compute bound")
    return format_table(head, rows)


def memory_table(results: list[SystemResult]) -> str | None:
    """Each worker's resident memory before and after each rate (servers whose /health reports it),
    or None when no server did. A worker still growing at the end of a long rate is worth a look."""
    rows: list[list[Any]] = []
    for r in results:
        for p in r.points:
            for worker, (before, after) in sorted(p.memory_mib.items()):
                change = after - before if before is not None and after is not None else None
                rows.append([r.name, p.rate_rps, p.summary.num_sent, worker, before, after, change])
    if not rows:
        return None
    return format_table(["system", "rate rps", "sent", "worker", "MiB before", "MiB after", "change MiB"], rows)


def stage_table(results: list[SystemResult]) -> str | None:
    """Per system and rate, where the time went (ferry's timelines; ms unless named); None when no
    server kept timelines."""
    rows = [[r.name, *stage_row(p.rate_rps, p.stages)] for r in results for p in r.points if p.stages]
    if not rows:
        return None
    return format_table(["system", *(name for name, _ in STAGE_COLUMNS)], rows)


def tenant_table(results: list[SystemResult]) -> str | None:
    """Each tenant's SLO attainment at each rate, with the batch rows the server preempted and
    resumed meanwhile; None unless some run had more than one tenant."""
    rows: list[list[Any]] = []
    for r in results:
        for p in r.points:
            if len(p.summary.tenants) < 2:
                continue
            pre = p.preemptions
            for name, t in sorted(p.summary.tenants.items()):
                rows.append([r.name, p.rate_rps, name, int(t["sent"]), int(t.get("ok", 0)), int(t["good"]),
                             round(t["attainment"], 3), round(t.get("ttft_p99_ms", 0.0), 1),
                             round(t.get("tpot_p99_ms", 0.0), 1), pre[0] if pre else None, pre[1] if pre else None])
    if not rows:
        return None
    return format_table(["system", "rate rps", "tenant", "sent", "ok", "good", "attain", "P99 TTFT ms", "P99 TPOT ms",
                         "preempted", "resumed"], rows)


def write_json(results: list[SystemResult], meta: dict[str, Any], path: Path) -> None:
    out = {"meta": meta, "systems": [{"name": r.name, "skipped": r.skipped,
                                      "probe": r.probe.to_dict() if r.probe else None, "points": [
        {"rate_rps": p.rate_rps, **p.summary.to_dict(),
         "memory_mib": {w: {"before": b, "after": a} for w, (b, a) in p.memory_mib.items()},
         "preemptions": None if p.preemptions is None else dict(zip(("preempted", "resumed"), p.preemptions)),
         "stages": p.stages, "workers": p.workers}
        for p in r.points]} for r in results]}
    path.write_text(json.dumps(out, indent=1, default=str))


def plot(results: list[SystemResult], target: float, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display on a server
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no plots")
        return []
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        p = r.knee(target)
        for ax, vals in zip(axes, (p.ttft_s, p.e2el_s) if p else ((), ())):
            if vals:
                xs = sorted(v * 1000 for v in vals)
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{r.name} @ {p.rate_rps:g} rps")
    for ax, what in zip(axes, ("TTFT", "E2E latency")):
        ax.set_xlabel(f"{what} (ms)"), ax.set_ylabel("CDF"), ax.set_xscale("log"), ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing ran: no legend (matplotlib warns otherwise)
            ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.points:
            pts = sorted(r.points, key=lambda p: p.rate_rps)
            ax.plot([p.rate_rps for p in pts], [p.summary.attainment for p in pts], marker="o", label=r.name)
    ax.axhline(target, ls="--", c="gray")
    ax.set_xlabel("request rate (rps)"), ax.set_ylabel("SLO attainment"), ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "attainment_vs_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def write_results_md(results: list[SystemResult], meta: dict[str, Any], target: float, path: Path,
                     notes: list[str]) -> None:
    skipped = [f"- {r.name}: skipped: {r.skipped}" for r in results if r.skipped]
    lines = ["# ferry bench serve: results", "", "Generated by the harness (`bench/loadgen/report.py`); do not edit by hand.",
             "", f"- machine: {meta['machine']}", f"- command: `{meta['command']}`",
             f"- workload: {meta['workload']}", f"- SLOs: {meta['slo']}; knee attainment target {target:g}; rates {meta.get('rates', '?')}",
             f"- when: {meta['when']}", *_bound_lines(meta), "", "```",
             table(results, target, _bound_rps(meta), _bound_rps(meta, "compute_rps")), "```", "",
             "Goodput = requests/s meeting every SLO (vLLM `bench serve` definition); P99s are over completed",
             "requests at the rate shown (the knee of a sweep, or the single rate). The column '... / system",
             "goodput': the first system's goodput divided by this system's.", ""]
    sweep = [[r.name, p.rate_rps, p.summary.num_sent, p.summary.completed, round(p.summary.goodput, 3),
              round(p.summary.attainment, 3), round(p.summary.ttft_ms["p99"], 1), round(p.summary.tpot_ms["p99"], 1),
              round(p.summary.itl_ms["p99"], 1), round(p.summary.e2el_ms["p99"], 1), p.worker_counts()]
             for r in results for p in sorted(r.points, key=lambda p: p.rate_rps)]
    if len(sweep) > len([r for r in results if r.points]):  # a sweep: show every rate, not just the knee
        lines += ["## Every rate", "", "Last column: healthy prefill/decode workers at the end of the rate (`/health`).",
                  "", "```", format_table(
            ["system", "rate rps", "sent", "ok", "goodput rps", "attain", "P99 TTFT ms", "P99 TPOT ms",
             "P99 ITL ms", "P99 E2E ms", "workers P/D"], sweep), "```", ""]
    failed = [f"- {r.name} at {p.rate_rps:g} rps: {p.summary.failures_text()} of {p.summary.num_sent} sent"
              for r in results for p in sorted(r.points, key=lambda p: p.rate_rps) if p.summary.failed]
    if failed:
        lines += ["## Failed requests", "", "Why each rate's failed requests failed: refused (429/503) with the reason in the error",
                  "body, refused without one, lost (still unanswered at the time bound), or another error.", "", *failed, ""]
    tenants = tenant_table(results)
    if tenants:
        lines += ["## Tenants", "", "SLO attainment per tenant; batch rows preempted and resumed (the ingress's counts) during",
                  "each rate (from `/health`).", "", "```", tenants, "```", ""]
    memory = memory_table(results)
    if memory:
        lines += ["## Worker memory", "", "Resident MiB of each worker before and after each rate (from `/health`).",
                  "", "```", memory, "```", ""]
    probes = [f"- {r.name}: {r.probe.text!r}" + ("" if r.probe.sensible else f" (not sensible: {r.probe.why})")
              for r in results if r.probe]
    if probes:
        lines += ["## Greedy probe", "", f"Each system's answer to {PROBE_PROMPT!r} (greedy, at most 12 tokens), asked "
                  "before it was measured; a system whose answer has no words is not measured.", "", *probes, ""]
    if skipped:
        lines += ["## Systems not measured", "", *skipped, ""]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    path.write_text("\n".join(lines))


def _bound_rps(meta: dict[str, Any], key: str = "rps") -> float | None:
    bound = meta.get("prefill_bound")
    return float(bound[key]) if bound and bound.get(key) else None


def _bound_lines(meta: dict[str, Any]) -> list[str]:
    b = meta.get("prefill_bound")
    if not b:
        return []
    return [f"- prefill bound: {b['rps']:.3f} rps = {b['prefill_tok_s']:.0f} prefill tokens/s (ferry's engine, "
            f"{b['dtype']}, {b['threads']} threads, {b['prompt_tokens']}-token prompts) / {b['mean_prompt_tokens']:.0f} "
            "mean prompt tokens: the highest rate any system could sustain here; the column 'knee / prefill bound': "
            "each knee as a fraction of it", *_compute_bound_lines(b)]


def _compute_bound_lines(b: dict[str, Any]) -> list[str]:
    if not b.get("compute_rps"):
        return []
    return [f"- compute bound (prefill + decode): {b['compute_rps']:.3f} rps = 1 / ({b['mean_prompt_tokens']:.0f} / "
            f"{b['prefill_tok_s']:.0f} + {b['mean_output_tokens']:.0f} mean output tokens / {b['decode_tok_s']:.0f} "
            f"decode tokens/s at {b['decode_rows']} rows, decode-only steps): the rate at which prefill and decode "
            "alone take every core; the column 'knee / compute bound': each knee as a fraction of it"]

