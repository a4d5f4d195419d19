"""Small, pure formatting helpers shared by the panels (no Textual import)."""

from __future__ import annotations

from collections.abc import Sequence

_BLOCKS = "▁▂▃▄▅▆▇█"


def fmt_s(seconds: float | None, compact: bool = False) -> str:
    """A latency: '850 µs', '12.3 ms', '1.24 s' ('12.3ms' when compact); '–' when unknown."""
    if seconds is None:
        return "–"
    sp = "" if compact else " "
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}{sp}µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f}{sp}ms" if seconds < 0.1 else f"{seconds * 1e3:.0f}{sp}ms"
    return f"{seconds:.2f}{sp}s" if seconds < 100 else f"{seconds:.0f}{sp}s"


def fmt_age(ns: int | None) -> str:
    """An age in ns as '0.4s', '12s', '3m05s'."""
    if ns is None or ns < 0:
        return "–"
    s = ns / 1e9
    if s < 10:
        return f"{s:.1f}s"
    if s < 600:
        return f"{s:.0f}s"
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def fmt_pct(n: float, total: float) -> str:
    """A share of a whole as a percentage; `<1%` and `>99%` so a few tokens of a big KV pool
    never read as none or all of it (36 held slots of 1.2M printed `0%` beside `lock 1`)."""
    p = 100 * n / total if total else 0.0
    if 0 < p < 1:
        return "<1%"
    if 99 < p < 100:
        return ">99%"
    return f"{p:.0f}%"


def fmt_count(n: float) -> str:
    """1234 -> '1.2k', 5_600_000 -> '5.6M'."""
    n = float(n)
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def spark(values: Sequence[float], width: int | None = None, hi: float | None = None) -> str:
    """A one-line sparkline of the last `width` values, scaled to [0, hi] (hi: their max)."""
    vals = list(values)[-width:] if width else list(values)
    if not vals:
        return ""
    top = hi if hi is not None else max(vals)
    if top <= 0:
        return _BLOCKS[0] * len(vals)
    out = []
    for v in vals:
        k = int(round(max(0.0, min(1.0, v / top)) * (len(_BLOCKS) - 1)))
        out.append(_BLOCKS[k])
    return "".join(out)


def resample(values: Sequence[float], width: int) -> list[float]:
    """Shrink a series to at most `width` points by averaging buckets (keeps short series)."""
    vals = list(values)
    if len(vals) <= width or width <= 0:
        return vals
    out = []
    for i in range(width):
        a = i * len(vals) // width
        b = max(a + 1, (i + 1) * len(vals) // width)
        chunk = vals[a:b]
        out.append(sum(chunk) / len(chunk))
    return out


def shorten(text: str, n: int) -> str:
    """One line of at most n characters (whitespace collapsed, an ellipsis when cut)."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: max(0, n - 1)] + "…"


def plain_text(renderable, width: int = 120) -> str:
    """What a Rich renderable looks like as plain text (tests, and panels that export text)."""
    from rich.console import Console

    console = Console(
        width=width,
        no_color=True,
        color_system=None,
        record=False,
        file=None,
        legacy_windows=False,
        force_terminal=False,
    )
    with console.capture() as cap:
        console.print(renderable)
    return cap.get()
