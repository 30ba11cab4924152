"""The OpenAI-compatible endpoint over plain httpx: shapes, tools, logprobs, sessions, errors."""

from functools import partial

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import trio

from rollout_trio.agents import OpenAIEndpoint
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.testing import ScriptedEngine

from .agent_helpers import IM_END, TOKENIZER, text_tokens, texts_engine

USER = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add", "parameters": {"type": "object"}}}]


def client_for(endpoint, key=None):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=endpoint.app), base_url="http://agent/v1/", headers=headers)


async def post(endpoint, key, body, **kw):
    async with client_for(endpoint, key) as c:
        if not isinstance(body, dict):
            return await c.post("chat/completions", content=body, **kw)
        return await c.post("chat/completions", json=body, **kw)


async def test_completion_is_openai_shaped_and_recorded_with_the_real_engine():
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        ep = OpenAIEndpoint(engine)  # the tokenizer defaults to the engine's
        with ep.session() as s:
            r = await post(ep, s.key, {"model": "x", "messages": USER, "logprobs": True, "max_tokens": 8})
            body = r.json()
            assert r.status_code == 200, body
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            choice = body["choices"][0]
            assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
            inter = s.interactions[body["id"]]
            resp = inter.model_response
            assert resp.input_tokens == tuple(tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False))
            assert body["usage"] == {
                "prompt_tokens": resp.input_len,
                "completion_tokens": resp.output_len,
                "total_tokens": resp.input_len + resp.output_len,
            }
            assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(list(resp.output_logprobs))
            assert choice["message"]["content"] == tok.decode(resp.output_tokens, skip_special_tokens=True)
            assert inter.messages == USER and inter.output_message_list == [choice["message"]]
            assert set(resp.output_versions) == {0}


async def test_models_health_and_auth():
    ep = OpenAIEndpoint(texts_engine([]))
    with ep.session() as s:
        async with client_for(ep, s.key) as c:
            models = (await c.get("models")).json()
            assert models["data"][0]["id"] == "rollout-trio"
        async with client_for(ep) as c:
            assert (await c.get("http://agent/health")).status_code == 200  # no key needed
            r = await c.get("models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        async with client_for(ep, "sk-wrong") as c:
            assert (await c.post("chat/completions", json={"messages": USER})).status_code == 401
    async with client_for(ep, s.key) as c:  # an ended session's key is refused
        assert (await c.get("models")).status_code == 401


async def test_tool_calls_are_parsed_and_tool_turns_are_templated():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = texts_engine([call, "5"])
    ep = OpenAIEndpoint(engine)
    with ep.session() as s:
        r = (await post(ep, s.key, {"messages": USER, "tools": TOOLS})).json()
        msg = r["choices"][0]["message"]
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        assert msg["content"] is None
        [tc] = msg["tool_calls"]
        assert tc["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'} and tc["id"].startswith("call_")
        follow = [*USER, msg, {"role": "tool", "tool_call_id": tc["id"], "content": "5"}]
        r2 = (await post(ep, s.key, {"messages": follow, "tools": TOOLS})).json()
        assert r2["choices"][0]["message"] == {"role": "assistant", "content": "5"}
    # The tiny template has no tools support: the schema goes into a system turn, the call
    # and its result into message text, exactly as the model produced / will read them.
    prompt = TOKENIZER.decode(engine.requests[1].input_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "add"' in prompt
    assert call in prompt
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in prompt


async def test_tool_choice_none_offers_no_tools():
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    engine = texts_engine([call])
    ep = OpenAIEndpoint(engine)
    with ep.session() as s:
        body = (await post(ep, s.key, {"messages": USER, "tools": TOOLS, "tool_choice": "none"})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": call}
    assert "# Tools" not in TOKENIZER.decode(engine.requests[0].input_ids)


@pytest.mark.parametrize(
    "text",
    ['<tool_call>{"name": "add", "arguments": {broken</tool_call>', "<tool_call>[1, 2]</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'],
)
async def test_malformed_tool_json_comes_back_as_content(text):
    ep = OpenAIEndpoint(texts_engine([text]))
    with ep.session() as s:
        r = await post(ep, s.key, {"messages": USER, "tools": TOOLS})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


async def test_stop_strings_cut_text_and_tokens():
    ep = OpenAIEndpoint(texts_engine(["12 apples END 34"]))
    with ep.session() as s:
        body = (await post(ep, s.key, {"messages": USER, "stop": ["END"]})).json()
        assert body["choices"][0]["message"]["content"] == "12 apples "
        assert body["choices"][0]["finish_reason"] == "stop"
        resp = s.interactions[body["id"]].model_response
        assert TOKENIZER.decode(resp.output_tokens) == "12 apples END"
        assert body["usage"]["completion_tokens"] == len(text_tokens("12 apples END"))


async def test_sampling_settings_reach_the_engine():
    engine = texts_engine(["a"])
    ep = OpenAIEndpoint(engine)
    with ep.session() as s:
        await post(ep, s.key, {"messages": USER, "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 7})
    g = engine.requests[0].gconfig
    assert (g.temperature, g.top_p, g.max_new_tokens, g.n_samples) == (0.5, 0.9, 7, 1)
    assert IM_END in g.stop_token_ids


async def test_concurrent_sessions_are_isolated():
    engine = ScriptedEngine(delay=0.01)
    engine.tokenizer = TOKENIZER
    ep = OpenAIEndpoint(engine)
    seen: dict[int, set[str]] = {}

    async def episode(i):
        with ep.session() as s:
            ids = set()
            for _ in range(3):
                r = await post(ep, s.key, {"messages": [{"role": "user", "content": f"episode {i}"}], "max_tokens": 2})
                ids.add(r.json()["id"])
            assert set(s.interactions) == ids
            assert all(inter.messages[0]["content"] == f"episode {i}" for inter in s.interactions.values())
            seen[i] = ids

    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(episode, i)
    all_ids = [x for ids in seen.values() for x in ids]
    assert len(all_ids) == len(set(all_ids)) == 24


BAD_REQUESTS = [
    ({"model": "x"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, 400, "messages[0].tool_calls"),
    ({"messages": USER, "n": 2}, 400, "n"),
    ({"messages": USER, "max_tokens": 10**12}, 400, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": "10"}, 400, "max_tokens"),
    ({"messages": USER, "temperature": 5}, 400, "temperature"),
    ({"messages": USER, "top_p": 0}, 400, "top_p"),
    ({"messages": USER, "stop": [1]}, 400, "stop"),
    ({"messages": USER, "stream": "yes"}, 400, "stream"),
    ({"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ({"messages": USER, "top_logprobs": 5}, 400, "top_logprobs"),
    (b"{not json", 400, "body"),
    (b'["a list"]', 400, "body"),
    (b"\xff\xfe", 400, "body"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_REQUESTS)
async def test_bad_requests_get_openai_style_4xx(body, status, field):
    engine = texts_engine([])
    ep = OpenAIEndpoint(engine)
    with ep.session() as s:
        r = await post(ep, s.key, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith(field + ":"), err
    assert engine.requests == [] and s.interactions == {}


def asgi_scope(key, path="/v1/chat/completions"):
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode())], "server": ("agent", 80), "client": None,
        "root_path": "",
    }


async def test_a_body_that_never_finishes_is_a_408(autojump_clock):
    ep = OpenAIEndpoint(texts_engine([]), body_timeout=5)
    sent = []

    async def receive():
        if not sent and not getattr(receive, "started", False):
            receive.started = True
            return {"type": "http.request", "body": b'{"messages": ', "more_body": True}
        await trio.sleep_forever()

    async def send(message):
        sent.append(message)

    with ep.session() as s:
        await ep.app(asgi_scope(s.key), receive, send)
    assert sent[0]["status"] == 408 and trio.current_time() == pytest.approx(5)


async def test_body_size_limit_is_413():
    ep = OpenAIEndpoint(texts_engine([]), max_body_bytes=1000)
    with ep.session() as s:
        r = await post(ep, s.key, {"messages": [{"role": "user", "content": "x" * 2000}]})
        assert r.status_code == 413 and "limit of 1000 bytes" in r.json()["error"]["message"]

        # No Content-Length (chunked): the limit is enforced while reading, at the 11th chunk.
        received, sent = 0, []

        async def receive():
            nonlocal received
            received += 1
            return {"type": "http.request", "body": b"x" * 100, "more_body": True}

        async def send(message):
            sent.append(message)

        await ep.app(asgi_scope(s.key), receive, send)
        assert sent[0]["status"] == 413 and received == 11


async def test_the_engine_refusing_a_request_is_a_400_and_an_engine_failure_a_500():
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        ep = OpenAIEndpoint(engine, max_tokens_limit=10**6)
        with ep.session() as s:
            r = await post(ep, s.key, {"messages": [{"role": "user", "content": "x" * 3000}]})  # past the context
            assert r.status_code == 400 and "engine refused" in r.json()["error"]["message"]

    def boom(req):
        raise RuntimeError("GPU on fire")

    broken = ScriptedEngine(boom)
    ep = OpenAIEndpoint(broken, TOKENIZER)
    with ep.session() as s:
        r = await post(ep, s.key, {"messages": USER})
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "RuntimeError: GPU on fire", "type": "server_error", "param": None, "code": None
    }


async def test_ending_the_session_aborts_its_in_flight_generation():
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    ep = OpenAIEndpoint(engine)
    statuses = []

    async def call(key):
        statuses.append((await post(ep, key, {"messages": USER})).status_code)

    async with trio.open_nursery() as n:
        with ep.session() as s:
            n.start_soon(call, s.key)
            while not engine.in_flight:
                await trio.lowlevel.checkpoint()
            [rid] = engine.in_flight
    assert engine.aborted == [rid] and statuses == [409]


def test_constructor_errors_name_the_field():
    with pytest.raises(ValueError, match="tokenizer: required"):
        OpenAIEndpoint(ScriptedEngine())
    with pytest.raises(ValueError, match="default_max_tokens"):
        OpenAIEndpoint(texts_engine([]), default_max_tokens=0)


@pytest.mark.parametrize("size", [10, 5000])  # short: templated on the event loop; long: in a thread
async def test_prompt_ids_are_the_chat_template_whatever_the_length(size):
    engine = texts_engine(["ok"])
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * size}]
    ep = OpenAIEndpoint(engine)
    with ep.session() as s:
        assert (await post(ep, s.key, {"messages": messages})).status_code == 200
    expected = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(engine.requests[0].input_ids) == expected


async def test_the_in_process_transport_answers_and_a_cancelled_caller_aborts_its_generation():
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    ep = OpenAIEndpoint(engine)
    with ep.session() as s:
        headers = {"authorization": f"Bearer {s.key}"}
        async with httpx.AsyncClient(transport=ep.in_process_transport(), base_url="http://agent/v1/", headers=headers) as c:
            assert (await c.get("models")).status_code == 200
            async with trio.open_nursery() as n:
                n.start_soon(partial(c.post, "chat/completions", json={"messages": USER}))
                while not engine.in_flight:
                    await trio.lowlevel.checkpoint()
                [rid] = engine.in_flight
                n.cancel_scope.cancel()
    assert engine.aborted == [rid] and s.interactions == {}


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=60)), min_size=1, max_size=5
    ),
    with_tool=st.booleans(),
    specials=st.booleans(),
)
def test_prompt_ids_equal_the_tokenizers_own_chat_template_tokens(
    turns: list[tuple[str, str]], with_tool: bool, specials: bool
) -> None:
    """Invariant: ChatTemplate.prompt_ids (render, then the fast backend's encode) equals
    apply_chat_template(tokenize=True) on the same conversation, special-token text,
    unicode and tool preambles included."""
    from rollout_trio.agents._schema import ChatMessage, Tool, ToolFunction
    from rollout_trio.agents._template import ChatTemplate

    messages = [
        ChatMessage(role=role, content=(f"{IM_END}{text}<|im_start|>" if specials else text))  # type: ignore[arg-type]
        for role, text in turns
    ]
    tools = [Tool(function=ToolFunction(name="add", description="adds", parameters={"type": "object"}))] if with_tool else []
    template = ChatTemplate(TOKENIZER)
    expected = TOKENIZER.apply_chat_template(
        template.messages_for_template(messages, tools), add_generation_prompt=True, tokenize=True, return_dict=False,
        **({"tools": [t.as_dict() for t in tools]} if tools and template.native_tools else {}),
    )  # fmt: skip
    assert template.prompt_ids(messages, tools) == list(expected)
