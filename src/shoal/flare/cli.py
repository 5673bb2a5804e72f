"""`shoal flare ...`: the taxonomy, one diagnosed episode (with or without breakpoint regeneration),
and the SFT export of diagnosed episodes."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

flare_app = typer.Typer(help="FLARE: step diagnosis, breakpoint regeneration, training exports (docs/flare.md).",
                        no_args_is_help=True)
console = Console()


@flare_app.command("taxonomy")
def taxonomy(as_json: bool = typer.Option(False, "--json")):
    """The error classes and risk levels a diagnosis uses."""
    from .schema import TAXONOMY, Risk

    if as_json:
        print(json.dumps({"risk": [r.value for r in Risk], "error_class": {c.value: d for c, d in TAXONOMY.items()}}))
        return
    t = Table("error_class", "meaning")
    for c, d in TAXONOMY.items():
        t.add_row(c.value, d)
    console.print(t)
    console.print("risk: " + " < ".join(r.value for r in Risk))


@flare_app.command("run")
def run(task: str = typer.Argument(..., help="instance id of a bundled SWE task"),
        p: float = typer.Option(0.3, "--p", help="the fallible oracle's mistake probability per turn"),
        seed: int = typer.Option(0, "--seed"),
        threshold: str = typer.Option("high", "--threshold", help="risk that triggers regeneration; 'off' for none"),
        regens: int = typer.Option(3, "--regens", help="at most this many regenerations"),
        url: str | None = typer.Option(None, "--url", envvar="SHOAL_LLM_URL", help="policy: an OpenAI-compatible "
                                       "endpoint instead of the fallible oracle"),
        model: str = typer.Option("default", "--model", envvar="SHOAL_LLM_MODEL"),
        judge_url: str | None = typer.Option(None, "--judge-url", help="diagnose with an LLM judge at this endpoint"),
        judge_model: str = typer.Option("judge", "--judge-model"),
        root: str | None = typer.Option(None, "--root", envvar="SHOAL_ROOT"),
        log: str | None = typer.Option(None, "--log", help="trajectory log (SQLite path or postgresql:// URL); "
                                       "with --episode, running the same command again resumes a killed run"),
        episode: str | None = typer.Option(None, "--episode", help="episode id in --log"),
        out: Path | None = typer.Option(None, "--out", help="write the episode (JSON) here")):
    """Run one episode in-process (root), diagnosing every step; print the steps and interventions."""
    from ..host import Host
    from ..rollout.policy import ChatEndpointPolicy, Policy
    from ..tasks.swe import load_suite
    from .diagnoser import Diagnoser
    from .judge import LLMJudge
    from .policy import FallibleOraclePolicy
    from .programmatic import ProgrammaticDiagnoser
    from .regen import Budget, run_flare

    t = next((x for x in load_suite() if x.instance_id == task), None)
    if t is None:
        raise typer.BadParameter(f"no bundled task {task!r} (`shoal tasks` lists the suite)")
    host = Host.get(root) if root else Host.get()
    policy: Policy = ChatEndpointPolicy(url, model) if url else FallibleOraclePolicy(t, p=p, seed=seed)
    dg: Diagnoser = LLMJudge(judge_url, judge_model) if judge_url else ProgrammaticDiagnoser()
    from ..trajlog import TrajectoryLog

    if episode and not log:
        raise typer.BadParameter("--episode needs --log (the log the episode is in)")
    ep = asyncio.run(run_flare(t, policy, host, diagnoser=dg, threshold=None if threshold == "off" else threshold,
                               budget=Budget(regenerations=regens), log=TrajectoryLog(log) if log else None,
                               episode_id=episode))
    tab = Table("step", "action", "risk", "class", "evidence")
    for s, d in zip(ep.trace.steps, ep.diagnoses):
        tab.add_row(str(s.step), ", ".join(a.tool for a in s.actions) + (f" ({s.thought})" if s.thought else ""),
                    d.risk.value, d.error_class.value, d.evidence[:90])
    console.print(tab)
    for i in ep.interventions:
        d = i["diagnosis"]
        console.print(f"regenerated step {i['step']} ({d['risk']}, {d['error_class']}): {d['evidence'][:100]}")
    console.print(f"resolved={ep.resolved} tokens={ep.tokens} sandbox_s={ep.sandbox_s:.1f} "
                  f"regenerations={ep.regenerations} replayed_from_log={ep.replayed}")
    if out:
        out.write_text(json.dumps(ep.to_dict(), indent=1))


@flare_app.command("export-sft")
def export_sft(episodes: Path = typer.Argument(..., help="JSONL of episodes written by `shoal flare run --out` "
                                                       "(one JSON object per line) or FlareEpisode.to_dict()"),
               out: Path = typer.Argument(..., help="the TRL SFT dataset (JSONL) to write"),
               top: int | None = typer.Option(None, "--top"),
               min_score: float = typer.Option(0.0, "--min-score")):
    """Rank resolved episodes by process score and write the kept ones for TRL's SFTTrainer."""
    from .exports import write_sft_jsonl
    from .schema import StepDiagnosis

    items = []
    for i, line in enumerate(episodes.read_text().splitlines(), 1):
        if line.strip():
            try:
                d = json.loads(line)
                items.append((d, [StepDiagnosis.model_validate(x) for x in d["diagnoses"]]))
            except (ValueError, KeyError) as e:
                raise typer.BadParameter(f"{episodes}:{i}: not a diagnosed episode: {e}") from None
    n = write_sft_jsonl(items, out, top=top, min_score=min_score)
    console.print(f"{n} of {len(items)} episodes written to {out}")
