"""The official OpenAI Python client and LangChain's ChatOpenAI against a running engramd
(started by scripts/test-api.sh).

Plain asserts, no pytest: `python tests/python/test_openai_client.py` with ENGRAM_URL (the
daemon's base URL) and ENGRAM_KEY (an API key with the qa and search scopes, or admin) set.
Covers /v1/models, /v1/chat/completions (JSON and streamed, with and without retrieval, every
parameter honoured or refused by name, structured output against three JSON schemas, the
client's parse() and LangChain's with_structured_output) and /v1/embeddings, and checks that
the client's typed errors carry our error body.
"""

import base64
import json
import os
import struct
import sys
import time
import urllib.request

import jsonschema_rs
import openai
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, Field

BASE = os.environ["ENGRAM_URL"].rstrip("/")
KEY = os.environ["ENGRAM_KEY"]

client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=300)


def rest(method, path, body=None):
    """A call to the enterprise REST API (to set up a collection for retrieval)."""
    req = urllib.request.Request(
        BASE + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"null")


def test_models():
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == "engram" and ids[2].startswith("all-MiniLM-L6-v2@"), ids
    # The embedder's plain name and OpenAI's embedding names, which clients send by default.
    assert {"all-MiniLM-L6-v2", "text-embedding-ada-002", "text-embedding-3-small"} <= set(ids), ids
    assert all(m.object == "model" for m in models.data)
    assert client.models.retrieve(ids[1]).id == ids[1]
    try:
        client.models.retrieve("gpt-4o")
        raise AssertionError("an unknown model was found")
    except openai.NotFoundError as e:
        assert e.body["type"] == "model_not_found", e.body
    return ids


def test_chat(model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert r.object == "chat.completion", r
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content, c
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert r.usage.completion_tokens <= 8, r.usage
    assert r.usage.prompt_tokens > 0
    # Same request at temperature 0: same answer.
    again = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert again.choices[0].message.content == c.message.content


def test_chat_stream(model):
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=8,
        stream=True,
    )
    text, finish, chunks = "", None, 0
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        chunks += 1
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
            if choice.finish_reason:
                finish = choice.finish_reason
    assert chunks >= 2, chunks
    assert text, "no streamed text"
    assert finish in ("stop", "length"), finish


def test_chat_with_retrieval(model):
    rest("POST", "/api/v1/collections", {"name": "pyclient"})
    up = rest(
        "POST",
        "/api/v1/collections/pyclient/documents/text",
        {"name": "leave.md", "text": "# Leave\n\nEveryone gets 25 days of paid leave per year."},
    )
    doc = up["documents"][0]["id"]
    deadline = time.time() + 300
    while rest("GET", f"/api/v1/collections/pyclient/documents/{doc}")["stage"] != "done":
        assert time.time() < deadline, "the document did not get indexed"
        time.sleep(0.1)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "How many days of paid leave?"}],
        max_tokens=8,
        extra_body={"engram": {"collections": ["pyclient"], "top_k": 2}},
    )
    extra = r.model_extra or {}
    assert extra.get("citations"), r
    assert extra["citations"][0]["doc_name"] == "leave.md", extra["citations"]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "How many days of paid leave?"}],
        max_tokens=8,
        stream=True,
        extra_body={"engram": {"collections": ["pyclient"], "top_k": 2}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    rest("DELETE", "/api/v1/collections/pyclient")


def test_embeddings(embed_model):
    r = client.embeddings.create(model=embed_model, input=["paid leave", "holiday allowance"])
    assert len(r.data) == 2
    assert [d.index for d in r.data] == [0, 1]
    dim = len(r.data[0].embedding)
    assert dim == 384, dim
    norm = sum(x * x for x in r.data[0].embedding) ** 0.5
    assert abs(norm - 1.0) < 1e-3, norm
    one = client.embeddings.create(model=embed_model, input="paid leave")
    assert len(one.data) == 1
    assert max(abs(a - b) for a, b in zip(one.data[0].embedding, r.data[0].embedding)) < 1e-4
    # The client asks for base64 by default and decodes it; asked explicitly, it is returned
    # as sent: little-endian f32.
    b64 = client.embeddings.create(model=embed_model, input="paid leave", encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(floats) == dim
    assert max(abs(a - b) for a, b in zip(floats, one.data[0].embedding)) < 1e-6


def test_langchain_embeddings(embed_model):
    """LangChain's OpenAIEmbeddings sends cl100k_base token ids (tiktoken), not text: the
    vectors must equal those of the text itself."""
    emb = OpenAIEmbeddings(model=embed_model, base_url=BASE + "/v1", api_key=KEY, max_retries=0)
    texts = ["How many days of paid leave?", "新密码至少需要几个字符"]
    vectors = emb.embed_documents(texts)
    direct = client.embeddings.create(model=embed_model, input=texts)
    for got, want in zip(vectors, direct.data):
        assert max(abs(a - b) for a, b in zip(got, want.embedding)) < 1e-4
    assert len(emb.embed_query("paid leave")) == 384
    # With its defaults (model text-embedding-ada-002, tiktoken's cl100k_base from the cache
    # test-api.sh fills from the appliance's copy, as docs/engramd.md tells a client to).
    default = OpenAIEmbeddings(base_url=BASE + "/v1", api_key=KEY, max_retries=0)
    for got, want in zip(default.embed_documents(texts), direct.data):
        assert max(abs(a - b) for a, b in zip(got, want.embedding)) < 1e-4


def test_errors(model):
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="egk_wrong_key", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401
        assert e.body["type"] == "unauthorized", e.body
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
        raise AssertionError("an empty conversation was accepted")
    except openai.BadRequestError as e:
        assert e.body["type"] == "invalid_request", e.body


def test_parameters(model):
    """Each OpenAI parameter is honoured (checked by its effect) or refused by name."""
    ask = dict(model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**ask, user="u-1", n=1)
    text = plain.choices[0].message.content
    # stop: the answer ends before the first stop string.
    stop = text[4:6]
    cut = client.chat.completions.create(**ask, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)].strip(), (text, stop, cut)
    assert cut.choices[0].finish_reason == "stop"
    # max_completion_tokens, and the name `engram` for the served model.
    short = client.chat.completions.create(**{**ask, "model": "engram"}, max_completion_tokens=2)
    assert short.usage.completion_tokens <= 2, short.usage
    # top_p with a seed: reproducible sampling.
    a, b = (client.chat.completions.create(**{**ask, "temperature": 1.0}, top_p=0.9, seed=11) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content
    # stream_options.include_usage: a last chunk with the usage and no choices.
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0, chunks[-1]
    # frequency_penalty: a list repeats its punctuation, which the penalty makes costly.
    varied = client.chat.completions.create(**ask, frequency_penalty=2.0, presence_penalty=0.5, logit_bias={})
    assert varied.choices[0].message.content != text, (text, varied)
    # logprobs: each token of the answer with its log probability and alternatives.
    scored = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == scored.usage.completion_tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens), tokens
    # n: several choices, each reproducible by its seed (choice i uses seed + i).
    several = client.chat.completions.create(**{**ask, "temperature": 1.0}, n=2, seed=3)
    assert [c.index for c in several.choices] == [0, 1], several
    alone = client.chat.completions.create(**{**ask, "temperature": 1.0}, seed=4)
    assert several.choices[1].message.content == alone.choices[0].message.content, (several, alone)
    pieces = ["", ""]
    for chunk in client.chat.completions.create(**{**ask, "temperature": 1.0}, n=2, seed=3, stream=True):
        for c in chunk.choices:
            pieces[c.index] += c.delta.content or ""
    assert [p.strip() for p in pieces] == [c.message.content for c in several.choices], pieces
    # Text completions: best_of and echo.
    best = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, best_of=3, seed=2)
    assert len(best.choices) == 2 and best.usage.completion_tokens > 0, best
    echoed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Once upon a time"), echoed
    # echo with logprobs and max_tokens=0: the prompt scored, as evaluation harnesses ask.
    scored = client.completions.create(model=model, prompt="Once upon a time", max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert "".join(lp.tokens) == "Once upon a time" and lp.token_logprobs[0] is None, lp
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and scored.usage.completion_tokens == 0, scored
    # A batch of token id arrays, scored as lm-evaluation-harness's local-completions asks: every
    # id sent is an entry (the first without a log probability), one choice per prompt, in order.
    ids = [[504, 3458, 314, 260], [1780, 28, 827]]
    batch = client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1], batch
    for c, sent in zip(batch.choices, ids):
        assert len(c.logprobs.tokens) == len(sent) + 1 and c.logprobs.token_logprobs[0] is None, c
        assert c.text == "".join(c.logprobs.tokens), c
    assert batch.usage.prompt_tokens == sum(map(len, ids)), batch.usage
    refused = {
        "n": {"n": 17},
        "top_logprobs": {"logprobs": True, "top_logprobs": 21},
        "presence_penalty": {"presence_penalty": 2.5},
        "logit_bias": {"logit_bias": {"not-an-id": 1}},
        "response_format": {"response_format": {"type": "xml"}},
        "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "date"}}}]},
        "foo": {"extra_body": {"foo": 1}},
    }
    for param, extra in refused.items():
        try:
            client.chat.completions.create(**ask, **extra)
            raise AssertionError(f"{param} was accepted")
        except openai.BadRequestError as e:
            assert f"`{param}`" in e.body["message"], (param, e.body)
    try:
        client.chat.completions.create(**{**ask, "model": "gpt-4o"})
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.body["type"] == "model_not_found", e.body


# Three schemas of the shapes clients send: flat with an optional field, nested through
# $defs with an enum, and a bounded list of objects.
SCHEMAS = {
    "contact": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer"},
            "email": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "event": {
        "$defs": {
            "Place": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "indoor": {"type": "boolean"}},
                "required": ["city", "indoor"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "kind": {"enum": ["meeting", "party", "concert", "other"]},
            "place": {"$ref": "#/$defs/Place"},
        },
        "required": ["title", "kind", "place"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"product": {"type": "string", "maxLength": 20}, "qty": {"type": "integer"}},
                    "required": ["product", "qty"],
                    "additionalProperties": False,
                },
            },
            "total": {"type": "number"},
        },
        "required": ["items", "total"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "contact": ["Ada Lovelace is 36; write to ada@example.com.", "Bob is a 40 year old plumber.", "Extract the contact: Chen Wei, 29."],
    "event": ["Team meeting in Berlin, in room 4.", "An open-air concert in Lisbon.", "Birthday party at home in Paris."],
    "order": ["Two apples and one pear, 3.50 in all.", "Order: 5 pens, total 12.", "One laptop for 999.99."],
}


def test_structured_output(model):
    """Every answer parses and validates against its schema: 100 %, not most of the time."""
    answers = 0
    for name, schema in SCHEMAS.items():
        validator = jsonschema_rs.validator_for(schema)
        for prompt in PROMPTS[name]:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=96,
                temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            )
            c = r.choices[0]
            assert c.finish_reason == "stop", (name, prompt, c)
            value = json.loads(c.message.content)
            assert validator.is_valid(value), (name, value)
            answers += 1
    assert answers == 9
    # Sampled answers are held to the schema too.
    for seed in range(3):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS["event"][seed]}],
            max_tokens=96,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "event", "schema": SCHEMAS["event"]}},
        )
        assert jsonschema_rs.validator_for(SCHEMAS["event"]).is_valid(json.loads(r.choices[0].message.content))
    # json_object: any JSON object.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A JSON object with the name and the age of Ada, who is 36."}],
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    # What the grammar cannot enforce is refused, naming the keyword.
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "pattern": "^a+$"}}},
        )
        raise AssertionError("an unenforceable pattern was accepted")
    except openai.BadRequestError as e:
        assert "`pattern`" in e.body["message"], e.body


class Contact(BaseModel):
    name: str = Field(max_length=40)
    age: int
    city: str | None = Field(default=None, max_length=30)


def test_client_parse(model):
    """The client's parse(): a pydantic model turned into a strict schema, the answer back."""
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Ada Lovelace is 36 and lives in London."}],
        max_tokens=96,
        temperature=0,
        response_format=Contact,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Contact), r


def test_langchain(model):
    """LangChain's ChatOpenAI: a plain invoke, a stream, and with_structured_output."""
    llm = ChatOpenAI(base_url=BASE + "/v1", api_key=KEY, model=model, temperature=0, max_tokens=96, max_retries=0, timeout=300)
    reply = llm.invoke("Say hello.")
    assert isinstance(reply.content, str) and reply.content, reply
    assert "".join(c.content for c in llm.stream("Say hello.")) == reply.content
    contact = llm.with_structured_output(Contact).invoke("Chen Wei is 29 and lives in Shanghai.")
    assert isinstance(contact, Contact), contact
    as_dict = llm.with_structured_output(method="json_mode").invoke("A JSON object with the name and the age of Bob, who is 40.")
    assert isinstance(as_dict, dict), as_dict


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_tools(model):
    """Tool calls: arguments that parse and validate, streamed too, and the loop back."""
    ask = dict(model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=64, temperature=0, tools=[WEATHER])
    r = client.chat.completions.create(**ask, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(args), args
    # Streamed, the client's accumulation gives the same call.
    deltas = [ch.choices[0].delta for ch in client.chat.completions.create(**ask, tool_choice="required", stream=True) if ch.choices]
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    assert streamed and streamed[0].function.name == "get_weather", deltas
    # The tool's result goes back; the model answers.
    follow = client.chat.completions.create(
        **{**ask, "messages": ask["messages"] + [c.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]},
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls"), follow


def test_langchain_tools(model):
    """LangChain: bind_tools with a forced tool, and with_structured_output by function calling."""
    llm = ChatOpenAI(base_url=BASE + "/v1", api_key=KEY, model=model, temperature=0, max_tokens=96, max_retries=0, timeout=300)

    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str), msg.tool_calls
    contact = llm.with_structured_output(Contact, method="function_calling").invoke("Ada Lovelace is 36.")
    assert isinstance(contact, Contact), contact


def test_conversation(model):
    """Five turns: each one's cached_tokens covers the history (earlier prompts and answers)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    questions = ["What is the capital of France?", "And of Italy?", "Which one is bigger?", "Name a dish from each.", "Summarize our chat."]
    before = 0
    for turn, q in enumerate(questions):
        messages.append({"role": "user", "content": q})
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens
        if turn > 0:
            assert cached + 4 >= before, (turn, u, before)
        assert cached < u.prompt_tokens, u
        before = u.total_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    print(f"    turn 5: {u.prompt_tokens} prompt tokens, {cached} cached")


def test_completions(model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion", r
    text = r.choices[0].text
    assert text and r.usage.completion_tokens <= 6, r
    pieces = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == text


def main():
    started = time.time()
    ids = test_models()
    llm, embedder = ids[1], ids[2]
    for name, f in [
        ("chat", lambda: test_chat(llm)),
        ("chat stream", lambda: test_chat_stream(llm)),
        ("parameters", lambda: test_parameters(llm)),
        ("completions", lambda: test_completions(llm)),
        ("structured output", lambda: test_structured_output(llm)),
        ("client parse", lambda: test_client_parse(llm)),
        ("langchain", lambda: test_langchain("engram")),
        ("tools", lambda: test_tools(llm)),
        ("conversation", lambda: test_conversation(llm)),
        ("langchain tools", lambda: test_langchain_tools("engram")),
        ("chat with retrieval", lambda: test_chat_with_retrieval(llm)),
        ("embeddings", lambda: test_embeddings(embedder)),
        ("langchain embeddings", lambda: test_langchain_embeddings(embedder)),
        ("errors", lambda: test_errors(llm)),
    ]:
        t = time.time()
        f()
        print(f"ok  {name} ({time.time() - t:.1f} s)")
    print(f"openai {openai.__version__}: all passed in {time.time() - started:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(1)
