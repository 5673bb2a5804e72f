"""Every figure in README.md's tables (and the prose figures listed here) comes from a committed JSON.

The convention, kept by hand:

  * each README table that holds figures has a marker on one of the lines just before it:
        <!-- numbers: KEY (path/of/the.json) -->
    KEY names a renderer in TABLES below, which builds the expected rows from that JSON;
  * a README cell must hold the same numbers, in the same order and with the same rounding, as
    the rendered cell (words, bold and spacing are free); a row must exist for each rendered row;
  * a table with digits in its body and no marker fails the test (a figure without a file);
  * prose figures: each snippet rendered by PROSE must appear in README.md (spaces and ** ignored).

To refresh a table after re-running a benchmark:  python tests/test_docs_numbers.py KEY
prints the markdown rows to paste. Goals (targets, not measurements) are literal text here.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MARKER = re.compile(r"<!--\s*numbers:\s*(\S+)\s*\(([^)]+)\)\s*-->")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# Sections exempt from the marker rule (none today), and renderer keys allowed to lack a README table.
UNSOURCED_SECTIONS: dict[str, str] = {}
PENDING: set[str] = set()

MiB = 2**20


def load(path: str) -> dict:
    return json.loads((REPO / path).read_text())


def lr_str(x: float) -> str:
    """1e-4, 3e-5: the way the README writes learning rates."""
    return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.0e}")


def spread_cell(m: dict, fmt: str, scale: float = 1, unit: str = "") -> str:
    """median [min–max] of a {min, median, max} dict."""
    f = lambda x: format(x / scale, fmt)  # noqa: E731
    return f"{f(m['median'])} [{f(m['min'])}–{f(m['max'])}]{unit}"


# ------------------------------------------------------------------------------------------ burst
BURST_SIDES = {"shoal": "Shoal (tmpfs upper)", "shoal-disk": "Shoal (disk upper)",
               "docker-bind": "Docker bind-mount", "docker-eager": "Docker eager"}


def burst_rows(j: dict) -> list[list[str]]:
    rows = []
    for row in j["rows"]:
        for side, label in BURST_SIDES.items():
            s = row["sides"].get(side)
            if s is None:
                continue
            rows.append([j["workload"], str(row["n"]), label, spread_cell(s["wall_s"], ".1f"),
                         f"{s['p50_ms']['median']:.0f} / {s['p99_ms']['median']:.0f}",
                         spread_cell(s["bytes_written"], ".1f", MiB),
                         f"{s['storage_growth']['median'] / MiB:.1f}",
                         spread_cell(s["peak_mem_bytes"], ".0f", MiB),
                         f"{s['peak_cg_mem_bytes']['median'] / MiB:.0f}"])
    return rows


def burst_ratio_rows(j: dict) -> list[list[str]]:
    rows = []
    for row in j["rows"]:
        for pair, r in row["ratios"].items():
            peer, mine = pair.split("/")
            rows.append([j["workload"], str(row["n"]), f"{BURST_SIDES[mine]} vs {BURST_SIDES[peer]}",
                         spread_cell(r["wall_speedup"], ".2f", unit="×"),
                         spread_cell(r["bytes_written_reduction"], ".0f", 0.01, "%")])
    return rows


# ------------------------------------------------------------------------------------------ api
def api_rows(j: dict) -> list[list[str]]:
    e, c, h = j["exec_echo"], j["create"], j["hold"]
    rss = {k: round(v / 1024) for k, v in h["daemon_rss_kb"].items()}
    left = h["leftovers_after_kill"]

    def runs(x: dict) -> str:  # min–max of the per-run p50 (older single-run files have none)
        r = x.get("p50_runs_ms")
        return f"{r['min']:.2f}–{r['max']:.2f} ms" if r else "one run"

    ex = h.get("execs_per_s_runs")
    return [
        ["exec `echo`, in-process", f"{e['in_process']['p50_ms']:.2f} ms", f"{e['in_process']['p99_ms']:.2f} ms",
         runs(e["in_process"]), "≤ 2 ms"],
        ["exec `echo`, through the API", f"{e['api']['p50_ms']:.2f} ms", f"{e['api']['p99_ms']:.2f} ms",
         runs(e["api"]), "≤ 5 ms"],
        ["create, in-process / through the API", f"{c['in_process']['p50_ms']:.2f} / {c['api']['p50_ms']:.2f} ms",
         f"{c['in_process']['p99_ms']:.1f} / {c['api']['p99_ms']:.1f} ms",
         f"{runs(c['in_process'])} / {runs(c['api'])}", f"API adds {c['api_overhead_p50_ms']:.1f} ms (goal ≤ 5 ms)"],
        [f"{h['sandboxes']} sandboxes created through the API", f"{h['create_wall_s']:.1f} s", "", "",
         f"held: {h['live_seen']}"],
        [f"exec churn over the {h['sandboxes']} for {h['churn_s']:.0f} s", f"{h['execs_per_s']:.0f} execs/s", "",
         f"{ex['min']:.0f}–{ex['max']:.0f} execs/s" if ex else "one run", f"{h['exec_errors']} errors"],
        [f"daemon RSS before → holding {h['sandboxes']} → after churn → after kill",
         f"{rss['before']} → {rss['holding']} → {rss['after_churn']} → {rss['after_kill']} MiB", "", "", "flat"],
        ["leftovers after killing all", (f"{left['mounts']} mounts, {left['cgroups']} cgroups, {left['state_dirs']} "
         f"state dirs; daemon fds {h['daemon_fds']['before']} → {h['daemon_fds']['after']}"), "", "", "none"],
    ]


# ------------------------------------------------------------------------------------------ rollout
def rollout_rows(j: dict) -> list[list[str]]:
    lo, sh, rp, ro = j["log_overhead"], j["log_overhead_agent_shell"], j["replay"], j["rollout"]
    pol = {p["policy"]: p for p in ro["by_policy"]}
    lost = ro["episodes_total"] - ro["counts"]["done"] + ro["counts"]["failed"]
    def over_runs(x: dict, key: str, fmt: str, unit: str = "") -> str:  # "; runs a–b" when measured 3 times
        sp = x.get("spread", {}).get(key)
        return f"; {len(x['runs'])} runs {sp['min']:{fmt}}–{sp['max']:{fmt}}{unit}" if sp else ""

    return [
        ["exec `true` in-process, direct / through the log (median of the runs)",
         (f"{lo['direct_p50_ms']:.3f} / {lo['logged_p50_ms']:.3f} ms (+{lo['overhead_pct']:.1f}%, "
          f"+{lo['overhead_ms']:.2f} ms{over_runs(lo, 'overhead_pct', '+.1f', '%')})"),
         "≤ +5%: not met" if lo["overhead_pct"] > 5 else "≤ +5%"],
        ["the agent's shell call (`bash -c`), direct / through the log",
         (f"{sh['direct_p50_ms']:.3f} / {sh['logged_p50_ms']:.3f} ms (+{sh['overhead_pct']:.1f}%"
          f"{over_runs(sh, 'overhead_pct', '+.1f', '%')})"),
         "≤ +5%: not met" if sh["overhead_pct"] > 5 else "≤ +5%"],
        [f"fast-forward replay of {rp['steps']:,} logged steps",
         (f"{rp['replay_steps_per_s']:,.0f} steps/s ({rp['replay_vs_live']:.0f}× the live rate"
          f"{over_runs(rp, 'replay_steps_per_s', ',.0f', ' steps/s')})"), "≥ 5,000 steps/s"],
        ["oracle episodes through the full loop (worker processes)",
         (f"{pol['oracle']['resolved']:,}/{pol['oracle']['episodes']:,} resolved "
         f"({pol['oracle']['resolve_rate'] * 100:.0f}%)"), "100%"],
        ["null / random-edit policy", (f"{pol['null']['resolved']}/{pol['null']['episodes']} and "
         f"{pol['random']['resolved']}/{pol['random']['episodes']} resolved"), "null 0%"],
        [f"all {ro['episodes_total']:,} episodes (oracle + null + random)",
         f"{ro['wall_s']:.0f} s wall = {ro['episodes_per_s']:.2f} episodes/s", ""],
        [f"a worker killed with SIGKILL at {ro['killed_worker']['at_done']}/{ro['episodes_total']} done",
         (f"{lost} episodes lost or failed; {ro['resumed_episodes']} resumed ({ro['resumed_replayed_ops']} ops "
         f"served from the log); {ro['re_executed_ops']} completed ops re-executed"), "none lost, none re-run"],
    ]


# ------------------------------------------------------------------------------------------ training
def _acc(runs: list[dict], selector: str, lr: float, budget: float | None = None) -> list[dict]:
    out = [r for r in runs if r["selector"] == selector and r["lr"] == lr and r.get("variant", "opd") == "opd"
           and (budget is None or r["budget"] == budget)]
    assert out, (selector, lr, budget)
    return out


def mean_acc(runs, selector, lr, budget=None) -> float:
    return statistics.mean(r["accuracy"]["all"] for r in _acc(runs, selector, lr, budget))


def kept(runs, selector, lr, budget) -> float:
    return statistics.mean(r["kept_fraction"] for r in _acc(runs, selector, lr, budget))


def training_rows(j: dict) -> list[list[str]]:
    sweep = load("docs/results/opd_lr_sweep.json")
    runs, start = j["runs"], j["baseline"]["student"]["all"]
    lo, hi = j["config"]["opd_lr"], j["config"]["alt_lr"]
    full, full_hi = mean_acc(runs, "full", lo), mean_acc(runs, "full", hi)
    tip = mean_acc(runs, "tip", lo, 0.001)
    k1, k10 = kept(runs, "tip", lo, 0.001), kept(runs, "tip", lo, 0.1)
    alt = [mean_acc(runs, s, hi, b) for s in j["config"]["alt_selectors"] for b in j["config"]["alt_budgets"]]
    full_step = statistics.mean(r["step_s"] for r in _acc(runs, "full", lo))
    grid_sel = statistics.mean(r["selector_s"] for r in _acc(runs, "tip+ier-and", lo))
    ov = {round(o["params"] / 1e6, 1): o["overhead_pct"] for o in j["overhead"]}
    mid_lr = sorted(sweep["lrs"])[2]
    return [
        [f"full-token OPD, lr {lr_str(lo)} / {lr_str(hi)}", f"{full:.3f} / {full_hi:.3f}"],
        [f"full-token OPD, lr {lr_str(mid_lr)} (`--lr-sweep`)",
         (f"{mean_acc(sweep['runs'], 'full', mid_lr):.3f} (below the start); TIP at 0.1%: "
         f"{mean_acc(sweep['runs'], 'tip', mid_lr, sweep['budget']):.3f}")],
        [f"TIP on {k1 * 100:.1f}% of tokens ({0.001 * 100:.1f}% budget), lr {lr_str(lo)}",
         f"{tip:.3f} ({(tip - start) / (full - start) * 100:.0f}% of full OPD's gain at that lr)"],
        [f"TIP on {k10 * 100:.0f}% of tokens, lr {lr_str(lo)}", f"{mean_acc(runs, 'tip', lo, 0.1):.3f}"],
        [f"IER alone on {k1 * 100:.1f}% / {k10 * 100:.0f}%, lr {lr_str(lo)}",
         f"{mean_acc(runs, 'ier', lo, 0.001):.3f} / {mean_acc(runs, 'ier', lo, 0.1):.3f}"],
        [f"random tokens, {k1 * 100:.1f}% / {k10 * 100:.0f}%, lr {lr_str(lo)}",
         f"{mean_acc(runs, 'random', lo, 0.001):.3f} / {mean_acc(runs, 'random', lo, 0.1):.3f} (below the start)"],
        [f"any selection at lr {lr_str(hi)}", (f"{min(alt):.3f}–{max(alt):.3f} (collapse; `--lr-sweep` covers "
         f"{lr_str(min(sweep['lrs']))}..{lr_str(max(sweep['lrs']))})")],
        ["selector overhead (TIP + IER-AND, k = 16)",
         (f"+{grid_sel / full_step * 100:.1f}% of an OPD step in the grid itself (0.1 M params); separate timing: "
         f"+{ov[0.1]:.1f}% at 0.1 M, +{ov[0.6]:.1f}% at 0.6 M, +{ov[3.2]:.1f}% at 3.2 M")],
    ]


# ------------------------------------------------------------------------------------------ startup
def _bench_module(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{script}", REPO / "bench" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_renderer(script: str, fn: str) -> Callable[[dict], list[list[str]]]:
    """A renderer that lives in a bench script (bench/startup.py writes its README tables itself)."""
    def render(j: dict) -> list[list[str]]:
        return getattr(_bench_module(script), fn)(j)
    return render


# ------------------------------------------------------------------------------------------ density goals
def create_row(fill: dict, pivot: dict | None, shell: str, verdict_at_n: str | None = None) -> list[str]:
    """The create goal's row: the template root switch's fill, pivot_root's beside it (same commit)."""
    full = fill["rows"][-1]
    ratio = fill["ratio_full_vs_empty_p50"]
    measured = (f"{ratio:.2f}× at {full['live']:,} ({spread_cell(full['p50_ms'], '.1f')} vs "
                f"{spread_cell(fill['empty_p50_ms'], '.1f')} ms)")
    if pivot:
        pfull = pivot["rows"][-1]
        measured += (f"; with pivot_root (SHOAL_ROOT_SWITCH=pivot_root, same commit, same window) "
                     f"{pivot['ratio_full_vs_empty_p50']:.2f}× ({spread_cell(pfull['p50_ms'], '.1f')} vs "
                     f"{spread_cell(pivot['empty_p50_ms'], '.1f')} ms)")
    measured += shell
    if ratio <= 2:
        verdict = (f"met at {full['live']:,} only, at the median: a fifth of the goal's size, not measured at "
                   "20,000, where the growth that is left (not profiled; suspected: each new superblock's shrinker "
                   "widening every memory cgroup) "
                   "would pass 2×; pivot_root's walk of every task is off the create path")
    else:
        verdict = (f"not met: {ratio - 2:.1f}× over at a fifth of the size"
                   + ("" if pivot else "; pivot_root's walk of every task is still per create"))
    if verdict_at_n:  # a shell fill measured it near the goal's size: that decides
        verdict = verdict_at_n
    return ["create p50 with N live sandboxes, vs an empty host", "≤ 2× at 20,000", measured, verdict]


def density_goal_rows(j: dict) -> list[list[str]]:
    """Issue 16's goals table: held counts from density.json; the rest from the benchmarks that measure
    each goal (fill_create, reclaim, sched), each cell a median [min–max] over that file's runs."""
    def held(profile: str) -> dict:
        return j["profiles"][profile]["sides"]["shoal"]["summary"]["n_held"]

    # the create fill with the template root switch ("after") and pivot_root ("before"), same commit
    rootswitch = REPO / "bench/results/fill_create_rootswitch.json"
    fill_j = load("bench/results/fill_create_rootswitch.json") if rootswitch.exists() else \
        load("bench/results/fill_create.json")
    fill = fill_j["after"]["summary"]
    full = fill["rows"][-1]
    rec = load("bench/results/reclaim.json")["runs"]

    def reclaim_runs(algorithm: str) -> list[dict]:  # target 1.0, steps aimed at anon (the current code)
        return [r for r in rec if (r["algorithm"], r["target"], r.get("method")) == (algorithm, 1.0, "anon-goal")]

    best, zr = reclaim_runs("zswap-deflate"), reclaim_runs("lzo-rle")
    acc = [r["accounted_no_cache_mib"]["after_over_before"] for r in best]
    acc_zram = [r["accounted_no_cache_mib"]["after_over_before"] for r in zr]
    resume = [r["resume_to_first_exec"]["reclaimed"]["p50_ms"] for r in best + zr]
    sched = load("bench/results/sched.json")["summary"]

    def mmm(xs: list[float]) -> dict:
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}

    py_runs = held("python")["n"]
    docker_python = j["profiles"]["python"]["sides"]["docker"]["summary"]["n_held"]
    shell_row = ["idle shell sandboxes held", "≥ 20,000",
                 f"{held('shell')['median']:,} (the run's cap, {held('shell')['n']} runs); {full['live']:,} in "
                 f"bench/fill_create.py", "not reached: runs were capped on a shared host"]
    if (REPO / "bench/results/density-shell-limit.json").exists():  # the fills past the cap, with --tune-host
        lim = load("bench/results/density-shell-limit.json")["profiles"]["shell"]["sides"]["shoal"]
        n = lim["summary"]["n_held"]
        best = max(lim["runs"], key=lambda r: r["n_held"])
        per_run = "; ".join(f"{r['n_held']:,}: {r['stop'].split(';')[0][:64]}" for r in lim["runs"])
        shell_row = ["idle shell sandboxes held", "≥ 20,000",
                     f"{best['n_held']:,} with sessions open, the best of {n['n']} run{'s' if n['n'] > 1 else ''} "
                     f"(--tune-host; per run: {per_run}); {full['live']:,} without sessions in "
                     "bench/fill_create.py",
                     f"not reached, {20000 - best['n_held']:,} short: that run's time budget. And 20,000 "
                     "do not fit this kernel: each sandbox's memory cgroup carries a shrinker_info as wide as "
                     "the host's superblocks, s·N²/64 KiB in all (model: about 11,200 fit in 19 GiB; "
                     "docs/density.md)"]
    pooled = pooled_shell_rows()
    if pooled:
        shell_row = pooled[0]

    def shell_fill_create() -> str:
        """The same ratio in the longest shell fill with sessions (density-shell-limit.json): its last
        step's create p50 against its N = 20 step's (N = 10 is warm-up noise)."""
        if pooled:
            return pooled[1]
        if not (REPO / "bench/results/density-shell-limit.json").exists():
            return ""
        runs = load("bench/results/density-shell-limit.json")["profiles"]["shell"]["sides"]["shoal"]["runs"]
        r = max(runs, key=lambda x: x["n_held"])
        first = next(st for st in r["steps"] if st["n"] >= 20)["create_ms"]["p50"]
        last = r["steps"][-1]
        return (f"; {last['create_ms']['p50'] / first:.1f}× at {last['n']:,} in the shell fill with sessions "
                f"({last['create_ms']['p50']:.1f} vs {first:.1f} ms, 1 run, with pivot_root)")

    python_row = ["idle python sandboxes held, paused + reclaimed", "≥ 3,000",
                  f"{held('python')['median']:,} held, paused ({py_runs} run{'s' if py_runs > 1 else ''}; the run's "
                  "cap)", "not measured at that size"]
    ratio_row = ["Shoal vs Docker idle python sandboxes held", "≥ 3×",
                 f"{held('python')['median']:,} vs {docker_python['median']:,} (both fills capped)",
                 "not measured: neither side reached a stop rule of its own in one run"]
    dense_path = REPO / "bench/results/density-python-dense.json"
    dense_j = load("bench/results/density-python-dense.json") if dense_path.exists() else None
    if dense_j and "docker" in dense_j["profiles"]["python"]["sides"]:  # the dense python fills, both sides
        python_row, ratio_row = dense_python_rows(dense_j)
    elif dense_j:  # ksm=True, paused in batches as it fills; Shoal only
        dense = dense_j["profiles"]["python"]["sides"]["shoal"]["runs"]
        r = dense[-1]
        rate = r["n_held"] / r["fill_s"]
        own = r["steps"][-1].get("attributed_per_sb", {}).get("memory", 0) / (1 << 20)
        python_row = ["idle python sandboxes held, paused + merged (ksm=True, aslr=False)", "≥ 3,000",
                      f"{r['n_held']:,} held, {r['paused_during_fill']:,} paused during the fill ({len(dense)} "
                      f"run; {r['stop']}); {own:.2f} MiB each in its own accounting",
                      f"not reached, {3000 - r['n_held']:,} short: the run's time budget. At its rate "
                      f"({rate:.1f} sandboxes/s on 2 shared cores) a fill to 3,000 takes "
                      f"{3000 / rate / 60:.0f} min, and at {own:.1f} MiB each (ksmd had not merged them within "
                      f"the run) 3,000 need {3000 * own / 1024:.0f} GiB (both extrapolated, not measured)"]
    return [
        shell_row,
        python_row,
        ["memory per idle python sandbox after reclaim (cgroups + the compressed pools' RAM, page cache "
         "left out, target 1.0)", "≤ 1/4 of before",
         f"{spread_cell(mmm(acc), '.3f')} of before with zswap (deflate); {spread_cell(mmm(acc_zram), '.3f')} "
         f"with zram (lzo-rle) ({len(acc)} + {len(acc_zram)} runs)",
         "met" if max(acc) <= 0.25 else
         (f"not met by {(statistics.median(acc) - 0.25) * 100:.1f} points: deflate, the best compressor this "
          "kernel offers, takes these heaps to about 4×; the pool is almost all that is left"
          if statistics.median(acc) > 0.25 else "met at the median, not in every run")],
        ["resume of a reclaimed sandbox → first exec p50", "≤ 100 ms", f"{spread_cell(mmm(resume), '.1f')} ms",
         "met"],
        ["exec p50 of one active sandbox among 1,000 idle ones, vs an empty host", "≤ 1.5×",
         f"{sched['idle-1000']['p50_vs_empty']:.2f}× ({spread_cell(sched['idle-1000']['p50_ms'], '.2f')} vs "
         f"{spread_cell(sched['empty']['p50_ms'], '.2f')} ms)", "met"],
        create_row(fill, fill_j.get("before", {}).get("summary") if rootswitch.exists() else None,
                   shell_fill_create(), pooled[2] if pooled else None),
        ratio_row,
    ]


# the shell fills toward 20,000, densest configuration first: (JSON, what the configuration is)
DENSE_SHELL_FILLS = [
    ("bench/results/density-shell-pooled-weight.json",
     'pooled memory cgroups and cpu as a weight (memory_cgroup="pooled", [density] cpu_quota = false)'),
    ("bench/results/density-shell-pooled-cap.json",
     'pooled memory cgroups, cpu a cap (memory_cgroup="pooled", the default CFS quota)'),
    ("bench/results/density-shell-pooled.json",
     'pooled memory cgroups (memory_cgroup="pooled"; before the static shoal-init)'),
]


def pooled_shell_rows() -> tuple[list[str], str, str] | None:
    """The shell goals from the densest shell fills on record (DENSE_SHELL_FILLS): (the held row, the
    create cell's shell part, the create verdict). The next configuration's fills, where recorded, are
    the comparison (their held median and create ratio), as are the fills with a memory cgroup each
    (density-shell-limit.json)."""
    have = [(path, what) for path, what in DENSE_SHELL_FILLS if (REPO / path).exists()]
    if not have:
        return None
    path, what = have[0]
    runs = load(path)["profiles"]["shell"]["sides"]["shoal"]["runs"]
    held = sorted(r["n_held"] for r in runs)
    med = statistics.median(held)
    host = [r["steps"][-1]["meminfo_per_sb"]["used"] / (1 << 20) for r in runs]
    per_run = "; ".join(f"{r['n_held']:,}: {r['stop'].split(';')[0][:72]}" for r in runs)
    own = ""
    if (REPO / "bench/results/density-shell-limit.json").exists():
        lim = load("bench/results/density-shell-limit.json")["profiles"]["shell"]["sides"]["shoal"]["runs"]
        best = max(lim, key=lambda r: r["n_held"])
        own = (f"; with a memory cgroup each: {best['n_held']:,}, the best of {len(lim)} "
               f"(time budget, {best['steps'][-1]['meminfo_per_sb']['used'] / (1 << 20):.2f} MiB each)")
    cmp_median = 0.0
    if len(have) > 1:  # the next configuration on record, as the comparison
        cmp_runs = load(have[1][0])["profiles"]["shell"]["sides"]["shoal"]["runs"]
        ch = sorted(r["n_held"] for r in cmp_runs)
        cmp_median = statistics.median(ch)
        own = (f"; with {have[1][1]}: {statistics.median(ch):,.0f} [{ch[0]:,}–{ch[-1]:,}] "
               f"({len(cmp_runs)} runs, {have[1][0].split('/')[-1]})") + own
    measured = (f"{med:,.0f} [{held[0]:,}–{held[-1]:,}] with sessions open and {what} "
                f"({len(runs)} runs, per run: {per_run}); host memory "
                f"{statistics.median(host):.2f} [{min(host):.2f}–{max(host):.2f}] MiB per sandbox at the "
                f"last step{own}")
    opt_in = "with " + what.split(" (")[0] + " (opt-in)"
    if held[0] >= 20000:
        verdict = f"met in every run, {opt_in}"
    elif med >= 20000:
        verdict = f"met at the median, not in every run, {opt_in}"
        if cmp_median >= 20000:  # the less opted-in configuration meets it too
            verdict += f"; and at the median with {have[1][1].split(' (')[0]}"
    else:
        def rule(stop: str) -> str:
            return next((v for k, v in (("create p99", "create p99 > 1 s"), ("free memory", "free memory < 10%"),
                                        ("--fill-budget", "the run's time budget")) if stop.startswith(k)),
                        stop.split(";")[0][:60])
        rules = sorted({rule(r["stop"]) for r in runs})
        verdict = (f"not reached, {20000 - med:,.0f} short at the median: "
                   + ("every run stopped at " + rules[0] if len(rules) == 1 else "stopped by " + ", ".join(rules))
                   + " (docs/density.md, \"Pooled memory cgroups\")")
    ratios, at = [], []
    for r in runs:
        first = next(st for st in r["steps"] if st["n"] >= 20)["create_ms"]["p50"]
        last = r["steps"][-1]
        ratios.append(last["create_ms"]["p50"] / first)
        at.append(last["n"])
    rm = statistics.median(ratios)
    create = (f"; {rm:.1f}× [{min(ratios):.1f}–{max(ratios):.1f}] at {min(at):,}–{max(at):,} in the shell "
              f"fills with sessions and {what} ({len(runs)} runs: each run's last step against its N = 20 step)")
    if len(have) > 1:
        cr = []
        for r in load(have[1][0])["profiles"]["shell"]["sides"]["shoal"]["runs"]:
            first = next(st for st in r["steps"] if st["n"] >= 20)["create_ms"]["p50"]
            cr.append((r["steps"][-1]["create_ms"]["p50"] / first, r["steps"][-1]["n"]))
        create += (f"; with {have[1][1].split(' (')[0]}: {statistics.median(x for x, _ in cr):.1f}× "
                   f"[{min(x for x, _ in cr):.1f}–{max(x for x, _ in cr):.1f}] at "
                   f"{min(n for _, n in cr):,}–{max(n for _, n in cr):,}")
    at_goal = [x for x, n in zip(ratios, at, strict=True) if n >= 20000]
    if min(at) >= 20000:
        cverdict = (f"met at 20,000, {opt_in}" if max(ratios) <= 2 else
                    f"met at the median at 20,000, not in every run, {opt_in}"
                    if rm <= 2 else f"not met at 20,000: {rm:.1f}× at the median")
    elif len(at_goal) * 2 > len(ratios):  # most runs reached 20,000: judge there
        short = [(x, n) for x, n in zip(ratios, at, strict=True) if n < 20000]
        cverdict = ((f"met at 20,000 in the {len(at_goal)} runs that reached it "
                     f"({', '.join(f'{x:.1f}×' for x in at_goal)}), {opt_in}" if max(at_goal) <= 2 else
                     f"not met at 20,000: {statistics.median(at_goal):.1f}× at the median of the runs there")
                    + "; " + ", ".join(f"{x:.1f}× in the run that ended at {n:,}" for x, n in short))
    else:
        cverdict = (f"not measured at 20,000 (the fills ended at {min(at):,}–{max(at):,}); "
                    + (f"within 2× there ({rm:.1f}× at the median)" if rm <= 2 else f"{rm:.1f}× there at the median"))
    return (["idle shell sandboxes held", "≥ 20,000", measured, verdict], create, cverdict)


def dense_python_rows(j: dict) -> tuple[list[str], list[str]]:
    """The goals table's python rows from bench/results/density-python-dense.json: Shoal's sandboxes
    with ksm=True, aslr=False, each paused 1 s after it was ready (the idle pipeline); Docker's the same
    image and process, `docker run -d`, to the same stop rule. The median [min–max] of the runs, each
    run's count and what ended it; "met" only where every run meets the goal."""
    sides = j["profiles"]["python"]["sides"]
    sh = sorted(sides["shoal"]["runs"], key=lambda r: -r["n_held"])
    dk = sorted(sides["docker"]["runs"], key=lambda r: -r["n_held"])

    def per_run(runs: list[dict]) -> str:
        return ", ".join(f"{r['n_held']:,}: {str(r['stop']).split(';')[0].split(' (')[0]}" for r in runs)

    def mmm(runs: list[dict]) -> dict:
        xs = [r["n_held"] for r in runs]
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}

    def plural(runs: list[dict]) -> str:
        return f"{len(runs)} run{'s' if len(runs) > 1 else ''}"

    held, dheld = mmm(sh), mmm(dk)
    mems = [(r.get("end") or r["steps"][-1])["meminfo_per_sb"]["used"] / (1 << 20) for r in sh]
    settled = [r["settle"][-1] for r in sh if r.get("settle")]
    n_capped = sum("budget" in str(r["stop"]) or "--max" in str(r["stop"]) for r in sh)
    capped = n_capped == len(sh)
    fewest = sh[-1]
    if held["min"] >= 3000:
        verdict = f"met in every run (the fewest {held['min']:,})"
    elif held["median"] >= 3000:
        verdict = f"met at the median, not in every run: the fewest held {held['min']:,}"
    else:
        verdict = f"not met, {3000 - held['median']:,.0f} short at the median"
    if capped and held["min"] < 3000:
        verdict += (f". The fills ended at their time budget; the fewest waited "
                    f"{fewest['idle_pipeline']['pace_wait_s']:.0f} s of it at the 5 GiB guard for ksmd")
    python_row = [
        "idle python sandboxes held, paused + merged (ksm=True, aslr=False, each paused 1 s after it was ready)",
        "≥ 3,000",
        f"{spread_cell(held, ',.0f')} ({plural(sh)}; per run: {per_run(sh)}); "
        f"{spread_cell({'min': min(mems), 'median': statistics.median(mems), 'max': max(mems)}, '.2f')} MiB of "
        "host memory each once all were paused"
        + (f" and ksmd had {settled[0]['t']:.0f} s more ({min(x['mem_available_gib'] for x in settled):.1f}–"
           f"{max(x['mem_available_gib'] for x in settled):.1f} GiB still available)" if settled else ""),
        verdict]
    ratio, worst = held["median"] / dheld["median"], held["min"] / dheld["max"]
    ratio_row = [
        "Shoal vs Docker idle python sandboxes held", "≥ 3×",
        f"{ratio:.1f}× median to median ({held['median']:,.0f} vs {dheld['median']:,.0f}); {worst:.1f}× "
        f"Shoal's fewest to Docker's most ({held['min']:,} vs {dheld['max']:,}; Docker, {plural(dk)}: {per_run(dk)})",
        ("met in every pairing" if worst >= 3 else "met at the median, not in every pairing" if ratio >= 3 else
         f"not met by {3 - ratio:.1f}×") + ": Docker's fills ended at the stop rule"
        + (", Shoal's at their time budget (a floor)" if capped else
           f", {n_capped} of Shoal's {len(sh)} at their time budget (floors)" if n_capped else "")]
    return python_row, ratio_row


TABLES: dict[str, tuple[str, Callable[[dict], list[list[str]]]]] = {
    "startup": ("bench/results/startup.json", _bench_renderer("startup", "comparison_rows")),
    "startup-shoal": ("bench/results/startup.json", _bench_renderer("startup", "shoal_rows")),
    "burst-agent": ("bench/results/burst.json", burst_rows),
    "burst-agent-ratios": ("bench/results/burst.json", burst_ratio_rows),
    "burst-tests": ("bench/results/burst-tests.json", burst_rows),
    "burst-tests-ratios": ("bench/results/burst-tests.json", burst_ratio_rows),
    "api": ("bench/results/api.json", api_rows),
    "rollout": ("bench/results/rollout.json", rollout_rows),
    "fleet": ("bench/results/fleet.json", _bench_renderer("fleet", "rows")),
    "training": ("docs/results/opd_repro.json", training_rows),
    "lazy": ("bench/results/lazy.json", _bench_renderer("lazy", "readme_rows")),
    "density": ("bench/results/density.json", _bench_renderer("density", "readme_rows")),
    "density-goals": ("bench/results/density.json", density_goal_rows),
    "density-python": ("bench/results/density-python-dense.json", _bench_renderer("density", "readme_rows")),
    "desktop": ("bench/results/desktop.json", _bench_renderer("desktop", "readme_rows")),
    "flare": ("bench/results/flare.json", _bench_renderer("flare", "readme_rows")),
    "flare-p05": ("bench/results/flare_p05.json", _bench_renderer("flare", "readme_rows")),
    "flare-local-model": ("bench/results/flare_local_model.json", _bench_renderer("flare", "local_model_rows")),
    "annotate": ("bench/results/annotate.json", _bench_renderer("annotate", "readme_rows")),
}


# ------------------------------------------------------------------------------------------ prose
def prose_burst(j: dict) -> list[str]:
    sf = j["snapshot_fork"]
    snap = sf["snapshot_ms"]
    big = j["rows"][-1]
    per_task = big["sides"]["shoal"]["storage_growth"]["median"] / big["n"] / 1024
    du = sf["disk_upper"]
    loads = [x for r in j["rows"] for x in (r["loadavg_1m"]["min"], r["loadavg_1m"]["max"])]
    eager = [r["ratios"][f"docker-eager/{m}"]["wall_speedup"]["median"] for r in j["rows"]
             for m in ("shoal", "shoal-disk")]
    out = [f"N tasks over {j['m']} real workspaces", f"on top of {j['m']} workspaces stored once",
           f"Concurrency {j['concurrency']} on 2 cores", f"{j['runs']} runs each",
           f"median of {sf['runs']} runs", f"about {per_task:.0f} KiB per task",
           f"load average during the windows was {min(loads):.1f}–{max(loads):.1f}",
           f"{min(eager):.1f}–{max(eager):.1f}× in the `{j['workload']}` rows",
           (f"ext4's metadata takes {(1 - du['usable_fraction']) * 100:.0f}% of it, measured at "
           f"{du['disk_mb']} MiB")]
    for upper in ("tmpfs", "disk"):
        out.append(f"{upper} upper: " + ", ".join(f"{snap[upper][k]['median']:.1f} ms for {k[:-2]} MB"
                                                  for k in ("1MB", "10MB", "100MB")))
    out.append(f"fork(10) {sf['fork_s']['10']['median']:.3f} s, fork(100) {sf['fork_s']['100']['median']:.3f} s "
               f"({sf['fork_s']['100']['min']:.3f}–{sf['fork_s']['100']['max']:.3f} s)")
    return out


def prose_flood(j: dict) -> list[str]:
    return [f"over {j['seconds']:.0f} s, {j['total_bytes'] / 2**30:.1f} GiB of output",
            f"RSS at {j['rss_mib']['start']:.0f} → {j['rss_mib']['max']:.0f} MiB (max)",
            f"fds at {j['fds']['start']} → {j['fds']['end']}",
            f"{j['daemon_bytes_written_to_storage'] / 1024:.0f} KiB written to storage by the daemon",
            f"/v1/health p50 {j['health_ms']['p50']:.1f} ms"]


def prose_fuzz(j: dict) -> list[str]:
    return [f"all {j['operations']} operations", (f"{j['cases']} cases ({j['positive_cases']} with valid input, "
            f"{j['negative_cases']} with schema-violating input; {j['admin_cases']} of them on admin routes "
            "with the admin key)"), f"{j['examples_per_case']} examples each", f"{j['cases_failed']} failed"]


def prose_rollout(j: dict) -> list[str]:
    t, suite = j["rollout"]["oracle_timings_p50_ms"], j["suite"]
    return [f"({suite['tasks']} tasks, {suite['repos']} repos)",
            f"{suite['tasks']} bundled tasks over {suite['repos']} real repositories",
            f"An oracle episode takes {t['wall_s'] / 1000:.2f} s (median)", f"is {t['grade_s'] / 1000:.2f} s of it",
            f"take {t['tools_s']:.0f} ms, and sandbox setup another {t['setup_s']:.0f} ms"]


def prose_training(j: dict) -> list[str]:
    c = j["config"]
    return [f"in {j['wall_s'] / 60:.1f} min, starting from a student at {j['baseline']['student']['all']:.3f}",
            f"{j['wall_s'] / 60:.1f} min on this 2-core machine",  # cores: a fact of the machine, not of the JSON
            f"{len(c['selectors'])} selectors × {sum(b < 1 for b in c['budgets'])} budgets × {len(c['seeds'])} seeds"]


def prose_lazy(j: dict) -> list[str]:
    h = j["host"]
    return [f"1-minute load average {h['loadavg_1m_before']:.1f} before, {h['loadavg_1m_after']:.1f} after",
            f"{j['config']['runs']} runs", f"{j['wall_s'] / 60:.1f} min"]


PROSE: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "burst-snapshot": ("bench/results/burst.json", prose_burst),
    "flood": ("bench/results/flood.json", prose_flood),
    "fuzz": ("bench/results/fuzz.json", prose_fuzz),
    "rollout-timings": ("bench/results/rollout.json", prose_rollout),
    "training": ("docs/results/opd_repro.json", prose_training),
    "lazy": ("bench/results/lazy.json", prose_lazy),
}


# ------------------------------------------------------------------------------------------ parsing
def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell)


def readme_tables(text: str) -> list[dict]:
    """Each table: its section heading, marker (key, source) if any, and body rows as cell lists."""
    lines = text.splitlines()
    tables, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:]
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            start = i
            i += 2
            body = []
            while i < len(lines) and lines[i].startswith("|"):
                body.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            marker = None
            for back in range(start - 1, max(-1, start - 8), -1):
                if lines[back].startswith(("#", "|")):
                    break
                if m := MARKER.search(lines[back]):
                    marker = (m.group(1), m.group(2))
                    break
            tables.append({"section": section, "line": start + 1, "marker": marker, "body": body})
            continue
        i += 1
    return tables


def normalize(s: str) -> str:
    return re.sub(r"\s+", " ", s.replace("**", "").replace("`", "")).strip()


def compare(key: str, table: dict) -> list[str]:
    source, render = TABLES[key]
    want = render(load(source))
    got = table["body"]
    errors = []
    if len(got) != len(want):
        errors.append(f"{key}: README has {len(got)} rows, {source} gives {len(want)}")
    for r, (g, w) in enumerate(zip(got, want)):
        if len(g) != len(w):
            errors.append(f"{key} row {r + 1}: {len(g)} cells, expected {len(w)}: {w}")
            continue
        for c, (gc, wc) in enumerate(zip(g, w)):
            if numbers(gc) != numbers(wc):
                errors.append(f"{key} row {r + 1} col {c + 1}: README {gc!r} vs {source}: {wc!r}")
    return errors


# ------------------------------------------------------------------------------------------ tests
def test_every_readme_table_with_figures_names_its_json():
    missing = []
    for t in readme_tables(README.read_text()):
        has_figures = any(numbers(c) for row in t["body"] for c in row)
        if not has_figures or (t["marker"] is None and t["section"].split(",")[0].split(" ")[0] in UNSOURCED_SECTIONS):
            continue
        if t["marker"] is None:
            missing.append(f"README.md:{t['line']} ({t['section']}): a table with figures and no "
                           f"<!-- numbers: KEY (path.json) --> marker")
        elif t["marker"][0] not in TABLES:
            missing.append(f"README.md:{t['line']}: marker key {t['marker'][0]!r} has no renderer in {__file__}")
        elif t["marker"][1] != TABLES[t["marker"][0]][0]:
            missing.append(f"README.md:{t['line']}: marker names {t['marker'][1]}, the renderer reads "
                           f"{TABLES[t['marker'][0]][0]}")
    assert not missing, "\n".join(missing)


def test_every_renderer_is_used_and_its_json_is_committed():
    keys = {t["marker"][0] for t in readme_tables(README.read_text()) if t["marker"]}
    unused = set(TABLES) - keys - PENDING
    assert not unused, f"renderers without a README table: {sorted(unused)}"
    for source, _ in [*TABLES.values(), *PROSE.values()]:
        assert (REPO / source).is_file(), source


@pytest.mark.parametrize("key", sorted(TABLES))
def test_readme_table_matches_its_json(key):
    tables = [t for t in readme_tables(README.read_text()) if t["marker"] and t["marker"][0] == key]
    if not tables and key in PENDING:
        pytest.skip(f"TODO(coordinator): README has no {key!r} table yet (see PENDING)")
    assert len(tables) == 1, f"expected one README table marked {key!r}, found {len(tables)}"
    errors = compare(key, tables[0])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("key", sorted(PROSE))
def test_readme_prose_figures_match_their_json(key):
    source, render = PROSE[key]
    text = normalize(README.read_text())
    missing = [s for s in render(load(source)) if normalize(s) not in text]
    assert not missing, f"README.md lacks these figures from {source}: {missing}"


def test_startup_section_prose_matches_its_json():
    """bench/startup.py renders the whole Startup section (readme_section): the README's section must
    hold the same figures in the same order, prose included."""
    text = README.read_text()
    start = text.index("## Startup")
    got = text[start:text.index("\n## ", start + 1)]
    want = _bench_module("startup").readme_section(load("bench/results/startup.json"))
    assert numbers(got) == numbers(want), "README's Startup section differs from bench/startup.py's rendering"


def test_training_doc_tables_come_from_the_generated_results():
    """docs/training.md's result tables restate docs/results/opd_repro.md and opd_lr_sweep.md, which
    the reproduction writes from its JSON: every number in their bodies must be one of those."""
    text = (REPO / "docs" / "training.md").read_text()
    section = text[text.index("### Results"):text.index("### Compared")]
    generated = {float(n.replace(",", "")) for f in ("opd_repro.md", "opd_lr_sweep.md")
                 for n in NUMBER.findall((REPO / "docs" / "results" / f).read_text())}
    stray = []
    for t in readme_tables(section):
        for row in t["body"]:
            for cell in row[1:]:  # the first cell names the row (2 × 64, routed + ExOPD (λ 1.25), ...)
                stray += [f"{n} in {row}" for n in numbers(cell) if float(n.replace(",", "")) not in generated]
    assert not stray, "figures in docs/training.md tables that the generated results do not hold:\n" + \
        "\n".join(stray)


def test_the_checker_catches_an_edited_figure():
    """The comparison itself: change one digit of a rendered burst row and it must be reported."""
    source, render = TABLES["burst-agent"]
    rows = render(load(source))
    edited = [list(r) for r in rows]
    edited[0][3] = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), edited[0][3], count=1)
    errs = compare("burst-agent", {"body": edited})
    assert len(errs) == 1 and "col 4" in errs[0]
    assert compare("burst-agent", {"body": rows}) == []


def write_tables(keys: list[str]) -> None:
    """Replace the body rows of the README tables marked with these keys by their rendered rows."""
    lines = README.read_text().splitlines()
    for t in sorted(readme_tables("\n".join(lines)), key=lambda t: -t["line"]):  # bottom-up: indices hold
        if t["marker"] and t["marker"][0] in keys:
            src, fn = TABLES[t["marker"][0]]
            start = t["line"] + 1  # 0-based index of the first body row (header + separator before it)
            lines[start:start + len(t["body"])] = ["| " + " | ".join(r) + " |" for r in fn(load(src))]
    README.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":  # print a table's rows to paste into README.md, or --write them there
    if sys.argv[1:2] == ["--write"]:
        write_tables(sys.argv[2:])
    for key in [k for k in sys.argv[1:] if k != "--write"] or sorted(TABLES):
        src, fn = TABLES[key]
        print(f"<!-- numbers: {key} ({src}) -->")
        for row in fn(load(src)):
            print("| " + " | ".join(row) + " |")
        print()


def test_scale_doc_table_matches_the_simulation():
    """docs/scale.md's result table is bench/fleet_sim.py's table_rows over bench/results/fleet_sim.json."""
    rows = _bench_module("fleet_sim").table_rows(load("bench/results/fleet_sim.json"))
    doc = (REPO / "docs" / "scale.md").read_text().splitlines()
    for label, value in rows:
        line = next((ln for ln in doc if ln.startswith(f"| {label} |")), None)
        assert line is not None, f"docs/scale.md has no row {label!r}"
        assert numbers(line.split("|")[2]) == numbers(value), (line, value)


def test_desktop_suite_tables_match_the_validation_run():
    """docs/desktop.md's suite tables are bench/desktop_suite.py's rows over bench/results/desktop_suite.json."""
    mod = _bench_module("desktop_suite")
    j = load("bench/results/desktop_suite.json")
    doc = (REPO / "docs" / "desktop.md").read_text().splitlines()
    missing = [row for row in mod.summary_rows(j) + mod.task_rows(j) if row not in doc]
    assert not missing, "docs/desktop.md lacks rows (bench/desktop_suite.py --rows):\n" + "\n".join(missing)

