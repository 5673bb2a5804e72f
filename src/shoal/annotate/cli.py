"""`shoal annotate serve|export`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

app = typer.Typer(help="Token-level correction annotation (docs/annotate.md).", no_args_is_help=True)

DEMO_DIR = Path.home() / ".cache" / "shoal-annotate"


def open_model(model: str | None, openai: str | None, openai_model: str | None, tokenizer: str | None,
               chat: bool = False):
    """The local model at `model`, or a client of `openai` (tokenizer: the served model's, locally);
    `chat`: its chat endpoint continues the response (an assistant prefill) instead of completions."""
    from ..core.errors import InvalidArgument
    from .model import LocalModel, OpenAIChatModel, OpenAIModel

    if openai:
        src = tokenizer or model
        if not src or not openai_model:
            raise InvalidArgument("--openai needs --openai-model and the model's tokenizer (--tokenizer or --model)")
        cls = OpenAIChatModel if chat else OpenAIModel
        return cls(openai, openai_model, LocalModel.load(src).tokenizer if Path(src).suffix == ".pt"
                   else _hf_tokenizer(src))
    if not model:
        raise InvalidArgument("give --model PATH (an HF directory or a repro *.pt), --openai URL, or --demo")
    return LocalModel.load(model)


def _hf_tokenizer(path: str):
    from .tokens import HFTokenizer

    return HFTokenizer.load(path)


def load_items(store, prompts: Path | None, episodes: Path | None) -> list[str]:
    from .app import episode_items

    ids = []
    for path, kind in ((prompts, "prompt"), (episodes, "episode")):
        if path is None:
            continue
        for n, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if kind == "prompt":
                item_id = str(row.get("id") or f"{path.stem}-{n}")
                prompt = {"messages": row["messages"]} if "messages" in row else {"text": row["text"]}
                store.add_item(item_id, prompt, title=row.get("title", item_id))
                ids.append(item_id)
            else:
                for it in episode_items(row, str(row.get("episode_id") or f"{path.stem}-{n}")):
                    store.add_item(it["id"], it["prompt"], kind="episode", title=it["title"],
                                   response=it["response"], meta=it["meta"])
                    ids.append(it["id"])
    return ids


def demo_prompts(path: Path, n: int = 12) -> Path:
    import random

    from ..train import repro

    rng = random.Random(7)
    prompts = [repro.problem(rng, repro.CATEGORIES[i % 3])[0] for i in range(n)]
    rows = [{"id": f"arith-{i}", "text": p, "title": p} for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@app.command()
def serve(db: str = typer.Option("annotate.db", help="SQLite file, or a postgresql:// DSN (the fleet's database)"),
          model: str = typer.Option(None, help="local model: a Hugging Face directory or a repro checkpoint (*.pt)"),
          openai: str = typer.Option(None, help="an OpenAI-compatible server's base URL (vLLM, SGLang, llama.cpp)"),
          openai_model: str = typer.Option(None, help="the served model's name"),
          tokenizer: str = typer.Option(None, help="the served model's tokenizer (a local HF directory)"),
          prompts: Path = typer.Option(None, help="JSONL: {id, text} or {id, messages}"),
          episodes: Path = typer.Option(None, help="JSONL of Shoal episode records (one item per assistant step)"),
          annotator: list[str] = typer.Option(["me"], help="accounts to create (each gets a login link)"),
          admin: list[str] = typer.Option([], help="admin accounts: see every item, share items (POST /api/share)"),
          deal: bool = typer.Option(False, help="deal the items out round-robin (default: every annotator gets all)"),
          chat: bool = typer.Option(False, help="--openai: continue through /v1/chat/completions (assistant prefill)"),
          trajlog: str = typer.Option(None, help="the trajectory log the --episodes ran in: a corrected tool call "
                                      "then runs in a branch of its episode (SQLite path or postgresql:// DSN)"),
          sandboxes: str = typer.Option(None, help="with --trajlog: shoald's URL, or 'local' (default: $SHOAL_URL)"),
          suite: str = typer.Option(None, help="with --trajlog: the SWE suite whose tasks the episodes ran"),
          demo: bool = typer.Option(False, help="a shoal.train.repro student and arithmetic prompts, made locally"),
          host: str = "127.0.0.1", port: int = 8070, k: int = 20, max_tokens: int = 96) -> None:
    """Start the annotation app; prints one login link per annotator."""
    import uvicorn

    from .app import Annotator, make_app
    from .tree import AnnotationStore

    if demo:
        from .demo_models import make_repro_checkpoint

        DEMO_DIR.mkdir(parents=True, exist_ok=True)
        model = model or str(make_repro_checkpoint(DEMO_DIR / "student-demo.pt"))
        prompts = prompts or demo_prompts(DEMO_DIR / "prompts.jsonl")
    backend = open_model(model, openai, openai_model, tokenizer, chat)
    store = AnnotationStore(db)
    items = load_items(store, prompts, episodes) or store.items()
    for name, token in accounts(store, items, annotator, admin, deal).items():
        print(f"{name}{' (admin)' if name in admin else ''}: http://{host}:{port}/login?token={token}",
              file=sys.stderr)
    env = open_env(trajlog, sandboxes, suite) if trajlog else None
    uvicorn.run(make_app(Annotator(store, backend, k=k, max_tokens=max_tokens, env=env)), host=host, port=port,
                log_level="warning")


def accounts(store, items: list[str], annotators: list[str], admins: list[str], deal: bool) -> dict[str, str]:
    """Login tokens by name: each annotator's queue is every item, or a round-robin share (`deal`);
    admins see everything and queue nothing."""
    out = {}
    for j, name in enumerate(annotators):
        out[name] = store.add_annotator(name)
        store.assign(name, items[j::len(annotators)] if deal else items)
    for name in admins:
        out[name] = store.add_annotator(name, admin=True)
    return out


def open_env(trajlog: str, sandboxes: str | None, suite: str | None):
    """The environment side for episode items: their trajectory log, a sandbox backend, and their
    tasks (the SWE suite's, by the episode's instance_id)."""
    from ..backends import open_backend
    from ..core.errors import InvalidArgument
    from ..tasks.swe.suite import load_suite
    from ..trajlog import TrajectoryLog
    from .agent import EpisodeEnv

    tasks = {t.id: t for t in load_suite(suite)}

    def task_for(item: dict):
        iid = (item.get("meta") or {}).get("instance_id")
        if iid not in tasks:
            raise InvalidArgument(f"no task {iid!r} in the suite: give the --suite the episodes ran")
        return tasks[iid]

    return EpisodeEnv(TrajectoryLog(trajlog), open_backend(sandboxes), task_for)


@app.command("export")
def export_cmd(kind: str = typer.Argument(..., help="sft | pairs | token_level | corrections"),
               db: str = typer.Option("annotate.db"), model: str = typer.Option(None),
               tokenizer: str = typer.Option(None)) -> None:
    """Write an export of every tree as JSON lines to stdout."""
    from . import export
    from .tree import AnnotationStore

    tok = LocalModelTokenizer(model) if model else _hf_tokenizer(tokenizer)
    fns = {"sft": export.sft, "pairs": export.preference_pairs, "token_level": export.token_level,
           "corrections": export.corrections}
    if kind not in fns:
        raise typer.BadParameter(f"choose from {sorted(fns)}")
    for row in fns[kind](AnnotationStore(db).trees(), tok):  # type: ignore[operator]  # each takes (trees, tok)
        print(json.dumps(row, ensure_ascii=False))


def LocalModelTokenizer(path: str):  # noqa: N802  (reads as a constructor at the call site)
    from .model import LocalModel

    return LocalModel.load(path).tokenizer
