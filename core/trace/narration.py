"""One scheduler step in words (TraceState.narrate): what ran, what the KV pool did, why the rest wait.

The KV part accounts for every slot held by requests (kv.usage's `used`): `KV +a −b → h held`, where
a counts the slots requests took (new slots allocated, cached prefixes locked by admitted
requests) and b those they gave back (finished requests hand theirs to the radix cache, retracted
ones free theirs), so the held count of the previous step + a − b = h. Each release is named
(`finished kv-7 (−37 slots)`). Evictions move slots from the cache to the free pool and leave the
held count alone: they are their own part (`evicted 30 (1 node)`). Recordings made before the
decision carried these figures (kv_held −1) get the allocator's counts (`KV +a −b`), as before.
"""

from __future__ import annotations

from workbench.core.trace import events as ev
from workbench.core.trace.speculative import drafts_proposed
from workbench.core.trace.views import StepView

#: Why a waiting request was not admitted (events.StepDecision.stop_reason), in words.
#: "finishing": SGLang's running-request count still includes requests that finished in the last
#: step until the running batch is filtered; the limit looked reached while slots were free.
WAIT_REASONS = {
    "budget": "token budget",
    "kv": "no KV room",
    "running": "running limit",
    "finishing": "running limit counting finished requests not filtered out yet",
    "held": "held limit",
}

#: The step line's notation, one (term, meaning) per entry: the TUI's `?` screen and docs/tui.md.
STEP_LINE_HELP = (
    (
        "step N extend|decode",
        "the scheduler iteration and its batch: extend (prefill chunks) or decode (one token each)",
    ),
    ("n running decoded 1 token each", "a decode step: every running request got its next token"),
    ("admitted n from waiting (…)", "requests taken from the waiting queue into this step's prefill"),
    ("rid chunk k/n", "a long prompt prefilled n chunks at a time: this step ran chunk k"),
    ("a cached + b computed", "prompt tokens read from the radix cache + prompt tokens computed in this step"),
    ("budget a/b", "prompt tokens computed of the step's prefill token budget (chunk size / max prefill tokens)"),
    ("n running waited", "running requests that decoded nothing in this step: an extend step runs prefill only"),
    (
        "KV +a −b → h held",
        "KV slots held by requests: +a taken (new slots allocated, cached prefixes locked by admitted requests), "
        "−b given back (finished requests hand theirs to the radix cache, retracted ones free theirs); "
        "the last step's held count + a − b = h, the status line's `held`",
    ),
    (
        "(x new, y from cache, z returned)",
        "where the + came from, and slots dropped while results were processed "
        "(duplicates, rejected drafts, a finished request's unused row); `other ±n` if any slot went unaccounted",
    ),
    ("finished rid (−n slots)", "a request that finished in this step and the held slots it gave back"),
    ("evicted n (k nodes)", "cached slots freed from the radix tree's coldest leaves: cached → free, held unchanged"),
    (
        "retracted n (rid, −s slots)",
        "running requests sent back to the queue because the pool ran dry; they are prefilled again later (recomputed)",
    ),
    (
        "n waiting: why (rid next)",
        "why the rest still wait: token budget, no KV room, running limit (`… counting finished requests "
        "not filtered out yet`: SGLang's lag, a slot is in fact free), held for a shared prefix",
    ),
)

#: How a request gave its slots back (events.KVRelease.why), in the order the line names them.
_RELEASES = ("finished", "aborted", "retracted")


def _rids(rids: list[str]) -> str:
    return ", ".join(rids) if len(rids) <= 3 else f"{rids[0]}…{rids[-1]}"


def kv_parts(d: ev.StepDecision) -> list[tuple[str, int]]:
    """The signed moves of the held KV slots in a step, by cause: ("new", +n), ("from cache", +n),
    ("finished", −n), ("aborted", −n), ("retracted", −n), ("returned", −n), ("other", ±n); they sum
    to the change of the held count since the previous decision. Empty for older recordings."""
    if d.kv_held < 0:
        return []
    out = [("new", d.kv_alloc), ("from cache", d.kv_reused)]
    for why in _RELEASES:
        out.append((why, -sum(r.slots for r in d.released if r.why == why)))
    out += [("returned", -d.kv_returned), ("other", d.kv_other)]
    return [(k, v) for k, v in out if v]


def narrate_kv(d: ev.StepDecision) -> list[str]:
    """The KV parts of a step's line: the held slots' moves, then each release by name."""
    parts = kv_parts(d)
    if d.kv_held < 0:  # an older recording: the allocator's counts
        return [f"KV +{d.kv_alloc}" + (f" −{d.kv_freed}" if d.kv_freed else "")]
    plus = sum(v for _, v in parts if v > 0)
    minus = -sum(v for _, v in parts if v < 0)
    line = f"KV +{plus}" + (f" −{minus}" if minus else "") + f" → {d.kv_held} held"
    # The parts the named releases below do not tell: where the + came from, slots returned.
    rest = [(k, v) for k, v in parts if k not in _RELEASES]
    if [k for k, _ in rest] not in ([], ["new"]):
        line += " (" + ", ".join(f"{abs(v)} {k}" if k != "other" else f"other {v:+d}" for k, v in rest) + ")"
    out = [line]
    for why in _RELEASES:
        gone = [r for r in d.released if r.why == why and r.slots]
        if why == "retracted" or not gone:
            continue  # retractions are named with the retracted part
        slots = sum(r.slots for r in gone)
        who = gone[0].rid if len(gone) == 1 else f"{len(gone)} ({_rids([r.rid for r in gone])})"
        out.append(f"{why} {who} (−{slots} slots)")
    return out


def narrate_step(sv: StepView) -> str:
    """See TraceState.narrate."""
    d = sv.decision
    parts: list[str] = []
    if sv.mode == "decode" and sv.spec is not None:
        parts.append(narrate_spec(sv))
    elif sv.mode == "decode":
        parts.append(f"{len(sv.reqs)} running decoded 1 token each")
    else:
        prefills = [r for r in sv.reqs if r.computed > 0]
        admitted = list(d.admitted) if d is not None else [r.rid for r in prefills if r.chunk_index == 0]
        if admitted:
            parts.append(f"admitted {len(admitted)} from waiting ({_rids(admitted)})")
        chunks = [f"{r.rid} chunk {r.chunk_index + 1}/{r.num_chunks}" for r in prefills if r.num_chunks > 1]
        if chunks:
            parts.append(", ".join(chunks[:2]) + (f" +{len(chunks) - 2} more" if len(chunks) > 2 else ""))
        parts.append(f"{sv.cached_tokens} cached + {sv.prefill_tokens} computed")
        if d is not None and d.budget:
            parts.append(f"budget {d.budget_used}/{d.budget}")
        if d is not None and d.running_waited:
            parts.append(f"{d.running_waited} running waited")
    if d is not None:
        parts.extend(narrate_kv(d))
        nodes = len(d.evicted_nodes)
        parts.append(f"evicted {d.evicted}" + (f" ({nodes} node{'s' if nodes != 1 else ''})" if nodes else ""))
        preempted = {p.split(" ")[1] for p in d.preemptions if p.count(" ") > 1}
        kv_retracted = [rid for rid in d.retracted if rid not in preempted]
        if kv_retracted:
            slots = sum(r.slots for r in d.released if r.why == "retracted" and r.rid in kv_retracted)
            freed = f", −{slots} slots" if slots else ""
            parts.append(f"retracted {len(kv_retracted)} ({_rids(kv_retracted)}{freed})")
        parts.extend(d.preemptions)  # priority scheduling: "preempted r1 (priority 0) for r5 (priority 10)"
        parts.extend(d.hicache)  # HiCache: "loaded back 59 tok from host (944 B, 0.1 ms)"
        if d.loras:  # multi-LoRA: the adapters this batch ran, and who waited for an adapter slot
            parts.append("adapters " + ", ".join(d.loras))
        if d.lora_waited:
            parts.append(f"{len(d.lora_waited)} waited for an adapter slot ({_rids(d.lora_waited)})")
        if d.constrained:
            parts.append(f"grammar for {d.constrained} row{'s' if d.constrained != 1 else ''} {d.mask_ms:.1f} ms")
        if d.waiting:
            n_held = len(d.held)
            stop = f"{WAIT_REASONS.get(d.stop_reason, d.stop_reason)} ({d.stop_rid} next)" if d.stop_rid else ""
            if n_held and stop:
                why = f"{n_held} held for a shared prefix, {d.waiting - n_held} {stop}"
            else:
                why = "held for a shared prefix" if n_held else stop
            parts.append(f"{d.waiting} waiting" + (f": {why}" if why else ""))
    return f"step {sv.step} {sv.mode}: " + " · ".join(parts)


def narrate_spec(sv: StepView) -> str:
    """A verify step: `4 running verified 12 drafts, kept 7: +11 tokens (r1 3/4, r2 0/2, ...)`."""
    reqs = sv.spec.reqs if sv.spec is not None else []
    proposed = sum(drafts_proposed(r) for r in reqs)
    kept = sum(r.accepted for r in reqs)
    each = ", ".join(f"{r.rid} {r.accepted}/{drafts_proposed(r)}" for r in reqs[:3] if drafts_proposed(r))
    more = f" +{len(reqs) - 3} more" if len(reqs) > 3 else ""
    return (
        f"{len(sv.reqs)} running verified {proposed} draft{'s' if proposed != 1 else ''}, kept {kept}: "
        f"+{len(sv.reqs) + kept} tokens" + (f" ({each}{more})" if each else "")
    )


def describe_step(sv: StepView, node_text: dict[int, str] | None = None, max_reqs: int = 64) -> list[tuple[str, str]]:
    """One step's whole decision, part by part: (heading, text) rows for a view that opens a step
    (the TUI's step history, the Dashboard's batch chart on a click). Where `narrate_step` says
    it in one line and cuts lists short, this names every admitted, released, evicted, retracted
    and waiting part. `node_text`: node id → its text (evicted nodes' text, where known)."""
    d = sv.decision
    rows: list[tuple[str, str]] = []
    bs = f"{sv.batch_size}" + (f" (padded to {sv.padded_size})" if sv.padded_size != sv.batch_size else "")
    rows.append(
        (
            "step",
            f"{sv.step} {sv.mode} on {sv.proc} · batch {bs} · {'CUDA graph' if sv.cuda_graph else 'eager'} · "
            f"schedule {sv.schedule_ms:.1f} ms + forward {sv.forward_ms:.1f} ms",
        )
    )
    rows.append(("in one line", narrate_step(sv)))
    reqs = []
    for r in sv.reqs[:max_reqs]:
        if r.computed > 0:
            chunk = f" (chunk {r.chunk_index + 1}/{r.num_chunks})" if r.num_chunks > 1 else ""
            reqs.append(f"{r.rid} prefill {r.cached} cached + {r.computed} computed{chunk}")
        elif r.decode > 0:
            reqs.append(f"{r.rid} decode {r.decode}" + (f" (+{r.drafts} drafts verified)" if r.drafts else ""))
        else:
            reqs.append(f"{r.rid} waited (no tokens this step)")
    if len(sv.reqs) > max_reqs:
        reqs.append(f"+{len(sv.reqs) - max_reqs} more")
    rows.append((f"batch ({len(sv.reqs)})", "; ".join(reqs) or "(empty)"))
    rows.append(
        (
            "tokens",
            f"{sv.cached_tokens} cached (reused from the radix cache) + {sv.prefill_tokens} prompt computed + "
            f"{sv.decode_tokens} decoded",
        )
    )
    if d is None:
        rows.append(
            ("decision", "not known: this step's batch.decision has not arrived (or the recording predates it)")
        )
        return rows
    if d.admitted:
        rows.append((f"admitted ({len(d.admitted)})", ", ".join(d.admitted)))
    if d.chunk_continued:
        rows.append(("chunk continued", d.chunk_continued))
    if d.budget:
        rows.append(
            (
                "prefill budget",
                f"{d.budget_used} of {d.budget} tokens computed"
                + (
                    f"; {d.running_waited} running requests waited (an extend step runs prefill only)"
                    if d.running_waited
                    else ""
                ),
            )
        )
    if d.kv_held >= 0:
        parts = ", ".join(f"{k} {v:+d}" for k, v in kv_parts(d)) or "no change"
        rows.append(("KV held", f"{parts} → {d.kv_held} slots held by requests after the step"))
    else:
        rows.append(("KV", f"{d.kv_alloc} slots allocated, {d.kv_freed} freed (an older recording)"))
    if d.released:
        rows.append(("released", "; ".join(f"{r.rid} {r.why} (−{r.slots} slots)" for r in d.released)))
    if d.evicted or d.evicted_nodes:
        texts = node_text or {}
        nodes = [f"#{n}" + (f" “{texts[n][:24]}”" if texts.get(n) else "") for n in d.evicted_nodes]
        rows.append(
            (
                "evicted",
                f"{d.evicted} cached tokens freed (cached → free) from {len(d.evicted_nodes)} node(s)"
                + (": " + ", ".join(nodes) if nodes else ""),
            )
        )
    if d.retracted:
        rows.append(
            (
                f"retracted ({len(d.retracted)})",
                ", ".join(d.retracted) + ": back to the waiting queue, to be prefilled again",
            )
        )
    for p in d.preemptions:
        rows.append(("preempted", p))
    for h in d.hicache:
        rows.append(("hicache", h))
    if d.constrained:
        rows.append(("grammar", f"{d.constrained} rows sampled under a grammar, {d.mask_ms:.1f} ms on their masks"))
    if d.waiting:
        why = WAIT_REASONS.get(d.stop_reason, d.stop_reason)
        text = f"{d.waiting} left waiting"
        if d.stop_rid:
            text += f"; admission stopped at {d.stop_rid}: {why}"
        if d.held:
            text += f"; held for a shared prefix: {', '.join(d.held)}"
        rows.append(("waiting", text))
    else:
        rows.append(("waiting", "nobody left waiting"))
    return rows
