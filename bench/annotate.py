"""Annotation with the local CPU model (shoal.train.repro's student): latency, who wrote the tokens,
and how on-policy the resulting SFT data is.

Per run (>= 3), on fresh SQLite, the app served by uvicorn on a loopback port:
1. A scripted annotator works through arithmetic prompts with the app's own HTTP API (what the page
   calls): it finds the first token that differs from the correct step-by-step answer, picks the
   correct token from the model's top-k when it is there (else types it), lets the model continue,
   and repeats until the response is correct, then marks it good.
   - latency: request sent -> first continued token received (click -> first token, less the page);
     with Debian's chromium present, also measured in a real page (click on a candidate -> first token
     drawn), for the first `--browser-clicks` corrections;
   - tokens of the good dialogs by author: model-generated, picked from the top-k, typed.
2. Perplexity under the policy of: the policy's own first responses; the SFT data of step 1; and
   post-edited data made by a scripted full rewrite of each first response: the annotator writes the
   correct answer their own way (the same column steps, most significant column first: correct,
   checkable, and not the policy's wording). The paper's comparison: +0.86% (onPanda) vs +36.31%.

    .venv/bin/python bench/annotate.py   # takes /tmp/shoal-bench.lock itself; writes bench/results/annotate.{json,png}
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "annotate.json"
MODELS = Path("/var/tmp/shoal-annotate-models/v1")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]


def problems(n: int) -> list[tuple[str, str]]:
    from shoal.train import repro

    rng = random.Random(11)
    return [repro.problem(rng, repro.CATEGORIES[i % 3]) for i in range(n)]


def rewrite(answer: str) -> str:
    """The post-editor's own wording of a correct answer: columns most significant first."""
    return ",".join(reversed(answer.rstrip(".").split(","))) + "."


def serve(ann):
    import socket

    import uvicorn

    from shoal.annotate.app import make_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(ann), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, t


def sse_first_token(c: httpx.Client, path: str, body: dict) -> tuple[float | None, float]:
    """(seconds to the first token event, seconds to the end) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("event: token"):
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def session(url: str, token: str, items: list[tuple[str, str]], tok, latencies: list[float]) -> dict:
    c = httpx.Client(base_url=url, timeout=60, cookies={"shoal_annotator": token})
    corrections = picked = typed = 0
    for i, (_prompt, gold) in enumerate(items):
        item = f"q{i}"
        sse_first_token(c, f"/api/tree/{item}/start", {})
        gold_ids = tok.encode(gold)
        node = None
        for _ in range(len(gold_ids) + 2):
            view = c.get(f"/api/tree/{item}" + (f"?node={node}" if node is not None else "")).json()
            cur = view["current"]
            ids = [t["id"] for t in cur["tokens"]]
            if ids == gold_ids:
                c.post(f"/api/tree/{item}/label",
                       json={"node": cur["id"], "label": "good", "version": view["version"]})
                break
            pos = next((j for j, (a, b) in enumerate(zip(ids, gold_ids, strict=False)) if a != b),
                       min(len(ids), len(gold_ids)))
            want = gold_ids[pos]
            top = [t["id"] for t in cur["tokens"][pos]["top"]] if pos < len(ids) else []
            body = {"parent": cur["id"], "pos": pos, "version": view["version"]}
            if want in top:
                body["token"], picked = want, picked + 1
            else:
                body["text"], typed = tok.decode([want]), typed + 1
            corrections += 1
            t0 = time.perf_counter()  # the click: the request leaves; saved, then the first token comes back
            with c.stream("POST", f"/api/tree/{item}/correct", json=body) as r:
                node = int(r.headers["x-node"])
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("event: token"):
                        first = time.perf_counter() - t0
            if first is not None:
                latencies.append(first)
        else:
            raise RuntimeError(f"{item}: the scripted annotator did not reach the correct answer")
    return {"corrections": corrections, "picked_from_top_k": picked, "typed": typed}


def browser_latencies(url: str, token: str, item: str, clicks: int) -> list[float]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return []
    if not Path("/usr/bin/chromium").exists():
        return []
    out = []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=FLAGS)
        page = b.new_page()
        page.goto(f"{url}/login?token={token}")
        page.goto(f"{url}/item/{item}")
        page.wait_for_selector("#resp .tok", timeout=60000)  # the tree was started through the API
        for _ in range(clicks):
            n = page.locator("#resp .tok").count()
            page.click(f'#resp .tok[data-i="{max(0, n // 2)}"]')
            page.locator("#cands li").nth(1).click()
            try:
                page.wait_for_function("document.getElementById('status').textContent.includes('continued')",
                                       timeout=20000)
            except Exception:
                page.screenshot(path="/tmp/ann-bench-browser-failure.png")
                raise
            out.append(page.evaluate("window.lastFirstTokenMs") / 1000)
            page.keyboard.press("u")
            page.wait_for_function("document.getElementById('status').textContent === 'undone'", timeout=60000)
        b.close()
    return out


def ppl(model, prompt_ids: list[list[int]], responses: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for p, r in zip(prompt_ids, responses, strict=True):
        for t in model.score(p, r, k=0):
            nll -= t.logprob
            n += 1
    return math.exp(nll / n)


def one_run(model, items, args) -> dict:
    from shoal.annotate import export
    from shoal.annotate.app import Annotator
    from shoal.annotate.tree import AnnotationStore

    tok = model.tokenizer
    with tempfile.TemporaryDirectory() as d:
        store = AnnotationStore(Path(d) / "ann.db")
        for i, (prompt, _) in enumerate(items):
            store.add_item(f"q{i}", {"text": prompt})
        token = store.add_annotator("bench")
        store.add_item("browser", {"text": items[0][0]})
        store.assign("bench", store.items())
        url, server, thread = serve(Annotator(store, model, k=args.k))
        lat: list[float] = []
        t0 = time.perf_counter()
        counts = session(url, token, items, tok, lat)
        wall = time.perf_counter() - t0
        blat: list[float] = []
        browser_error = None
        try:
            c = httpx.Client(base_url=url, timeout=60, cookies={"shoal_annotator": token})
            sse_first_token(c, "/api/tree/browser/start", {})
            blat = browser_latencies(url, token, "browser", args.browser_clicks) if args.browser_clicks else []
        except Exception as e:  # the page measurement is extra: the API figures stand without it
            browser_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        server.should_exit = True
        thread.join(10)
        trees = [t for t in store.trees() if t.item_id != "browser"]
        good = [n for t in trees for n in t.nodes if n.is_good]
        src = "".join(n.sources for n in good)
        sft = export.sft(trees, tok)
        own = [t.nodes[0].tokens for t in trees]
        prompts = [t.prompt_ids for t in trees]
        post = [tok.encode(rewrite(gold)) for _, gold in items]
        sft_ids = [tok.encode(r["messages"][-1]["content"]) for r in sft]
        ppl_own, ppl_sft, ppl_post = ppl(model, prompts, own), ppl(model, prompts, sft_ids), ppl(model, prompts, post)
        store.close()
    return {"latency_s": lat, "browser_latency_s": blat, "browser_error": browser_error,
            "session_s": round(wall, 2), **counts,
            "tokens": len(src), "share_generated": src.count("g") / len(src),
            "share_picked": src.count("c") / len(src), "share_typed": src.count("t") / len(src),
            "ppl_policy_own": ppl_own, "ppl_onpanda_sft": ppl_sft, "ppl_post_edit": ppl_post,
            "ppl_increase_onpanda_pct": 100 * (ppl_sft / ppl_own - 1),
            "ppl_increase_post_edit_pct": 100 * (ppl_post / ppl_own - 1)}


def summarize(runs: list[dict]) -> dict:
    def spread(vals: list[float], nd: int = 4) -> dict:
        return {"median": round(statistics.median(vals), nd), "min": round(min(vals), nd), "max": round(max(vals), nd)}

    p50s = [statistics.median(r["latency_s"]) * 1000 for r in runs]
    p90s = [statistics.quantiles(r["latency_s"], n=10)[-1] * 1000 for r in runs if len(r["latency_s"]) >= 10]
    out = {"click_to_first_token_p50_ms": spread(p50s, 1), "click_to_first_token_p90_ms": spread(p90s, 1)
           if p90s else None}
    b = [statistics.median(r["browser_latency_s"]) * 1000 for r in runs if r["browser_latency_s"]]
    if b:
        out["browser_click_to_first_token_p50_ms"] = spread(b, 1)
    for k in ("share_generated", "share_picked", "share_typed", "ppl_policy_own", "ppl_onpanda_sft", "ppl_post_edit",
              "ppl_increase_onpanda_pct", "ppl_increase_post_edit_pct", "corrections", "session_s"):
        out[k] = spread([float(r[k]) for r in runs])
    return out


def readme_rows(j: dict) -> list[list[str]]:
    """README / docs table: figure | median [min–max] over the runs (tests/test_docs_numbers.py checks it)."""
    s = j["summary"]

    def cell(m: dict, fmt: str, scale: float = 1, unit: str = "") -> str:
        f = lambda x: format(x * scale, fmt)  # noqa: E731
        return f"{f(m['median'])}{unit} [{f(m['min'])}–{f(m['max'])}]"

    rows = [["click → first continued token, p50, HTTP API", cell(s["click_to_first_token_p50_ms"], ".1f", unit=" ms")]]
    if s.get("click_to_first_token_p90_ms"):
        rows.append(["click → first continued token, p90, HTTP API", cell(s["click_to_first_token_p90_ms"], ".1f",
                                                                          unit=" ms")])
    if s.get("browser_click_to_first_token_p50_ms"):
        rows.append([f"click → first continued token, p50, in Chromium ({len(j['runs'][0]['browser_latency_s'])} "
                     "clicks per run)", cell(s["browser_click_to_first_token_p50_ms"], ".1f", unit=" ms")])
    rows += [[f"corrections to reach {j['prompts']} correct answers", cell(s["corrections"], ".0f")],
             ["tokens of the good dialogs written by the model", cell(s["share_generated"], ".1f", 100, "%")],
             ["… picked from the top-k", cell(s["share_picked"], ".1f", 100, "%")],
             ["… typed", cell(s["share_typed"], ".1f", 100, "%")],
             ["perplexity under the policy: its own first responses", cell(s["ppl_policy_own"], ".3f")],
             ["… of the SFT data from locate-correct-continue", cell(s["ppl_onpanda_sft"], ".3f")
              + f", {s['ppl_increase_onpanda_pct']['median']:+.1f}%"],
             ["… of post-edited data (a scripted full rewrite)", cell(s["ppl_post_edit"], ".3f")
              + f", {s['ppl_increase_post_edit_pct']['median']:+.1f}%"]]
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, s = result["runs"], result["summary"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for i, r in enumerate(runs):
        ax[0].hist([x * 1000 for x in r["latency_s"]], bins=20, alpha=0.5, label=f"run {i + 1} (API)")
        if r["browser_latency_s"]:
            ax[0].hist([x * 1000 for x in r["browser_latency_s"]], bins=10, alpha=0.5, histtype="step",
                       label=f"run {i + 1} (browser)")
    ax[0].axvline(300, color="r", ls="--", label="goal 300 ms")
    ax[0].set(title="click -> first continued token", xlabel="ms", ylabel="corrections")
    ax[0].legend(fontsize=7)
    shares = [s["share_generated"]["median"], s["share_picked"]["median"], s["share_typed"]["median"]]
    ax[1].bar(["model-generated", "picked from top-k", "typed"], [100 * x for x in shares],
              color=["#69c", "#9c6", "#c66"])
    ax[1].set(title="tokens of the good dialogs, by author", ylabel="%")
    for j, v in enumerate(shares):
        ax[1].text(j, 100 * v, f"{100 * v:.1f}%", ha="center", va="bottom")
    vals = [s["ppl_increase_onpanda_pct"]["median"], s["ppl_increase_post_edit_pct"]["median"]]
    ax[2].bar(["locate-correct-continue", "post-editing (full rewrite)"], vals, color=["#69c", "#c96"])
    ax[2].set(title="perplexity under the policy vs its own responses", ylabel="increase, %")
    for j, v in enumerate(vals):
        ax[2].text(j, v, f"{v:+.1f}%", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--browser-clicks", type=int, default=10)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-lock", action="store_true", help="a quick check of this script: its figures are not "
                    "for publishing (they were not measured while the host's benchmarks take turns)")
    args = ap.parse_args()
    with open("/tmp/shoal-bench.lock", "a") as lock:
        if not args.no_lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # benchmarks on this host take turns
        import torch

        torch.set_num_threads(1)
        from shoal.annotate.demo_models import make_repro_checkpoint
        from shoal.annotate.model import LocalModel

        model = LocalModel.load(make_repro_checkpoint(MODELS / "student-demo.pt"))
        items = problems(args.prompts)
        runs = [one_run(model, items, args) for _ in range(args.runs)]
    result = {"bench": "annotate",
              "model": "shoal.train.repro student (1 layer, width 64, 100 SFT steps), CPU, 1 thread",
              "prompts": args.prompts, "k": args.k, "runs": runs, "summary": summarize(runs),
              "host": "2 cores shared with other sessions: timings are noisy", "locked": not args.no_lock,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
