"""End-to-end part of tests/fast/test_triton_backend.py (what starts processes, engines or servers, or loads the
reference model).

The triton attention backend against torch_native, under Triton's CPU interpreter.

`TRITON_INTERPRET=1` only takes effect if it is set before triton is first imported,
and other tests (torch.compile) may import triton in this process, so every
interpreted run happens in a fresh subprocess with the variable set; nothing in
this process is changed. Also here: choosing a backend per device, and the clear
errors for a backend the device cannot run.
"""

from __future__ import annotations

from tiny_models import make_tiny_llama
from triton_helpers import interpreted, needs_triton


@needs_triton
def test_triton_backend_runs_a_model_like_torch_native(tmp_path):
    """Greedy tokens of a tiny Llama: torch_native == triton == triton replayed by the stand-in graph."""
    model_dir = make_tiny_llama(tmp_path / "tiny", seed=7, tie_word_embeddings=False)
    (out,) = interpreted(["--model-check", str(model_dir)])
    res = out["model_check"]
    assert res["torch_native"] == res["triton"] == res["triton+graph"]
    assert [len(t) for t in res["triton"]] == [7, 5, 3, 6]
    assert len({tuple(t) for t in res["triton"]}) > 1  # not a degenerate model
    # 4 rows -> bucket 4, then 3 (bucket 4), 2 (bucket 2), 1 (bucket 1): every bucket replayed
    assert all(res["graph_replays"][str(b)] > 0 for b in (1, 2, 4)), res["graph_replays"]
