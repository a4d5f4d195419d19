"""A third-party plugin that fails inside register (the host must skip it and say why)."""


def register(registry):
    registry.add_view("half-done", "never finished", lambda source=None: None)
    raise RuntimeError("boom: this plugin is broken")
