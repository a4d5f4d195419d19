"""Speculative decoding in the trace: `spec.verify` events folded into acceptance figures
(TraceState.spec). Views read `present`, `algorithm`, `verified` ((request, step) pairs that
verified drafts), `proposed`, `accepted`, `accept_length` (tokens a request gains per verify step:
1 + its accepted drafts, on average; what SGLang reports as spec_accept_length) and `request(rid)`.
"""

from __future__ import annotations

from collections import OrderedDict

from workbench.core.trace import events as ev


def drafts_proposed(r: ev.SpecReq) -> int:
    return len(r.drafts) if r.proposed < 0 else r.proposed


class SpecStats:
    def __init__(self, max_requests: int = 5000):
        self.max_requests = max_requests
        self.algorithm = ""
        self.verified = self.proposed = self.accepted = 0
        self._by_request: OrderedDict[str, list[int]] = OrderedDict()  # rid -> [verified, proposed, accepted]

    @property
    def present(self) -> bool:
        return self.verified > 0

    @property
    def accept_length(self) -> float:
        return (self.accepted + self.verified) / self.verified if self.verified else 0.0

    def apply(self, e: ev.SpecVerify) -> None:
        self.algorithm = e.algorithm
        for r in e.reqs:
            n = drafts_proposed(r)
            self.verified += r.verified
            self.proposed += n
            self.accepted += r.accepted
            acc = self._by_request.get(r.rid)
            if acc is None:
                acc = self._by_request[r.rid] = [0, 0, 0]
                while len(self._by_request) > self.max_requests:
                    self._by_request.popitem(last=False)
            acc[0] += r.verified
            acc[1] += n
            acc[2] += r.accepted

    def request(self, rid: str) -> tuple[int, int, int] | None:
        """(verify steps, drafts proposed, drafts accepted) of `rid`, or None if it verified none."""
        acc = self._by_request.get(rid)
        return None if acc is None else (acc[0], acc[1], acc[2])

    def snapshot_event(self, ts: int) -> ev.SpecVerify | None:
        if not self.present:
            return None
        reqs = [ev.SpecReq(rid, [], a, verified=v, proposed=p) for rid, (v, p, a) in self._by_request.items()]
        # what requests forgotten beyond max_requests contributed, so the totals survive
        v = self.verified - sum(r.verified for r in reqs)
        p = self.proposed - sum(r.proposed for r in reqs)
        a = self.accepted - sum(r.accepted for r in reqs)
        if v or p or a:
            reqs.append(ev.SpecReq("", [], a, verified=v, proposed=p))
        return ev.SpecVerify(ts=ts, algorithm=self.algorithm, reqs=reqs, snapshot=True)
