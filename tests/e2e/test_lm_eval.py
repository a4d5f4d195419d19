"""lm-eval 0.4.13, unmodified, against a real server over the default model (issue #43, item 1).

Two tasks written into tmp_path with a local JSONL dataset (nothing reaches the network):
a multiple-choice task through `local-completions` (loglikelihood: echo, logprobs=1,
max_tokens=1; lm-eval reads a top_logprobs dict at every prompt position past the context)
with no local tokenizer: lm-eval's `remote` backend tokenizes through the server's /tokenize,
/detokenize and /tokenizer_info (what its default `auto` picks when the server has them),
and a generate_until task through both `local-completions` and `local-chat-completions`.
The loglikelihoods lm-eval reports equal transformers' over the same tokens; the generations
equal the server's own greedy answers to the same prompts and messages."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from pipeline_helpers import assert_no_kv_leak, served_engine

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (the test extra) is not installed")

MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit", "Kelvin"], "answer": 0},
    {"question": "The largest planet in the solar system is", "choices": ["Mars", "Jupiter", "Venus"], "answer": 1},
    {"question": "Two plus two equals", "choices": ["three", "five", "four"], "answer": 2},
]
GEN_DOCS = [
    {"question": "What is the capital of France? Answer in one word.", "answer": "Paris"},
    {"question": "Name a colour of the sky. Answer in one word.", "answer": "Blue"},
]

MC_YAML = """task: wb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """task: wb_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
"""


@pytest.fixture(scope="module")
def served():
    # float32: lm-eval's loglikelihoods are compared with transformers' to 1e-3 per token
    with served_engine(max_total_tokens=8192, dtype="float32") as pair:
        yield pair


@pytest.fixture
def tasks_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    for name, docs, yaml in (("wb_mc", MC_DOCS, MC_YAML), ("wb_gen", GEN_DOCS, GEN_YAML)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"{name}.yaml").write_text(yaml.format(data=data, cache=tmp_path / "hf-datasets"))
    return tmp_path


def _score(hf_model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(lp[p - 1, ids[p]]) for p in range(len(context), len(ids)))


def test_lm_eval_local_completions_and_chat(served, tasks_dir, tokenizer, hf_model):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    engine, url = served
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)  # lm-eval's own ~40 s of indexing skipped
    lm = get_model("local-completions")(
        model="smollm2-135m",
        base_url=url + "/v1/completions",
        tokenizer_backend="remote",  # no tokenizer path: the server's /tokenize (native_api.py)
        max_retries=1,
        max_length=2048,
    )
    res = simple_evaluate(model=lm, tasks=["wb_mc", "wb_gen"], task_manager=tm, log_samples=True)
    acc = res["results"]["wb_mc"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    samples = res["samples"]["wb_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            loglik, _is_greedy = resp[0]
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)  # through the server
            assert ctx_ids + cont_ids == tokenizer.encode(context + continuation, add_special_tokens=False)
            ref = _score(hf_model, ctx_ids, cont_ids)
            assert abs(loglik - ref) < 1e-3 * len(cont_ids) + 1e-3, (context, continuation, loglik, ref)
    # generate_until through /v1/completions: the server's own greedy answers to the same prompts
    assert isinstance(res["results"]["wb_gen"]["exact_match,none"], float)
    with httpx.Client(base_url=url, timeout=120) as h:
        for sample in res["samples"]["wb_gen"]:
            doc = GEN_DOCS[sample["doc_id"]]
            direct = h.post(
                "/v1/completions",
                json={
                    "model": "smollm2-135m",
                    "prompt": doc["question"],
                    "max_tokens": 8,
                    "temperature": 0,
                    "stop": ["\n"],
                },
            ).json()["choices"][0]["text"]
            assert sample["resps"][0][0] == direct, (sample["resps"], direct)

    chat = get_model("local-chat-completions")(
        model="smollm2-135m", base_url=url + "/v1/chat/completions", max_retries=1
    )
    res = simple_evaluate(model=chat, tasks=["wb_gen"], task_manager=tm, log_samples=True, apply_chat_template=True)
    em = res["results"]["wb_gen"]["exact_match,none"]
    assert isinstance(em, float) and 0.0 <= em <= 1.0
    samples = res["samples"]["wb_gen"]
    assert len(samples) == len(GEN_DOCS)
    with httpx.Client(base_url=url, timeout=120) as h:
        for sample, doc in zip(sorted(samples, key=lambda s: s["doc_id"]), GEN_DOCS):
            got = sample["resps"][0][0]
            direct = h.post(
                "/v1/chat/completions",
                json={
                    "model": "smollm2-135m",
                    "messages": [{"role": "user", "content": doc["question"]}],
                    "max_tokens": 8,
                    "temperature": 0,
                    "stop": ["\n"],
                },
            ).json()["choices"][0]["message"]["content"]
            assert got == direct, (got, direct)
    assert_no_kv_leak(engine)
