#!/usr/bin/env python3
"""Where a pipeline run's time goes, per stage, from its --summary and --trace files.

    ladder_report.py SUMMARY.json TRACE.json [LABEL]

Prints one row per stage: compute (forward, backward, recompute), the point-to-point wait
split by cause, the progress thread's CPU time, and the run's measured bubble beside the
one simulated from its own action times. A wait for a message is split at the moment the
neighbour posted it: before that the neighbour was late (its compute, or its own waits:
the pipeline's shape and the partition's balance); after it, the transfer itself and any
time the message had arrived but was not yet seen (progress), which a trace cannot tell
apart. With single-copy a transfer of a micro-batch's activation takes well under a
millisecond, so a large "after post" is a message seen late.

Used by scripts/bench_pipeline.sh (table 1b) and scripts/scaling_check.sh.
"""
import collections
import json
import sys


def main():
    summary = json.load(open(sys.argv[1]))
    events = json.load(open(sys.argv[2]))
    label = sys.argv[3] if len(sys.argv) > 3 else ""
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in spans})
    n_steps = max(len(steps), 1)
    # (rank, kind) -> (step, micro-batch) -> event; kinds: SF SB (sends) RF RB (waits)
    by = collections.defaultdict(dict)
    for e in spans:
        kind = e["name"][:2]
        if kind in ("SF", "SB", "RF", "RB"):
            by[(e["args"]["rank"], kind)][(e["args"]["step"], e["args"]["micro_batch"])] = e
    ranks = sorted({e["args"]["rank"] for e in spans})
    stages = summary["stages"]
    # A wait on rank r for an activation (RF) was sent by the rank of the stage before (SF);
    # for a gradient (RB), by the stage after (SB). One replica: rank = stage.
    late = collections.defaultdict(float)
    after = collections.defaultdict(float)
    waits = collections.defaultdict(float)
    for rank in ranks:
        for wait, send, peer in (("RF", "SF", rank - 1), ("RB", "SB", rank + 1)):
            for key, w in by[(rank, wait)].items():
                s = by[(peer, send)].get(key)
                w0, w1 = w["ts"], w["ts"] + w["dur"]
                waits[rank] += w1 - w0
                if s is None:
                    continue
                post = s["ts"]
                late[rank] += max(0.0, min(post, w1) - w0)
                after[rank] += w1 - max(post, w0) if post < w1 else 0.0
    phases = {p["stage"]: p for p in summary.get("phase_s", [])}
    cpu = summary.get("cpu_s_per_rank", [])
    progress = summary.get("progress_thread_cpu_s_per_rank", [])
    step_ms = 1e3 * summary["step_time_s"]
    print(f"{label}: step {step_ms:.1f} ms (median), bubble measured {100 * summary['bubble_fraction']:.1f}% against "
          f"{100 * summary['simulated_bubble']:.1f}% simulated with the run's action times "
          f"(excess {100 * (summary['bubble_fraction'] - summary['simulated_bubble']):+.1f} points), "
          f"{100 * summary['theoretical_bubble']:.1f}% at unit costs")
    print(f"  {'stage':>5} {'compute':>9} {'p2p wait':>9} {'peer late':>10} {'after post':>11} {'progress thr.':>14}  (ms a step; "
          "CPU % of the rank's)")
    for stage in range(stages):
        p = phases.get(stage, {})
        mean = lambda name: 1e3 * p[name][1] if name in p else 0.0
        compute = mean("forward") + mean("backward") + mean("recompute")
        rank = stage  # the first replica's
        share = f"{100 * progress[rank] / cpu[rank]:.1f}%" if rank < len(cpu) and cpu[rank] > 0 else "-"
        print(f"  {stage:>5} {compute:9.1f} {mean('p2p_wait'):9.1f} {late[rank] / 1e3 / n_steps:10.1f} "
              f"{after[rank] / 1e3 / n_steps:11.2f} {share:>14}")


if __name__ == "__main__":
    main()
