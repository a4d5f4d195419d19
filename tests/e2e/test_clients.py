"""Agent and extraction clients, unmodified, against a real server over the default model
(issue #43, "each client in the full tier with its real package"):

- instructor 1.17 in TOOLS and JSON_SCHEMA modes, and its streamed `create_partial` (which fails
  when a streamed chunk repeats a tool-call index: issue #43 item 3);
- a pydantic-ai agent whose tool is called with parsed arguments, whose result goes back to the
  model, and whose final answer is a validated object;
- LangChain: `with_structured_output` (json_schema and function calling), a tool-calling round
  trip through `bind_tools`, and a `create_agent` agent with a tool and a structured answer;
- the tokenizer routes lm-eval's `remote` backend reads (/tokenizer_info, /tokenize,
  /detokenize), equal to the model's own tokenizer.

SmolLM2-135M was never trained to call tools: where a client lets the model choose, the test
names the tool for the step (each client's own way of doing so), and the grammar behind a named
tool or a JSON schema makes the output parse. Schemas are bounded (lengths, enums, ranges) so a
tiny model's output always ends. What is checked is what the client made of the server's answers:
validated objects, a tool invoked with the arguments the model wrote, the tool's result in the
next request."""

from __future__ import annotations

from typing import Literal

import httpx
import pytest
from pipeline_helpers import assert_no_kv_leak, served_engine
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar", reason="named tools and JSON schemas need xgrammar (the test tier installs it)")

MODEL = "smollm2-135m"


class City(BaseModel):
    """A city and the unit its weather is given in."""

    name: str = Field(min_length=1, max_length=12, description="the city's name")
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(min_length=1, max_length=12)
    age: int = Field(ge=0, le=120)


class WeatherReport(BaseModel):
    """The final answer about the weather."""

    city: str = Field(min_length=1, max_length=12)
    summary: Literal["sunny", "cloudy", "rainy"]


PERSON_TEXT = "Extract the person: Alice is 31 years old."


@pytest.fixture(scope="module")
def served():
    with served_engine(max_total_tokens=8192) as pair:
        yield pair


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------- instructor


def test_instructor_tools_json_schema_and_create_partial(served):
    instructor = pytest.importorskip("instructor")
    engine, url = served
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PERSON_TEXT}], max_tokens=60, temperature=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(_client(url), mode=mode)
        person = client.chat.completions.create(response_model=Person, max_retries=0, **kw)
        assert isinstance(person, Person), (mode, person)

    # Streamed extraction in TOOLS mode: instructor reads each chunk's tool_calls[0] as the next
    # fragment of the arguments; a chunk repeating an index broke it (`expected ident at line 1
    # column 2`, issue #43 item 3). A forced call is sent once its arguments are complete (a
    # streamed call cannot be taken back if max_tokens cuts it), so here it is one partial.
    client = instructor.from_openai(_client(url), mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(response_model=Person, max_retries=0, **kw))
    assert partials and isinstance(Person.model_validate(partials[-1].model_dump()), Person), partials
    # In JSON_SCHEMA mode the content streams token by token: the object grows over the chunks.
    client = instructor.from_openai(_client(url), mode=instructor.Mode.JSON_SCHEMA)
    partials = list(client.chat.completions.create_partial(response_model=Person, max_retries=0, **kw))
    assert len(partials) >= 3, partials
    final = Person.model_validate(partials[-1].model_dump())
    # (not compared with the answer above: a prefix-cache hit may move a bfloat16 greedy choice)
    named = [p.name for p in partials if p.name]
    assert named and all(final.name.startswith(n) for n in named), named  # each partial a prefix of the last
    assert_no_kv_leak(engine)


# ---------------------------------------------------------------- pydantic-ai


def test_pydantic_ai_agent_tool_round_trip(served):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ModelRequest, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    engine, url = served
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key="unused"))

    class ToolThenAnswer(AbstractCapability):
        """Names the tool for the first step and the final answer for the next (pydantic-ai's
        per-step tool_choice): the tiny model is told which call to write, the server makes it parse."""

        def get_model_settings(self):
            def settings(ctx: RunContext) -> dict:
                return {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else ["final_result"]}

            return settings

    agent = Agent(
        model,
        output_type=WeatherReport,
        capabilities=[ToolThenAnswer()],
        model_settings={"temperature": 0, "max_tokens": 60, "parallel_tool_calls": False},
        system_prompt="Use get_weather, then report the weather.",
    )
    seen: list[City] = []

    @agent.tool_plain
    def get_weather(city: City) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is sunny in {city.name}, 21 degrees {city.unit}."

    result = agent.run_sync("What is the weather in Paris?")
    assert isinstance(result.output, WeatherReport), result.output
    assert len(seen) == 1 and isinstance(seen[0], City), seen  # the tool ran once, on parsed, validated args
    messages = result.all_messages()
    calls = [p for m in messages for p in m.parts if isinstance(p, ToolCallPart)]
    assert [c.tool_name for c in calls] == ["get_weather", "final_result"], calls
    # (a tool whose one parameter is a model takes that model's fields as its arguments)
    assert City.model_validate(calls[0].args_as_dict()) == seen[0]
    returns = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert returns and returns[0].tool_name == "get_weather" and seen[0].name in returns[0].content
    assert_no_kv_leak(engine)


# ---------------------------------------------------------------- LangChain


def test_langchain_structured_output_and_tool_round_trip(served):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    engine, url = served
    llm = ChatOpenAI(
        model=MODEL, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=60, max_retries=0, timeout=120
    )
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke(PERSON_TEXT)
        assert isinstance(person, Person), (method, person)

    seen: list[dict] = []

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        seen.append({"city": city, "unit": unit})
        return f"It is sunny in {city}, 21 degrees {unit}."

    ask = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(ask)
    assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1, ai
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}, call
    tool_msg = get_weather.invoke(call)  # LangChain runs the tool on the parsed args: a ToolMessage
    assert isinstance(tool_msg, ToolMessage) and tool_msg.tool_call_id == call["id"]
    assert seen == [call["args"]]
    # the round trip: the tool's result goes back; the model answers in text (tools still offered)
    final = llm.bind_tools([get_weather], tool_choice="none").invoke([*ask, ai, tool_msg])
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content.strip(), final
    assert_no_kv_leak(engine)


def test_langchain_agent_calls_tool_and_answers(served):
    pytest.importorskip("langchain")
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain.agents.structured_output import ToolStrategy
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    engine, url = served
    llm = ChatOpenAI(
        model=MODEL, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=60, max_retries=0, timeout=120
    )
    seen: list[dict] = []

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        seen.append({"city": city, "unit": unit})
        return f"It is sunny in {city}, 21 degrees {unit}."

    @wrap_model_call
    def tool_then_answer(request, handler):
        # The tiny model is told which call to write at each step: first the tool (no structured
        # answer offered, the tool named), then the answer (no tools left: the agent forces its
        # one structured-output tool).
        if any(isinstance(m, ToolMessage) and m.name == "get_weather" for m in request.messages):
            return handler(request.override(tools=[]))
        return handler(request.override(response_format=None, tool_choice="get_weather"))

    agent = create_agent(
        llm, tools=[get_weather], middleware=[tool_then_answer], response_format=ToolStrategy(WeatherReport)
    )
    state = agent.invoke({"messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
    assert isinstance(state["structured_response"], WeatherReport), state
    assert len(seen) == 1, seen  # the agent ran the tool once, on the model's parsed arguments
    tool_msgs = [m for m in state["messages"] if isinstance(m, ToolMessage) and m.name == "get_weather"]
    assert len(tool_msgs) == 1 and seen[0]["city"] in tool_msgs[0].content
    # the tool's result went back to the model, whose next answer is the structured one
    after = state["messages"][state["messages"].index(tool_msgs[0]) + 1]
    assert after.tool_calls and after.tool_calls[0]["name"] == "WeatherReport", after
    assert_no_kv_leak(engine)


# ---------------------------------------------------------------- tokenizer routes


def test_tokenize_routes_match_the_model_tokenizer(served, tokenizer):
    """SGLang's /tokenize and /detokenize (and their /v1 names), vLLM's /tokenizer_info: what
    lm-eval's `remote` tokenizer backend calls, checked against the model's own tokenizer and
    with lm-eval's own client for them."""
    engine, url = served
    text = "The capital of France is Paris."
    with httpx.Client(base_url=url, timeout=60) as h:
        one = h.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert one["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert one["count"] == len(one["tokens"]) and one["max_model_len"] > 0
        batch = h.post("/v1/tokenize", json={"model": MODEL, "prompt": [text, "Hi"]}).json()
        assert batch["tokens"] == [tokenizer.encode(t) for t in (text, "Hi")] and batch["count"] == [
            len(t) for t in batch["tokens"]
        ]
        msgs = [{"role": "user", "content": "Hi"}]
        chat = h.post("/tokenize", json={"messages": msgs}).json()
        assert chat["tokens"] == list(engine.apply_chat_template(msgs))
        back = h.post("/detokenize", json={"tokens": one["tokens"]}).json()
        assert back["text"] == back["prompt"] == text
        both = h.post("/v1/detokenize", json={"tokens": [one["tokens"], one["tokens"][:2]]}).json()
        assert both["text"] == [text, tokenizer.decode(one["tokens"][:2])]
        info = h.get("/tokenizer_info").json()
        assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
        for bad in ({}, {"prompt": "a", "messages": msgs}, {"tokens": [10**9]}, {"prompt": 3}):
            route = "/detokenize" if "tokens" in bad else "/tokenize"
            r = h.post(route, json=bad)
            # a bad value 400, a body of the wrong shape 400 or 422 (the statuses errors.py gives)
            assert r.status_code in (400, 422) and "message" in r.json()["error"], (bad, r.text)
        doc = h.get("/openapi.json").json()["paths"]
        assert {"/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/tokenizer_info"} <= set(doc)
        assert "requestBody" in doc["/tokenize"]["post"]

    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    assert lm_eval_utils.check_remote_tokenizer_support(url + "/v1/completions")
    remote = lm_eval_utils.RemoteTokenizer(url + "/v1/completions")
    assert remote.encode(text) == one["tokens"] and remote.decode(one["tokens"]) == text
    assert remote.eos_token_id == tokenizer.eos_token_id
