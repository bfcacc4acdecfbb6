"""Issue 26 point 6: the real Python agent clients, unmodified, against the real server (port 0).

- openai-agents (the OpenAI Agents SDK), with its chat-completions model and its Responses model:
  the scripted tiny model (scripted_model.py) calls the declared get_weather, the SDK runs the tool
  and sends its result back; a scripted call to get_sunny_city (the issue's ModelBehaviorError)
  reaches the SDK as a declared tool; over seeds on the default model (SmolLM2) with `tool_choice:
  auto`, after a tool result, the run never stops on a ModelBehaviorError. (SmolLM2-135M seldom
  opens a call there, so the scripted cases are the ones that exercise calls.)
- instructor, Mode.TOOLS on chat and Mode.RESPONSES_TOOLS (a forced tool together with
  `text.format`): a parsed pydantic object (skipped unless installed by hand: see pyproject.toml).
- litellm, `anthropic/<any name>` with api_base at the server (its Anthropic provider, /v1/messages).

Each part skips with the reason when its package is missing; none of them reaches the network:
the Agents SDK's tracing is off and litellm reads its bundled model cost map.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.lifecycle import ServerThread
from tests.server.scripted_model import write_scripted_model
from tests.server.test_declared_tools import UNDECLARED_CALL

# litellm's TypedDicts with ReadOnly items warn on import under this pydantic; nothing to act on here
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Item.*ReadOnly:UserWarning"),
              pytest.mark.filterwarnings("ignore:Items.*ReadOnly:UserWarning")]

SEEDS = range(6)
DECLARED = {"get_weather", "get_time"}
INSTRUCTIONS = "You are a helpful agent. Use the tools when needed."
# The issue's question: SmolLM2 answered it with calls to get_sunny_city and get_location.
QUESTION = "What's the weather in the sunniest city you know, and what time is it there?"
# The SDK's second request in the issue: get_weather's result is in, the model picks the next step.
AFTER_A_RESULT: list[dict[str, Any]] = [
    {"role": "user", "content": QUESTION},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Tokyo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"},
]


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory,
                    start_server: Callable[..., ServerThread]) -> Iterator[ServerThread]:
    """The scripted model: every turn reasons, then calls get_weather(city=Paris)."""
    from mlxcel.loading import resolve_model

    folder = write_scripted_model(tmp_path_factory.mktemp("clients") / "model")
    model: ServedModel = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                                            EngineConfig(max_num_seqs=2, ctx_size=4096))
    yield start_server(model)
    model.close(30)


@pytest.fixture(scope="module")
def undeclared_server(tmp_path_factory: pytest.TempPathFactory,
                      start_server: Callable[..., ServerThread]) -> Iterator[ServerThread]:
    """The scripted model whose call names get_sunny_city (the issue's ModelBehaviorError), as in
    test_declared_tools: the call grammar turns it into a declared tool with city=Paris."""
    from mlxcel.loading import resolve_model

    folder = write_scripted_model(tmp_path_factory.mktemp("clients-undeclared") / "model", call=UNDECLARED_CALL)
    model: ServedModel = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                                            EngineConfig(max_num_seqs=2, ctx_size=4096))
    yield start_server(model)
    model.close(30)


# ---- openai-agents ----

def agents_sdk() -> Any:
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[test]')")
    agents.set_tracing_disabled(True)  # the SDK would export traces to api.openai.com
    return agents


def agent_model(agents: Any, kind: str, client: openai.AsyncOpenAI) -> Any:
    if kind == "chat":
        return agents.OpenAIChatCompletionsModel(model="any-model", openai_client=client)
    return agents.OpenAIResponsesModel(model="any-model", openai_client=client)


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
ONLY_PARIS = {**CITY, "properties": {"city": {"enum": ["Paris"]}}}  # one path for the scripted model's arguments
REPLIES = {"get_weather": "Sunny, 24 C in {city}", "get_time": "It is 14:05 in {city}"}


def recording_tools(agents: Any, calls: list[tuple[str, str]], parameters: dict[str, Any]) -> list[Any]:
    """get_weather and get_time as the SDK's FunctionTool, recording each call the SDK runs."""

    def tool(name: str) -> Any:
        async def invoke(_context: Any, arguments: str) -> str:
            city = json.loads(arguments)["city"]
            calls.append((name, city))
            return REPLIES[name].format(city=city)

        return agents.FunctionTool(name=name, description=f"{name.replace('_', ' ')} in a city",
                                   params_json_schema=parameters, on_invoke_tool=invoke)

    return [tool(name) for name in REPLIES]


def build_agent(agents: Any, model: Any, settings: Any, calls: list[tuple[str, str]],
                stop_after: int | None = None, parameters: dict[str, Any] = CITY) -> Any:
    """An agent with the two recording tools; after `stop_after` calls a tool's result is the final output."""

    def enough_calls(_context: Any, results: list[Any]) -> Any:
        done = stop_after is not None and len(calls) >= stop_after
        return agents.ToolsToFinalOutputResult(is_final_output=done, final_output=results[-1].output if done else None)

    return agents.Agent(name="Assistant", instructions=INSTRUCTIONS, tools=recording_tools(agents, calls, parameters),
                        model=model, model_settings=settings, tool_use_behavior=enough_calls)


async def run_agent(server: ServerThread, kind: str, settings_fields: dict[str, Any], calls: list[tuple[str, str]],
                    stop_after: int | None = None, max_turns: int = 3, start: str | list[Any] = QUESTION,
                    parameters: dict[str, Any] = CITY) -> Any:
    agents = agents_sdk()
    async with openai.AsyncOpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        settings = agents.ModelSettings(tool_choice="auto", **settings_fields)
        agent = build_agent(agents, agent_model(agents, kind, client), settings, calls, stop_after, parameters)
        try:
            return await agents.Runner.run(agent, start, max_turns=max_turns)
        except agents.MaxTurnsExceeded as stopped:  # the model kept calling (declared) tools: fine here
            return stopped


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_issue26_agents_sdk_tool_result_round_trips(scripted_server: ServerThread, kind: str) -> None:
    """The scripted call reaches the tool; its result goes back in the next request, whose call ends the run."""
    agents_sdk()
    calls: list[tuple[str, str]] = []
    result = asyncio.run(run_agent(scripted_server, kind, {"temperature": 0, "max_tokens": 60}, calls, stop_after=2))
    assert calls == [("get_weather", "Paris")] * 2
    assert result.final_output == "Sunny, 24 C in Paris"
    sent = result.to_input_list()  # what the SDK would send next: both calls and both results
    outputs = [item for item in sent if item.get("type") == "function_call_output"]
    assert [item["output"] for item in outputs] == ["Sunny, 24 C in Paris"] * 2
    assert len(result.raw_responses) == 2


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_issue26_agents_sdk_a_call_to_an_undeclared_tool_never_reaches_the_sdk(undeclared_server: ServerThread,
                                                                               kind: str) -> None:
    """The issue's row: the model writes a call to get_sunny_city; the SDK sees a declared tool and runs it."""
    agents = agents_sdk()
    calls: list[tuple[str, str]] = []
    try:
        result = asyncio.run(run_agent(undeclared_server, kind, {"temperature": 0, "max_tokens": 60}, calls,
                                       stop_after=2, parameters=ONLY_PARIS))
    except agents.ModelBehaviorError as error:
        pytest.fail(f"{kind}: {error}")
    assert len(calls) == 2 and {name for name, _ in calls} <= DECLARED and {city for _, city in calls} == {"Paris"}
    assert result.final_output == REPLIES[calls[-1][0]].format(city="Paris")


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_issue26_agents_sdk_default_model_never_calls_an_undeclared_tool(server: ServerThread, kind: str) -> None:
    """SmolLM2 sampled over seeds: no ModelBehaviorError (an undeclared tool, arguments that are not JSON)."""
    agents = agents_sdk()
    outcomes: list[tuple[int, str, list[str], str]] = []
    for seed in SEEDS:
        calls: list[tuple[str, str]] = []
        settings = {"temperature": 1.0, "max_tokens": 40, "extra_body": {"seed": seed}}
        try:
            result = asyncio.run(run_agent(server, kind, settings, calls, start=AFTER_A_RESULT))
        except agents.ModelBehaviorError as error:
            # A Responses reply cut by max_output_tokens is `incomplete`, which this SDK also raises as
            # ModelBehaviorError (as it would against OpenAI); anything else (a tool the agent does not
            # have, arguments that are not JSON) is the failure this test is about.
            if "max_output_tokens" not in str(error):
                pytest.fail(f"seed {seed}: {error}")
            result = error
        except agents.UserError as error:
            # Issue 46: a chat call cut by max_tokens comes back as written with finish_reason "length" (as
            # OpenAI returns it), not closed with made-up arguments; the SDK then fails to parse it, as it
            # would against OpenAI. A complete call is grammar-bound JSON, so only a cut one lands here.
            if not isinstance(error.__cause__, json.JSONDecodeError):
                pytest.fail(f"seed {seed}: {error}")
            result = error
        assert {name for name, _ in calls} <= DECLARED, (seed, calls)
        if isinstance(result, agents.RunResult):
            assert isinstance(result.final_output, str), (seed, result.final_output)
        reply = str(getattr(result, "final_output", ""))[:80]
        outcomes.append((seed, type(result).__name__, [name for name, _ in calls], reply))
    print(kind, outcomes)  # shown with -s: which seeds called tools


# ---- instructor ----

class City(BaseModel):
    name: str
    population_millions: int


def instructor_client(server: ServerThread, mode_name: str) -> Any:
    # Not in the test extra: every instructor release caps jiter<0.15, which openai 3.x (jiter>=0.16) excludes.
    instructor = pytest.importorskip("instructor", reason="instructor is not installed: its jiter<0.15 cap "
                                                          "conflicts with openai 3.x (pyproject.toml's test extra)")
    sdk = openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120)
    return instructor.from_openai(sdk, mode=getattr(instructor.Mode, mode_name))


@pytest.mark.parametrize("mode_name", ["TOOLS", "RESPONSES_TOOLS"])
def test_issue26_instructor_extracts_a_model(server: ServerThread, mode_name: str) -> None:
    """instructor forces its tool (RESPONSES_TOOLS adds `text.format`); the grammar keeps the call schema-valid."""
    client = instructor_client(server, mode_name)
    city = client.create(model="any-model", response_model=City, max_retries=0, temperature=0, max_tokens=60,
                         messages=[{"role": "user", "content": "Paris has about 2 million people. Extract the city."}])
    assert isinstance(city, City) and city.name


# ---- litellm ----

def litellm_module() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read before import: no cost map download
    litellm = pytest.importorskip("litellm", reason="litellm is not installed (pip install -e '.[test]')")
    litellm.telemetry = False
    litellm.suppress_debug_info = True  # its "Provider List" banner on stdout
    return litellm


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_litellm_anthropic_provider_any_model_name(server: ServerThread, stream: bool) -> None:
    """litellm's Anthropic provider posts to {api_base}/v1/messages with the name after `anthropic/`."""
    litellm = litellm_module()
    fields: dict[str, Any] = {"model": "anthropic/my-local-model", "api_base": server.address, "api_key": "unused",
                              "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
                              "temperature": 0, "num_retries": 0, "timeout": 120}
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(**fields, stream=True)
                       if chunk.choices)
    else:
        response = litellm.completion(**fields)
        assert response.choices[0].finish_reason in ("stop", "length")
        assert response.usage.completion_tokens > 0
        text = response.choices[0].message.content
    assert text and text.strip()


def test_issue26_litellm_anthropic_tool_call_has_a_toolu_id(scripted_server: ServerThread) -> None:
    """A tool call through litellm's Anthropic provider: the declared tool, toolu_ id, arguments as JSON."""
    litellm = litellm_module()
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                             "parameters": CITY}}
    response = litellm.completion(model="anthropic/claude-anything", api_base=scripted_server.address,
                                  api_key="unused", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                  tools=[tool], tool_choice="auto", max_tokens=60, temperature=0, num_retries=0)
    call, = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("toolu_")
    assert call.function.arguments.replace(" ", "") == '{"city":"Paris"}'
    assert response.choices[0].finish_reason == "tool_calls"
