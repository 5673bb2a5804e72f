#!/usr/bin/env python3
"""Where creates spend their time as a host fills: the launch steps bench/density.py kept.

bench/density.py keeps, for every create over 250 ms and every 50th create, the backend's
launch_phases() (Python's steps and shoal-init's, in ms) plus the create's time outside them
(the run's "launch" entry). This script reads such a JSON and draws, per run:

- left: the median time of each step group in ordinary creates, per tenth of the fill (stacked);
- right: the slow creates (> 250 ms), each as a stacked bar of the same groups, by N.

It writes <json>-launch.png next to the JSON (or --png) and prints the groups' medians and the slow
creates' worst steps as a table.

    python bench/launch_steps.py bench/results/density-launch.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# launch steps (ContainerBackend.LAUNCH_STEPS, plus "outside") in groups a reader can follow
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("outside the backend (client, Host, layer mounts)", ("outside",)),
    ("Python: checks, meta, cgroup dirs", ("checks", "meta", "cgroup_dirs", "args")),
    ("fork/exec of shoal-init", ("exec",)),
    ("supervisor: fork, upper tmpfs, socket", ("forked", "upper", "socket")),
    ("clone (pid/uts/ipc/net namespaces)", ("clone",)),
    ("cgroup joins", ("joined",)),
    ("init: wake-up, cgroup ns", ("go", "cgroupns")),
    ("overlay", ("overlay",)),
    ("/dev, /proc, root switch", ("rootfs",)),
    ("loopback, seccomp, capabilities", ("net", "hardened")),
    ("hand-back to Python", ("ready", "returned", "pids")),
)
COLORS = ("#999999", "#1f77b4", "#aec7e8", "#ff7f0e", "#d62728", "#9467bd", "#c5b0d5", "#2ca02c", "#98df8a",
          "#8c564b", "#e377c2")


def grouped(steps: dict[str, float]) -> list[float]:
    """Milliseconds per group; a step no group names (a newer build's) goes to the Python group."""
    known = {s for _, members in GROUPS for s in members}
    out = [sum(steps.get(s, 0.0) for s in members) for _, members in GROUPS]
    out[1] += sum(v for k, v in steps.items() if k not in known)
    return out


def runs_with_launch(res: dict) -> list[tuple[str, dict]]:
    out = []
    for kind, prof in res.get("profiles", {}).items():
        for side, d in prof.get("sides", {}).items():
            for k, run in enumerate(d.get("runs", [])):
                if run.get("launch"):
                    out.append((f"{kind} {side} run {k + 1} (held {run.get('n_held')})", run["launch"]))
    return out


def table(runs: list[tuple[str, dict]]) -> str:
    lines = []
    for label, launch in runs:
        lines.append(f"## {label}")
        tenths = launch["ordinary_by_tenth"]
        if tenths:
            first, last = tenths[0], tenths[-1]
            lines.append(f"| step group | p50 ms, N ≤ {first['n_upto']} | p50 ms, last tenth (N ≤ {last['n_upto']}) |")
            lines.append("|---|---|---|")
            for (name, _), a, b in zip(GROUPS, grouped(first["p50_ms"]), grouped(last["p50_ms"]), strict=True):
                lines.append(f"| {name} | {a:.2f} | {b:.2f} |")
        lines.append(f"slow creates (> 250 ms) with steps: {launch['slow_creates']}; "
                     f"by worst step: {launch['slow_by_worst_step']}")
        lines.append("")
    return "\n".join(lines)


def render(runs: list[tuple[str, dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(14, 4.0 * len(runs)), squeeze=False)
    for row, (label, launch) in enumerate(runs):
        ax = axes[row][0]
        tenths = launch["ordinary_by_tenth"]
        xs = [t["n_upto"] for t in tenths]
        ys = list(zip(*[grouped(t["p50_ms"]) for t in tenths], strict=True)) if tenths else []
        if ys:
            ax.stackplot(xs, *ys, labels=[g for g, _ in GROUPS], colors=COLORS, alpha=0.9)
        ax.set_title(f"{label}: ordinary creates, median per step group")
        ax.set_xlabel("live sandboxes N (end of each tenth of the fill)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        if row == 0:
            ax.legend(fontsize=7, loc="upper left")
        ax = axes[row][1]
        slow: list[dict[str, Any]] = sorted(launch["slowest"], key=lambda x: x["n"])
        if slow:
            pos = list(range(len(slow)))
            bottom = [0.0] * len(slow)
            for g, (name, _) in enumerate(GROUPS):
                h = [grouped(x["steps"])[g] for x in slow]
                ax.bar(pos, h, bottom=bottom, color=COLORS[g], width=0.8, label=name)
                bottom = [b + v for b, v in zip(bottom, h, strict=True)]
            step = max(1, len(slow) // 12)
            ax.set_xticks(pos[::step], [f"{x['n']:,}" for x in slow][::step], rotation=45, fontsize=7)
        ax.set_title(f"{label}: the {len(slow)} slowest creates (> 250 ms) by N, split by step group")
        ax.set_xlabel("N at the create")
        ax.set_ylabel("ms")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="a bench/density.py result with launch steps")
    ap.add_argument("--png", type=Path, default=None, help="default: <json stem>-launch.png beside it")
    a = ap.parse_args(argv)
    res = json.loads(a.json.read_text())
    runs = runs_with_launch(res)
    if not runs:
        print(f"{a.json}: no run has launch steps (bench/density.py keeps them from December 2026 on)",
              file=sys.stderr)
        return 1
    png = a.png or a.json.with_name(a.json.stem + "-launch.png")
    render(runs, png)
    print(table(runs))
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
