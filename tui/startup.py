"""The start-up screen's text, as pure functions of a StartupProgress (no Textual import).

While the engine starts, the screen says which phase runs and for how long, the phases done (with
their times) and to come, the engine's last progress lines and the last line of its log, and
where that log is: a first start on a small machine can take a minute or more (kernels, weights),
and the user should see why and where to look.
"""

from __future__ import annotations

from rich.text import Text
from workbench.core.trace.startup import PHASE_LABELS, PHASES, StartupProgress
from workbench.tui.fmt import shorten


def startup_title(sp: StartupProgress, waited_s: float) -> Text:
    """`Starting… 42 s · loading weights` (the phase once one is known)."""
    out = Text(f"Starting… {waited_s:.0f} s", style="bold")
    cur = sp.current
    if cur is not None:
        out.append(f" · {_short(cur.label)}", style="bold")
    return out


def _short(label: str) -> str:
    return label.split(" (")[0]


def phase_lines(sp: StartupProgress, now_ns: int, width: int = 100) -> Text:
    """One line per phase: ✓ done (its time), ▶ running (its time so far), · still to come."""
    out = Text()
    began = {p.name for p in sp.phases}
    rows = [(p.name, p) for p in sp.phases if p.name != "ready"]
    if sp.phases and not sp.done:  # what is still to come (kernels only come when they must be built)
        rows += [(n, None) for n in PHASES if n not in began and n not in ("kernels", "ready")]
    for i, (name, view) in enumerate(rows):
        if i:
            out.append("\n")
        label = PHASE_LABELS.get(name, name)
        if view is None:
            out.append(f"  · {label}", style="dim")
            continue
        mark, style = ("▶", "bold") if view.running else (("✗", "bold red") if name == "failed" else ("✓", ""))
        what = f"{label}: {view.detail}" if view.detail else label
        out.append(f"  {mark} {shorten(what, max(20, width - 14))}", style=style)
        if name != "failed":
            out.append(f"  {view.elapsed(now_ns):.1f} s", style=style or "dim")
    return out


def startup_body(
    sp: StartupProgress, now_ns: int, lines: list[str], tail: str, log_path: str | None, width: int = 100
) -> Text:
    """The start-up box under its title: phases, the last progress lines, the log's last line, the log."""
    body = phase_lines(sp, now_ns, width)
    recent = lines[-4:] if sp.phases else lines[-12:]
    if recent or not sp.phases:
        if sp.phases:
            body.append("\n\n")
        body.append("\n".join(recent) or "loading the serving core…")
    if tail:
        body.append("\n" + tail, style="dim")
    path = log_path or sp.log_path
    if path:
        body.append(f"\nlog (weight loading, warnings, errors): {path}", style="dim")
    return body
