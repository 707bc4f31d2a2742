"""radixserve's own gRPC service (radixserve.v1.RadixServe) through every service of the
session's tiny stack, with the real grpcio client: the same answers as HTTP, streaming order,
`n`, structured output, deadlines and cancellation freeing KV, many requests on one channel
and on one bidirectional stream, and refusals naming the field as the HTTP 400 does."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.grpc_api import radixserve_pb2 as pb
from shared.grpc_api import radixserve_pb2_grpc as pb_grpc
from tests.e2e.stack import Stack
from tests.e2e.test_control_endpoints import post

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PROMPT = "the thin cat sat on the"


@pytest.fixture(scope="module")
def channel(tiny_stack: Stack) -> Iterator[grpc.Channel]:
    assert tiny_stack.grpc_target is not None
    with grpc.insecure_channel(tiny_stack.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.RadixServeStub:
    return pb_grpc.RadixServeStub(channel)


def greedy(max_new_tokens: int = 12, **more: Any) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **more)


def http_generate(stack: Stack, body: dict[str, Any]) -> Any:
    status, out = post(stack, "/generate", body)
    assert status == 200, out
    return out


def test_generate_answers_what_http_answers(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = http_generate(tiny_stack, {"text": PROMPT, "sampling_params": params})
    got = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy()), timeout=60)
    (choice,) = got.choices
    assert choice.text == want["text"] and list(choice.output_ids) == want["output_ids"]
    assert choice.finish.reason == "length"
    assert choice.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert choice.usage.completion_tokens == 12
    by_ids = stub.Generate(
        pb.GenerateRequest(input_ids=pb.TokenIds(ids=[5, 6, 7]), sampling_params=greedy(4)),
        timeout=60,
    )
    want_ids = http_generate(
        tiny_stack, {"input_ids": [5, 6, 7], "sampling_params": {**params, "max_new_tokens": 4}}
    )
    assert list(by_ids.choices[0].output_ids) == want_ids["output_ids"]


def test_streamed_chunks_add_up_to_the_whole_per_sample(stub: pb_grpc.RadixServeStub) -> None:
    whole = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy()), timeout=60)
    chunks = list(
        stub.StreamGenerate(
            pb.GenerateRequest(text=PROMPT, sampling_params=greedy(n=3), rid="streamed"),
            timeout=60,
        )
    )
    for i in range(3):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == whole.choices[0].text
        assert [t for c in mine for t in c.token_ids] == list(whole.choices[0].output_ids)
        assert [c.HasField("finish") for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].usage.completion_tokens == 12
        assert {c.rid for c in mine} == {"streamed" if i == 0 else f"streamed-{i}"}


def test_chat_goes_through_the_template_as_http_chat_does(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    status, want = post(
        tiny_stack,
        "/v1/chat/completions",
        {"model": "tiny-llama-11", "messages": messages, "max_tokens": 10, "temperature": 0},
    )
    assert status == 200
    got = stub.Chat(
        pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="hello there")],
            sampling_params=pb.SamplingParams(max_new_tokens=10, temperature=0),
        ),
        timeout=60,
    )
    assert got.choices[0].text == want["choices"][0]["message"]["content"]
    streamed = stub.StreamChat(
        pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="hello there")],
            sampling_params=pb.SamplingParams(max_new_tokens=10, temperature=0),
        ),
        timeout=60,
    )
    assert "".join(c.text for c in streamed) == got.choices[0].text


def test_structured_output_is_enforced(stub: pb_grpc.RadixServeStub) -> None:
    regex = stub.Generate(
        pb.GenerateRequest(text=PROMPT, sampling_params=greedy(8, regex="[0-9]{3}-[a-z]{2}")),
        timeout=60,
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    }
    out = stub.Generate(
        pb.GenerateRequest(
            text=PROMPT,
            sampling_params=pb.SamplingParams(
                max_new_tokens=40, temperature=0, json_schema=json.dumps(schema)
            ),
        ),
        timeout=60,
    )
    value = json.loads(out.choices[0].text)
    assert set(value) == {"colour", "ok"} and value["colour"] in ("red", "blue")
    assert isinstance(value["ok"], bool)
    picked = stub.Generate(
        pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(choices=[" yes", " no"])),
        timeout=60,
    )
    assert picked.choices[0].text in (" yes", " no")


def test_logprobs_come_with_their_tokens(stub: pb_grpc.RadixServeStub) -> None:
    out = stub.Generate(
        pb.GenerateRequest(
            text=PROMPT,
            sampling_params=greedy(4),
            return_logprob=True,
            top_logprobs_num=2,
            logprob_start_len=0,
        ),
        timeout=60,
    )
    c = out.choices[0]
    assert [lp.token_id for lp in c.logprobs] == list(c.output_ids)
    for lp in c.logprobs:  # greedy: each token is the most likely one
        assert len(lp.top) == 2 and lp.top[0].token_id == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0].logprob)
    assert len(c.prompt_logprobs) == c.usage.prompt_tokens
    assert not c.prompt_logprobs[0].HasField("logprob")  # nothing predicts the first token
    assert all(lp.HasField("logprob") for lp in c.prompt_logprobs[1:])


def test_a_passed_deadline_aborts_and_frees_the_kv(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    long = pb.SamplingParams(max_new_tokens=3000, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=long), timeout=1.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    tiny_stack.wait_idle()  # the executor let it go: every slot free or cached


def test_cancelling_a_stream_aborts_the_request_and_frees_the_kv(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    long = pb.SamplingParams(max_new_tokens=3000, ignore_eos=True)
    call = stub.StreamGenerate(pb.GenerateRequest(text=PROMPT, sampling_params=long), timeout=60)
    seen = [next(call), next(call)]
    assert all(not c.HasField("finish") for c in seen)
    tiny_stack.wait_running()
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    tiny_stack.wait_idle()


def test_two_hundred_requests_share_one_channel(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    def one(i: int) -> pb.GenerateResponse:
        req = pb.GenerateRequest(text=f"request {i}:", sampling_params=greedy(48))
        return stub.Generate(req, timeout=120)

    def run_all() -> list[pb.GenerateResponse]:
        with ThreadPoolExecutor(64) as pool:
            return list(pool.map(one, range(200)))

    results, most = tiny_stack.most_running_during(run_all)
    assert len(results) == 200
    assert all(r.choices[0].usage.completion_tokens == 48 for r in results)
    assert most > 8  # they ran batched, not one after another
    tiny_stack.wait_idle()


def test_one_bidirectional_stream_carries_many_requests(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    whole = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(5)), timeout=60)
    cancel_now = threading.Event()

    def requests() -> Iterator[pb.StreamRequest]:
        for i in range(20):
            yield pb.StreamRequest(
                tag=f"g{i}", generate=pb.GenerateRequest(text=PROMPT, sampling_params=greedy(5))
            )
        yield pb.StreamRequest(
            tag="chat",
            chat=pb.ChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")],
                sampling_params=pb.SamplingParams(max_new_tokens=3, temperature=0),
            ),
        )
        yield pb.StreamRequest(
            tag="bad",
            generate=pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(top_p=2)),
        )
        long = pb.SamplingParams(max_new_tokens=3000, ignore_eos=True)
        yield pb.StreamRequest(
            tag="long", generate=pb.GenerateRequest(text=PROMPT, sampling_params=long)
        )
        cancel_now.wait(60)
        yield pb.StreamRequest(tag="long", cancel=pb.Cancel())

    texts: dict[str, str] = {}
    ends: dict[str, Any] = {}
    for reply in stub.GenerateStream(requests(), timeout=120):
        if reply.HasField("error"):
            ends[reply.tag] = reply.error
            continue
        texts[reply.tag] = texts.get(reply.tag, "") + reply.chunk.text
        if reply.tag == "long" and len(texts["long"]) > 0:
            cancel_now.set()
        if reply.chunk.HasField("finish"):
            ends[reply.tag] = reply.chunk.finish.reason
    for i in range(20):
        assert texts[f"g{i}"] == whole.choices[0].text and ends[f"g{i}"] == "length"
    assert ends["chat"] in ("stop", "length") and texts["chat"]
    bad = ends["bad"]
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.param == "sampling_params.top_p" and "in (0, 1]" in bad.message
    assert ends["long"].code == grpc.StatusCode.CANCELLED.value[0]
    tiny_stack.wait_idle()


@pytest.mark.parametrize(
    ("request_", "body", "param"),
    [
        (
            pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(temperature=-1)),
            {"text": "x", "sampling_params": {"temperature": -1}},
            "sampling_params.temperature",
        ),
        (
            pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(max_new_tokens=10**6)),
            {"text": "x", "sampling_params": {"max_new_tokens": 10**6}},
            "sampling_params.max_new_tokens",
        ),
        (
            pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(regex="(")),
            {"text": "x", "sampling_params": {"regex": "("}},
            "sampling_params.regex",
        ),
        (
            pb.GenerateRequest(
                text="x", sampling_params=pb.SamplingParams(regex="a", ebnf='root ::= "a"')
            ),
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "sampling_params",
        ),
        (
            pb.GenerateRequest(sampling_params=pb.SamplingParams()),
            {"sampling_params": {}},
            "text",
        ),
        (
            pb.GenerateRequest(text="x", rid="not a rid!"),
            {"text": "x", "rid": "not a rid!"},
            "rid",
        ),
        (
            pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(logit_bias={5: 500})),
            {"text": "x", "sampling_params": {"logit_bias": {"5": 500}}},
            "sampling_params.logit_bias[5]",
        ),
    ],
)
def test_bad_input_is_invalid_argument_with_the_http_message(
    tiny_stack: Stack,
    stub: pb_grpc.RadixServeStub,
    request_: pb.GenerateRequest,
    body: dict[str, Any],
    param: str,
) -> None:
    status, http = post(tiny_stack, "/generate", body)
    assert status == 400
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(request_, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailers = dict(e.value.trailing_metadata() or ())
    assert trailers["error-param"] == http["error"]["param"]
    assert http["error"]["param"].startswith(param)
    assert http["error"]["message"] in e.value.details()


def test_tokenize_detokenize_abort_and_model_info(
    tiny_stack: Stack, stub: pb_grpc.RadixServeStub
) -> None:
    _, want = post(tiny_stack, "/tokenize", {"text": PROMPT})
    tokens = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=30)
    assert list(tokens.tokens) == want["tokens"] and tokens.count == want["count"]
    chat = stub.Tokenize(
        pb.TokenizeRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
        ),
        timeout=30,
    )
    assert chat.count > 1
    text = stub.Detokenize(pb.DetokenizeRequest(tokens=tokens.tokens), timeout=30).text
    assert text.strip() == PROMPT
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(pb.AbortRequest(rid="nobody-here"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    long = pb.SamplingParams(max_new_tokens=3000, ignore_eos=True)
    call = stub.StreamGenerate(
        pb.GenerateRequest(text=PROMPT, sampling_params=long, rid="stop-me"), timeout=60
    )
    next(call)
    assert list(stub.Abort(pb.AbortRequest(rid="stop-me"), timeout=30).aborted) == ["stop-me"]
    assert [c.finish.reason for c in call if c.HasField("finish")] == ["abort"]
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.served_model_name == "tiny-llama-11" and info.context_length == 4096
    assert info.architecture == "LlamaForCausalLM" and info.has_chat_template
    tiny_stack.wait_idle()


def test_health_service_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "radixserve.v1.RadixServe", "sglang.grpc.scheduler.SglangScheduler"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in answer.list_services_response.service}
    assert {
        "radixserve.v1.RadixServe",
        "sglang.grpc.scheduler.SglangScheduler",
        "grpc.health.v1.Health",
    } <= names


def test_smg_worker_info_reports_the_stack(channel: grpc.Channel) -> None:
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

    smg = sgl_grpc.SglangSchedulerStub(channel)
    health = smg.HealthCheck(sgl.HealthCheckRequest(), timeout=30)
    assert health.healthy, health.message
    model = smg.GetModelInfo(sgl.GetModelInfoRequest(), timeout=30)
    assert model.served_model_name == "tiny-llama-11" and model.is_generation
    assert model.max_context_length == 4096 and list(model.architectures) == ["LlamaForCausalLM"]
    args = smg.GetServerInfo(sgl.GetServerInfoRequest(), timeout=30).server_args
    assert (args["tp_size"], args["dp_size"], args["max_total_tokens"]) == (1, 1, 8192)
