"""A per-episode HTML report: the task, its process-level scores, the subgoal timeline, drift, and
a filmstrip of the screen after each step with the subgoals that step fulfilled marked. One
self-contained file (screenshots inline as data: URIs), viewable in any browser."""
from __future__ import annotations

import base64
import html
from pathlib import Path

from .metrics import drift
from .task import Episode


def render(ep: Episode) -> str:
    t, sc, d = ep.task, ep.score, drift(ep.advances)
    by_step: dict[int, list[str]] = {}
    for g, at in zip(t.subgoals, ep.fulfilled_at, strict=True):
        if at is not None:
            by_step.setdefault(at, []).append(g.id)
    e = html.escape
    rows = "".join(
        f"<tr class={'ok' if at is not None else 'no'}><td>{e(g.id)}</td><td>{e(g.description)}</td>"
        f"<td>{e(', '.join(g.depends_on))}</td><td>{'step ' + str(at) if at is not None else 'not fulfilled'}</td></tr>"
        for g, at in zip(t.subgoals, ep.fulfilled_at, strict=True))
    cards = []
    for i in range(ep.steps):
        marks = by_step.get(i, [])
        img = (f'<img src="data:image/png;base64,{base64.b64encode(ep.shots[i]).decode()}" alt="after step {i}">'
               if i < len(ep.shots) else "")
        act = e(ep.actions[i]) if i < len(ep.actions) else ""
        badge = ("".join(f'<span class="mark">✓ {e(m)}</span>' for m in marks)
                 or '<span class="drift">no progress</span>')
        cards.append(f'<figure class="{"adv" if marks else "idle"}">{img}<figcaption><b>step {i}</b> '
                     f'<code>{act}</code><br>{badge}</figcaption></figure>')
    variant = "; variant" if t.variant else ""
    title = f"{e(t.id)} <small>({e(t.category)}; apps: {e(', '.join(t.apps))}{variant})</small>"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(t.id)}: episode report</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left}} tr.ok td:last-child{{color:#186a18}}
tr.no td:last-child{{color:#a01818}} .strip{{display:flex;flex-wrap:wrap;gap:.8em}}
figure{{margin:0;width:340px;border:2px solid #ccc;padding:.3em}} figure.adv{{border-color:#2a8a2a}}
figure.idle{{border-color:#d8a020}} img{{width:100%}} code{{font-size:.8em;word-break:break-all}}
.mark{{background:#dff0d8;padding:0 .3em;margin-right:.3em}} .drift{{background:#fcf3d4;padding:0 .3em}}</style>
</head><body><h1>{title}</h1>
<p>{e(t.instruction)}</p>
<p><b>fulfilled</b> {sc.fraction:.2f} &nbsp; <b>ordered prefix</b> {sc.prefix:.2f} &nbsp; <b>complete</b> {sc.complete}
&nbsp; <b>steps</b> {ep.steps} &nbsp; <b>drift</b>: {d['runs']} runs, longest {d['longest']} steps,
{d['steps']} steps in all</p>
<table><tr><th>subgoal</th><th>description</th><th>depends on</th><th>fulfilled</th></tr>{rows}</table>
<h2>Filmstrip</h2><div class="strip">{''.join(cards)}</div></body></html>
"""


def write(ep: Episode, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render(ep))
    return p
