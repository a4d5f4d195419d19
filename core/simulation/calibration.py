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

DATA = Path(__file__).parent / "data"


def cpu_class() -> str:
    """The CPU class a `cpu-here` calibration belongs to: 'avx512bf16' (bfloat16 dot products, the
    engine's default dtype bfloat16), 'avx2' or 'other'. A calibration measured on one class does not
    describe another (different kernels, different default dtype)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "other"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    return "avx2" if "avx2" in flags else "other"


def extend_point(batch: int, context: int, measured_s: float, parts: tuple, steps: int = 1) -> dict:
    """A prefill point of a calibration: `batch` prompts of `context` tokens took `measured_s`; `parts`
    is the prediction's (linear + comm, attention, overhead), summed over the `steps` the engine ran."""
    lin, att, over = parts
    return dict(
        kind="extend",
        tokens=batch * context,
        batch=batch,
        context=context,
        steps=steps,
        measured_s=measured_s,
        predicted_s=lin + att + over,
        pred_linear=lin,
        pred_attention=att,
        pred_overhead=over,
    )


@dataclass
class Calibration:
    hardware: str
    model: str
    points: list[dict] = field(default_factory=list)  # {kind, batch | tokens, context, measured_s, predicted_s}
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
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

    def extend_fit(self) -> tuple[float, float, float] | None:
        """Weights (a, b, c) with measured ~ a*linear + b*attention + c*overhead over the prefill
        points that carry the prediction's parts (`pred_linear`, `pred_attention`, `pred_overhead`),
        fitted on relative error and none negative; None without at least four such points.

        Why a fit and not one factor per token count: a batch of short prompts and one long prompt
        of the same token count differ in attention, and one factor measured on single prompts made
        32 short prompts at once about 1.7x slower in simulation than on the real engine."""
        pts = [p for p in self.points if p["kind"] == "extend" and "pred_linear" in p and p["measured_s"] > 0]
        if len(pts) < 4:
            return None
        if getattr(self, "_fit_key", None) == len(self.points):
            return self._fit
        import numpy as np

        rows = np.array([[p["pred_linear"], p["pred_attention"], p["pred_overhead"]] for p in pts])
        meas = np.array([p["measured_s"] for p in pts])
        a_rel, ones = rows / meas[:, None], np.ones(len(pts))
        best, best_err = None, float("inf")
        for mask in range(1, 8):  # every subset of the three terms: the best fit with no negative weight
            cols = [i for i in range(3) if mask >> i & 1]
            sol, *_ = np.linalg.lstsq(a_rel[:, cols], ones, rcond=None)
            if (sol < 0).any():
                continue
            w = np.zeros(3)
            w[cols] = sol
            err = float(((a_rel @ w - 1) ** 2).sum())
            if err < best_err:
                best, best_err = tuple(float(x) for x in w), err
        self._fit_key, self._fit = len(self.points), best
        return best

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


def shipped_path(hardware: str, model: str) -> Path:
    """Where the calibration of this hardware and model is shipped: data/HARDWARE--MODEL.json, and for
    `cpu-here` data/cpu-here--MODEL--CPUCLASS.json (cpu_class(): this machine's kind of CPU)."""
    if hardware == "cpu-here":
        return DATA / f"{hardware}--{model}--{cpu_class()}.json"
    return DATA / f"{hardware}--{model}.json"


def shipped(hardware: str, model: str) -> Calibration | None:
    """The calibration shipped for this hardware and model (and, for cpu-here, this CPU class), if any."""
    path = shipped_path(hardware, model)
    return Calibration.load(path) if path.is_file() else None
