"""The built-in panels, one per module. Each is a `TracePanel`: a Textual widget
with `update_view(model)` that renders a `TuiModel` (TraceState + log + clock)."""
