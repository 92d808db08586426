"""PNG plots of SLO attainment vs request rate, one file per trace (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_attainment(figures: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, tr in figures["traces"].items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for policy, points in tr["attainment"].items():
            rates = sorted(points)
            ax.plot(rates, [points[r] for r in rates], marker="o", label=f"{policy} (goodput {tr['goodput_rps'][policy]:g})")
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        slo = tr["slo"]
        ax.set_title(f"{name}: TTFT {slo['ttft_ms']:.0f} ms, TPOT {slo['tpot_ms']:.0f} ms (P99 targets)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("fraction meeting both SLOs")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
        path = out_dir / f"attainment_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths
