"""Calibration: the cost model corrected by step times measured on a real engine.

`workbench bench calibrate` runs the real Engine on a grid of pass shapes (decode batches of 1 to
64 at two context lengths; prompts of 32 to 2048 tokens) and writes, for each, the measured time
of a whole engine step (scheduling, the pass, sampling, result processing, streaming) beside the
cost model's prediction. `Calibration.factor` interpolates measured / predicted over that grid
(in log2 of the batch for decode, of the token count for prefill; clamped at the ends), and the
simulator multiplies each predicted pass by it. A shipped file (data/) calibrates `cpu-here` for
the default model, per CPU class.

`cpu-here` means "this machine", and machines of one class differ (an Intel Xeon runs bfloat16 at
half its float32 speed; an AMD EPYC of the same class does not). So a calibration records the
machine it was measured on (`machine()`: CPU model, cores, and a quick GEMM probe), and
`for_this_machine` picks, in order: this machine's own calibration (`bench calibrate` writes it to
the per-machine cache, `calibration_dir()`), else the shipped one with a warning when its machine
is not this one (another CPU model, or the probe more than PROBE_TOLERANCE away), saying how to
calibrate here.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent / "data"
# How far this machine's GEMM probe may be from the calibration machine's before predictions are
# called suspect: two runs of the probe on one quiet host agree within ~10%; a shared 2-core host
# drifts by ~20% over minutes.
PROBE_TOLERANCE = 0.35


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


def cpu_model() -> str:
    """This machine's CPU model name (/proc/cpuinfo), '' where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


@functools.lru_cache(maxsize=4)
def gemm_probe_gflops(dtype_bytes: int = 4) -> float:
    """A quick probe of one core's speed (~0.25 s): GFLOP/s of a GEMM shaped like a batch of 64 rows
    through the default model's MLP (64 x 576 x 1536) in the engine's dtype here (4: float32, 2:
    bfloat16), on one thread, the best of seven rounds. One thread because on a shared 2-core host a
    neighbour's load swings a two-thread probe threefold; one core's best round moves ~10%. Cached
    per process."""
    import torch

    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    a, b = torch.randn(64, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # first call: kernel selection, page faults
        best = float("inf")
        for _ in range(7):
            n, t0 = 0, time.perf_counter()
            while n < 4 or time.perf_counter() - t0 < 0.03:
                torch.mm(a, b)
                n += 1
            best = min(best, (time.perf_counter() - t0) / n)
    finally:
        torch.set_num_threads(threads)
    return 2 * 64 * 576 * 1536 / best / 1e9


def machine(dtype_bytes: int = 4) -> dict:
    """What identifies this machine in a calibration's meta: CPU model, class, cores, the GEMM probe."""
    return dict(
        cpu_model=cpu_model(),
        cpu_class=cpu_class(),
        cores=os.cpu_count() or 1,
        gemm_gflops=round(gemm_probe_gflops(dtype_bytes), 1),
    )


def machine_key() -> str:
    """A file-name-safe key of this machine's kind: CPU model, class and cores."""
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-") or "unknown-cpu"
    return f"{slug}--{cpu_class()}--{os.cpu_count() or 1}c"


def calibration_dir() -> Path:
    """Where `bench calibrate` caches this machine's calibrations: `$WORKBENCH_CALIBRATION_DIR`, else
    `$WORKBENCH_CACHE_DIR/calibrations` (default ~/.cache/workbench/calibrations)."""
    explicit = os.environ.get("WORKBENCH_CALIBRATION_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("WORKBENCH_CACHE_DIR") or "~/.cache/workbench").expanduser() / "calibrations"


def local_path(hardware: str, model: str) -> Path:
    """This machine's own calibration of `model` on `hardware` (written by `bench calibrate`)."""
    return calibration_dir() / f"{hardware}--{model}--{machine_key()}.json"


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


@dataclass
class CalibrationChoice:
    """The calibration a simulation of `hardware` uses, where it came from, and why it may be off."""

    calibration: Calibration | None
    source: str  # "this machine" (the per-machine cache), "shipped", or "none"
    path: Path | None = None
    warning: str | None = None


def mismatch(cal: Calibration) -> str | None:
    """Why `cal` (a cpu-here calibration) may not describe this machine, or None: another CPU model
    (or none recorded), or this machine's GEMM probe more than PROBE_TOLERANCE from the one recorded."""
    then = cal.meta.get("cpu_model")
    here = cpu_model()
    if not then:
        return f"it does not record the machine it was measured on (this one: {here or 'an unknown CPU'})"
    if then != here:
        return f"it was measured on {then}; this machine is {here or 'an unknown CPU'}"
    probe_then = cal.meta.get("gemm_gflops")
    if probe_then:
        now = gemm_probe_gflops(int(cal.meta.get("dtype_bytes", 4)))
        if abs(now / probe_then - 1) > PROBE_TOLERANCE:
            return (
                f"this {here} runs the GEMM probe at {now:.0f} GFLOP/s, the calibration's machine at "
                f"{probe_then:.0f} (a busier host, another core count or clock)"
            )
    return None


def for_this_machine(hardware: str, model: str) -> CalibrationChoice:
    """The calibration to simulate `model` on `hardware` with (see the module docstring): for
    cpu-here, this machine's own if `bench calibrate` cached one, else the shipped one, checked
    against this machine (`mismatch`); for a named GPU, the shipped one."""
    if hardware == "cpu-here":
        mine = local_path(hardware, model)
        if mine.is_file():
            return CalibrationChoice(Calibration.load(mine), "this machine", mine)
    path = shipped_path(hardware, model)
    if not path.is_file():
        return CalibrationChoice(None, "none")
    cal = Calibration.load(path)
    why = mismatch(cal) if hardware == "cpu-here" else None
    warning = None
    if why:
        how = "workbench bench calibrate" + ("" if model == "smollm2-135m" else f" --model WEIGHTS --sim-model {model}")
        warning = (
            f"the cpu-here calibration of {model} may be far off here: {why}. Run `{how}` (a few minutes) "
            f"to calibrate this machine; it is cached in {calibration_dir()} and used from then on."
        )
    return CalibrationChoice(cal, "shipped", path, warning)


_warned: set[str] = set()


def auto(hardware: str, model: str) -> CalibrationChoice:
    """`for_this_machine`, logging its warning once per process (a sweep builds many simulators)."""
    choice = for_this_machine(hardware, model)
    if choice.warning and choice.warning not in _warned:
        _warned.add(choice.warning)
        import logging

        logging.getLogger(__name__).warning("%s", choice.warning)
    return choice
