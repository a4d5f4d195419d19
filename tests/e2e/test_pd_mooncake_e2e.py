"""PD over Mooncake's transfer engine end to end: a prefill and a decode `workbench serve` (Engine + HTTP server)
with --disaggregation-transfer-backend mooncake behind the real sglang-router; greedy outputs equal one co-located
engine's, the decode side received exactly the prompts' KV, and no KV is left held on either side.
Skipped where mooncake.engine does not import (docs/disaggregation.md, The Mooncake backend, says what to install)."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from pipeline_helpers import assert_no_kv_leak
from workbench.core.disaggregation.mooncake import INSTALL_HINT
from workbench.core.entrypoints.server_process import free_port

try:
    from mooncake.engine import TransferEngine  # noqa: F401
except (ImportError, OSError) as exc:
    pytest.skip(f"mooncake.engine does not import ({exc}): {INSTALL_HINT}", allow_module_level=True)

from test_pd_router import COMMON, GREEDY, PROMPTS, _pd_router, _server, reference  # noqa: E402, F401

pytestmark = pytest.mark.timeout(600)
MOONCAKE = dict(disaggregation_transfer_backend="mooncake", disaggregation_transfer_timeout=20)


def test_outputs_through_a_mooncake_pd_pair_equal_one_engines(reference, tmp_path):  # noqa: F811
    texts, _ = reference
    bootstrap = free_port()
    with contextlib.ExitStack() as stack:
        prefill, p_url = stack.enter_context(
            _server(disaggregation_mode="prefill", disaggregation_bootstrap_port=bootstrap, **MOONCAKE)
        )
        decode, d_url = stack.enter_context(_server(disaggregation_mode="decode", **MOONCAKE))
        router = stack.enter_context(_pd_router(p_url, bootstrap, d_url, tmp_path / "router.log"))
        before = decode.get_internal_state()["disaggregation"]["pd_received_bytes_total"]
        prompt_tokens = 0
        for prompt, want in zip(PROMPTS, texts):
            r = httpx.post(router + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["text"] == want and want, prompt
            prompt_tokens += out["meta_info"]["prompt_tokens"]
        state = decode.get_internal_state()["disaggregation"]
        assert state["pd_failed_total"] == 0
        per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, float32: 2 (k, v) x 30 layers x 3 KV heads of 64 x 4 bytes
        assert state["pd_received_bytes_total"] - before == per_token * prompt_tokens
        for engine in (prefill, decode):
            assert_no_kv_leak(engine)
