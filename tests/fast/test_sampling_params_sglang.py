"""SGLang's sampling keys as its clients send them (issue #17 item 1): null means the default,
`sampling_seed` is `seed`, keys of features this engine lacks pass while unset and are refused by
name when set. Pure: no engine."""

from __future__ import annotations

import pytest
from workbench.core.sampling.sampling_params import (
    UNSUPPORTED_SGLANG_KEYS,
    SamplingParams,
    sampling_params_from_dict,
)

# What sglang 0.5's frontend (SglSamplingParams.to_srt_kwargs + RuntimeEndpoint.generate) sends
# for a plain sgl.gen(max_tokens=8, temperature=0).
SGL_GEN = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "max_new_tokens": 8,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "regex": None,
    "json_schema": None,
}


def test_sglang_frontend_body_is_accepted_as_its_values():
    sp = sampling_params_from_dict(SGL_GEN).normalize()
    assert sp.max_new_tokens == 8 and sp.temperature == 0 and sp.top_k == -1 and sp.stop is None
    sp.verify(vocab_size=100)


def test_null_means_the_default_for_every_field():
    sp = sampling_params_from_dict({name: None for name in SamplingParams.__struct_fields__})
    assert sp == SamplingParams()


def test_sampling_seed_is_seed_and_stream_interval_1_is_what_we_do():
    assert sampling_params_from_dict({"sampling_seed": 7, "stream_interval": 1}).seed == 7
    with pytest.raises(ValueError, match="stream_interval"):
        sampling_params_from_dict({"stream_interval": 4})


@pytest.mark.parametrize("key", UNSUPPORTED_SGLANG_KEYS)
def test_unsupported_keys_pass_unset_and_are_refused_by_name_when_set(key):
    for unset in (None, [], {}, ""):
        assert sampling_params_from_dict({key: unset}) == SamplingParams()
    value = {"logit_bias": {"5": 1.0}, "custom_params": {"a": 1}}.get(key, "[0-9]+")
    with pytest.raises(ValueError, match=f"'{key}' is not supported"):
        sampling_params_from_dict({key: value})


def test_unknown_keys_and_bad_types_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\): tempreature; valid: .*temperature"):
        sampling_params_from_dict({"tempreature": 0.5})
    with pytest.raises(ValueError, match="invalid sampling_params"):
        sampling_params_from_dict({"max_new_tokens": "many"})
    with pytest.raises(ValueError, match="JSON object"):
        sampling_params_from_dict(["max_new_tokens", 3])


def test_logit_bias_reads_json_keys_as_ids_and_is_checked():
    sp = sampling_params_from_dict({"logit_bias": {"5": 2, "7": -1.5}})
    assert sp.logit_bias == {5: 2.0, 7: -1.5}
    sp.verify(vocab_size=10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sp.verify(vocab_size=6)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        sampling_params_from_dict({"logit_bias": {"5": 101}}).verify(vocab_size=10)


def test_logit_bias_rows_survive_merge_and_filter():
    import torch
    from workbench.core.layers.sampler import Sampler
    from workbench.core.sampling.sampling_batch_info import SamplingBatchInfo

    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={3: 50.0})
    logits = torch.zeros(3, 8)
    logits[:, 6] = 1.0  # every row's own argmax is 6
    info = SamplingBatchInfo.from_reqs([greedy], vocab_size=8)
    info.merge_batch(SamplingBatchInfo.from_reqs([biased, greedy], vocab_size=8))
    assert Sampler()(logits, info).next_token_ids.tolist() == [6, 3, 6]
    info.filter_batch([1])
    assert Sampler()(logits[:1], info).next_token_ids.tolist() == [3]
    info.filter_batch([])
    assert len(info) == 0


def test_fields_routers_send_switched_off_pass_and_are_refused_by_name_when_on():
    """sglang-router re-sends bodies with SGLang's defaults (log_metrics, return_hidden_states:
    false, ...): accepted while off, on either route; a 400 naming the field when turned on."""
    from workbench.core.entrypoints.errors import APIError
    from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest, GenerateReqInput
    from workbench.core.entrypoints.openai.serving_common import refuse_off_only

    off = dict(return_hidden_states=False, background=False, return_bytes=False, return_entropy=False)
    refuse_off_only(GenerateReqInput(text="x", model=None, log_metrics=True, no_logs=False, **off))
    refuse_off_only(ChatCompletionRequest(messages=[], separate_reasoning=True, return_hidden_states=False))
    for name in off:
        with pytest.raises(APIError, match=f"{name} is not supported"):
            refuse_off_only(GenerateReqInput(text="x", **{name: True}))
    with pytest.raises(APIError, match="return_hidden_states"):
        refuse_off_only(ChatCompletionRequest(messages=[], return_hidden_states=True))
