"""The one exception type the model loader raises.

Every failure a user can cause (a wrong path, an unsupported model, a damaged
file) surfaces as a `ModelLoadError` whose message is a single line naming the
file involved and saying what to do next, so the CLI can print it as is
instead of a traceback.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be resolved, converted or loaded; the message says why and what to do."""


def describe(exc: BaseException, limit: int = 200) -> str:
    """`exc` as a short single line, for embedding in a ModelLoadError message."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
