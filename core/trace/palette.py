"""The colour language of every view: one colour per meaning, defined once.

The TUI (Rich styles in its panels, the help screen's swatches) and the Jupyter
widgets (plotly traces, legends) both take their colours from here, so "orange"
means decode in a terminal and in a notebook alike. Nothing here knows about a
front end: these are plain hex strings (Tableau 10, legible on the TUI's dark
background and on plotly's white one).

A meaning is a noun a view can point at:
  cached     prefix tokens reused from the radix cache (a cache hit)
  computed   prompt tokens computed by a prefill (extend) step
  decode     tokens produced by decode steps (and the requests decoding them)
  waiting    requests queued for prefill (and the time they spend there)
  locked     KV held by running requests: lock_ref > 0, cannot be evicted ("used" in the KV pool)
  evictable  cached KV nobody holds, reclaimed on demand
  free       unallocated KV slots
  evicted    KV dropped from the cache to make room
  retracted  a running request pushed back to waiting because the KV pool ran out
  transfer   KV handed from a prefill server to a decode server (disaggregated serving)
"""

from __future__ import annotations

#: meaning -> colour (#rrggbb). The only place these meanings get a colour.
PALETTE: dict[str, str] = {
    "cached": "#4e79a7",  # blue
    "computed": "#59a14f",  # green
    "decode": "#f28e2b",  # orange
    "waiting": "#edc948",  # yellow
    "locked": "#e15759",  # red
    "evictable": "#a0cbe8",  # light blue: cached, and free to go
    "free": "#bab0ac",  # grey
    "evicted": "#b07aa1",  # purple
    "retracted": "#ff9da7",  # pink
    "transfer": "#499894",  # dark teal (Tableau 20): KV on the wire between two servers
}

#: meaning -> what it means, in the words the TUI help and the widget legends use.
MEANINGS: dict[str, str] = {
    "cached": "prefix tokens reused from the radix cache",
    "computed": "prompt tokens computed by prefill",
    "decode": "decode tokens (requests decoding)",
    "waiting": "requests waiting for prefill",
    "locked": "KV held by running requests (lock > 0, not evictable)",
    "evictable": "cached KV nobody holds (reclaimed on demand)",
    "free": "free KV slots",
    "evicted": "KV evicted to make room",
    "retracted": "requests retracted (KV pool ran out)",
    "transfer": "KV handed from prefill to decode (PD)",
}

#: Colours with no meaning of their own for neutral chrome (latency metrics are not states).
METRIC_COLORS: dict[str, str] = {"ttft": "#76b7b2", "tpot": "#9c755f", "e2e": "#79706e"}

CACHED = PALETTE["cached"]
COMPUTED = PALETTE["computed"]
DECODE = PALETTE["decode"]
WAITING = PALETTE["waiting"]
LOCKED = PALETTE["locked"]
EVICTABLE = PALETTE["evictable"]
FREE = PALETTE["free"]
EVICTED = PALETTE["evicted"]
RETRACTED = PALETTE["retracted"]
TRANSFER = PALETTE["transfer"]


def colour(meaning: str) -> str:
    """The hex colour of a meaning (KeyError for a meaning the language does not have)."""
    return PALETTE[meaning]


#: Colours for LoRA adapters (multi-LoRA serving): not meanings but names, so a series of their own,
#: none of them a meaning's colour (Tableau 20's remaining hues). The base model has none.
ADAPTER_COLORS: tuple[str, ...] = ("#8cd17d", "#b6992d", "#f1ce63", "#86bcb6", "#d37295", "#fabfd2", "#d4a6c8")


def adapter_colour(name: str) -> str:
    """An adapter's colour: the same name gets the same colour in every process and run (crc32 of the
    name, not Python's salted hash)."""
    import zlib

    return ADAPTER_COLORS[zlib.crc32(name.encode()) % len(ADAPTER_COLORS)]
