#!/usr/bin/python3
"""Renders an mpipe --trace file as a PNG timeline: one row per rank, forward and
backward of each micro-batch as labelled boxes, waits in grey, so the GPipe (or 1F1B)
diagram of a real run can be looked at; below each rank its communication rows, where
each send (from its posting to its completion) and each gradient sum overlaps the
compute above it.

    /usr/bin/python3 scripts/plot_timeline.py trace.json timeline.png [--step N]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#8172b3", "allreduce": "#55a868",
          "optimizer": "#937860", "send activation": "#a1c9f4", "send gradient": "#ffb482",
          "gradient sum": "#8de5a1", "tied-weight sum": "#64b5cd"}
WAITS = {"wait activation", "wait gradient", "wait sends"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--step", type=int, help="draw only this step (default: every traced step)")
    a = ap.parse_args()
    events = json.load(open(a.trace))["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e.get("ph") == "M" and e["name"] == "thread_sort_index"}
    boxes = [e for e in events if e.get("ph") == "X" and (a.step is None or e["args"]["step"] == a.step)]
    if not boxes:
        raise SystemExit(f"no events in {a.trace}" + (f" for step {a.step}" if a.step is not None else ""))
    start = min(e["ts"] for e in boxes)
    ranks = sorted(names, key=lambda r: order.get(r, r))
    row = {r: len(ranks) - 1 - i for i, r in enumerate(ranks)}
    span = (max(e["ts"] + e["dur"] for e in boxes) - start) / 1e3
    fig, ax = plt.subplots(figsize=(max(8, min(24, span / 8)), 0.6 * len(ranks) + 1.5))
    for e in boxes:
        x, w = (e["ts"] - start) / 1e3, e["dur"] / 1e3
        if e["cat"] in WAITS:
            ax.broken_barh([(x, w)], (row[e["tid"]] - 0.15, 0.3), color="#cccccc")
            continue
        color = COLORS.get(e["cat"])
        if color is None:
            continue
        ax.broken_barh([(x, w)], (row[e["tid"]] - 0.4, 0.8), color=color, edgecolor="white", linewidth=0.5)
        label = e["args"]["micro_batch"] if e["args"]["micro_batch"] >= 0 else e["args"].get("layer", -1)
        if label >= 0 and w > span / 150:
            ax.text(x + w / 2, row[e["tid"]], str(label), ha="center", va="center", fontsize=7, color="black")
    ax.set_yticks([row[r] for r in ranks], [names[r] for r in ranks])
    ax.set_xlabel("milliseconds")
    title = f"step {a.step}" if a.step is not None else "traced steps"
    ax.set_title(f"mpipe timeline, {title}: forward (blue), backward (orange), recompute (purple), "
                 f"allreduce (green), optimizer (brown), waiting (grey);\ncommunication rows: sends of "
                 f"activations (light blue) and gradients (light orange), gradient sums over replicas "
                 f"(light green, by layer), tied-weight sums (teal)", fontsize=9)
    ax.set_xlim(0, span)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    # Each rank has its compute row and its communication rows ("rank r: ...: communication"):
    # the ranks are the compute rows.
    rank_count = sum(1 for name in names.values() if ": communication" not in name)
    print(f"wrote {a.png}: {rank_count} ranks ({len(ranks)} rows: compute and communication), "
          f"{len(boxes)} events, {span:.1f} ms")


if __name__ == "__main__":
    main()
