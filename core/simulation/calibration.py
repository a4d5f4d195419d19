"""Calibration: the cost model corrected by step times measured on a real engine.

`workbench bench calibrate` runs the real Engine on a grid of pass shapes (decode batches of 1 to
64 at two context lengths; prompts of 32 to 2048 tokens) and writes, for each, the measured time
of a whole engine step (scheduling, the pass, sampling, result processing, streaming) beside the
cost model's prediction. `Calibration.factor` interpolates measured / predicted over that grid
(in log2 of the batch for decode, of the token count for prefill; clamped at the ends), and the
simulator multiplies each predicted pass by it. A shipped file (data/) calibrates `cpu-here` for
the default model; on another machine the same command writes its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DATA = Path(__file__).parent / "data"


@dataclass
class Calibration:
    hardware: str
    model: str
    points: list[dict] = field(default_factory=list)  # {kind, batch | tokens, context, measured_s, predicted_s}
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        d = json.loads(Path(path).read_text())
        return cls(d["hardware"], d["model"], d["points"], d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps(
                {"hardware": self.hardware, "model": self.model, "points": self.points, "meta": self.meta}, indent=1
            )
        )

    def _curve(self, kind: str) -> list[tuple[float, float]]:
        key = "batch" if kind == "decode" else "tokens"
        by_x: dict[int, list[float]] = {}
        for p in self.points:
            if p["kind"] == kind and p["predicted_s"] > 0:
                by_x.setdefault(p[key], []).append(p["measured_s"] / p["predicted_s"])
        return sorted((math.log2(x), sum(r) / len(r)) for x, r in by_x.items())

    def factor(self, new_tokens: list[int]) -> float:
        """measured / predicted for a pass: decode (every request one token) by its batch size,
        prefill by its token count; 1.0 without points of that kind."""
        decode = all(n == 1 for n in new_tokens)
        curve = self._curve("decode" if decode else "extend")
        if not curve:
            return 1.0
        x = math.log2(max(1, len(new_tokens) if decode else sum(new_tokens)))
        if x <= curve[0][0]:
            return curve[0][1]
        for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return curve[-1][1]


def shipped(hardware: str, model: str) -> Optional[Calibration]:
    """The calibration shipped for this hardware and model, if any (data/HARDWARE--MODEL.json)."""
    path = DATA / f"{hardware}--{model}.json"
    return Calibration.load(path) if path.is_file() else None
