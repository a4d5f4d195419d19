"""Expert load of a mixture-of-experts model, folded from `moe.routing` events (TraceState.experts).

Views read: `present` (a routing event has arrived), `layers`, `num_experts`, `top_k`, `last` (the
latest step's tokens per expert, [layer][expert]), `total` (since the start), `steps`, `last_step`,
`request(rid)` (one request's tokens per expert so far) and `imbalance(row)`: the busiest expert
over the mean, 1.0 when even, num_experts / top_k at worst (every token on the same top_k experts).
"""

from __future__ import annotations

from collections import OrderedDict

from workbench.core.trace import events as ev


def imbalance(row: list[int]) -> float:
    """Busiest expert over the mean (1.0: even); 0.0 for a row with no tokens."""
    total = sum(row)
    return max(row) * len(row) / total if total else 0.0


def _unpack(pairs: list[int], num_experts: int) -> list[int]:
    row = [0] * num_experts
    for i in range(0, len(pairs) - 1, 2):
        if 0 <= pairs[i] < num_experts:
            row[pairs[i]] += pairs[i + 1]
    return row


class ExpertLoad:
    def __init__(self, max_requests: int = 2000):
        self.max_requests = max_requests
        self._reset()

    def _reset(self) -> None:
        self.num_experts = 0
        self.top_k = 0
        self.layers: list[int] = []
        self.last: list[list[int]] = []
        self.total: list[list[int]] = []
        self.steps = 0
        self.last_step = -1
        self.last_proc = ""
        self._by_request: OrderedDict[str, list[list[int]]] = OrderedDict()

    @property
    def present(self) -> bool:
        return bool(self.layers)

    def apply(self, e: ev.MoeRouting) -> None:
        if e.layers != self.layers or e.num_experts != self.num_experts:  # a new model (or the first event)
            self._reset()
            self.layers, self.num_experts = list(e.layers), e.num_experts
            self.total = [[0] * e.num_experts for _ in e.layers]
        self.top_k = e.top_k
        if e.steps == 1:
            self.last = [list(row) for row in e.counts]
            self.last_step, self.last_proc = e.step, e.proc
        for total_row, counts_row in zip(self.total, e.counts):
            for i, n in enumerate(counts_row[: self.num_experts]):
                total_row[i] += n
        self.steps += e.steps
        for route in e.reqs:
            acc = self._by_request.get(route.rid)
            if acc is None:
                acc = self._by_request[route.rid] = [[0] * self.num_experts for _ in self.layers]
                while len(self._by_request) > self.max_requests:
                    self._by_request.popitem(last=False)
            else:
                self._by_request.move_to_end(route.rid)
            for row, pairs in zip(acc, route.pairs):
                for i, n in enumerate(_unpack(pairs, self.num_experts)):
                    row[i] += n

    def requests(self) -> list[str]:
        """The requests with routing seen, least recently routed first."""
        return list(self._by_request)

    def request(self, rid: str) -> list[list[int]] | None:
        """[layer][expert]: the tokens of `rid` routed to each expert so far (None: none seen)."""
        return self._by_request.get(rid)

    def snapshot_event(self, ts: int) -> ev.MoeRouting | None:
        """One event that rebuilds this picture in a fresh state (its counts cover `steps` steps)."""
        if not self.present:
            return None
        reqs = [
            ev.ExpertRoute(rid, [[x for e, n in enumerate(row) if n for x in (e, n)] for row in acc])
            for rid, acc in self._by_request.items()
        ]
        return ev.MoeRouting(
            ts=ts,
            proc=self.last_proc,
            step=self.last_step,
            num_experts=self.num_experts,
            top_k=self.top_k,
            layers=list(self.layers),
            counts=[list(row) for row in self.total],
            reqs=reqs,
            steps=self.steps,  # one step: the total is that step's counts, read back as `last` too
        )
