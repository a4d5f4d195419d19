"""A third-party workbench plugin: one panel, one view, one workload."""


def make_panel(**kw):
    from textual.widgets import Static

    class RequestCountPanel(Static):
        last_text = ""

        def update_view(self, model):
            self.last_text = f"{len(model.state.requests)} requests seen"
            self.update(self.last_text)

    return RequestCountPanel("waiting for events", **kw)


def make_view(source=None, **kw):
    import ipywidgets as W
    from workbench.widgets import TraceFeed

    class RequestCountView(W.HTML):
        def update(self, state, t0=None):
            self.value = f"<b>{len(state.requests)}</b> requests seen"

    view = RequestCountView()
    if source is not None:
        TraceFeed.of(source).attach(view)
    return view


class Countdown:
    def __init__(self, n=3):
        self.n = n

    def requests(self):
        return [f"count down from {i}" for i in range(self.n, 0, -1)]


class ShortestFirst:
    """Admit the shortest prompt first; log each ordering to $WB_POLICY_LOG (proof the scheduler ran it)."""

    def __init__(self, tree_cache, rng_seed=0):
        self.tree_cache = tree_cache

    def calc_priority(self, waiting_queue):
        waiting_queue.sort(key=lambda r: len(r.origin_input_ids))
        import os

        path = os.environ.get("WB_POLICY_LOG")
        if path and waiting_queue:
            with open(path, "a") as f:
                f.write(" ".join(str(len(r.origin_input_ids)) for r in waiting_queue) + "\n")


def register(registry):
    registry.add_policy("shortest-first", ShortestFirst, help="shortest prompt first")
    registry.add_panel("reqcount", "Request count", make_panel, help="how many requests the trace saw")
    registry.add_view("reqcount", "Request count", make_view, help="how many requests the trace saw")
    registry.add_workload("countdown", Countdown, help="three numbered prompts")
