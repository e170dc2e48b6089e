#!/usr/bin/python3
"""Turns a sweep CSV (scripts/sweep_microbatches.sh) into a PNG: throughput against M
for each schedule with the bound K x baseline x M/(M+K-1) drawn, and the measured
bubble against the theoretical (K-1)/(M+K-1).

    /usr/bin/python3 scripts/plot_sweep.py sweep.csv sweep.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path, png):
    rows = list(csv.DictReader(open(path)))
    if not rows:
        raise SystemExit(f"{path} has no rows")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    K, D = int(rows[0]["K"]), int(rows[0]["D"])
    for schedule in sorted({r["schedule"] for r in rows}):
        sel = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: int(r["M"]))
        ms = [int(r["M"]) for r in sel]
        left.plot(ms, [float(r["samples_per_s"]) for r in sel], "o-", label=f"{schedule}, K={K}")
        right.plot(ms, [100 * float(r["bubble"]) for r in sel], "o-", label=f"{schedule} measured")
    base = sorted(rows, key=lambda r: int(r["M"]))
    ms = sorted({int(r["M"]) for r in rows})
    baseline = {int(r["M"]): float(r["baseline_samples_per_s"]) for r in base}
    theory = {int(r["M"]): float(r["theoretical_bubble"]) for r in base}
    left.plot(ms, [baseline[m] for m in ms], "s--", color="grey", label="K=1 baseline")
    left.plot(ms, [K * baseline[m] * m / (m + K - 1) for m in ms], "k:", label="bound K·baseline·M/(M+K-1)")
    right.plot(ms, [100 * theory[m] for m in ms], "k:", label="theory (K-1)/(M+K-1)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches M")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("samples / s")
    left.set_title(f"throughput, {K} stages x {D} replica(s)")
    right.set_ylabel("bubble, % of step")
    right.set_title("pipeline bubble")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
