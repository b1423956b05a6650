"""The answer's bytes (gateway/openai/chunks.py, gateway/openai/answer.py): the prepared chunk templates
give byte for byte what the pydantic chunk models, `model_dump` and
`json.dumps(..., separators=(",", ":"), ensure_ascii=False)` give, and the JSON answers built as dicts
equal the response models' dumps."""

from __future__ import annotations

import json

import pytest

from engine import RequestOutput, TokenLogprob
from gateway import jsonio
from gateway.openai import answer, chunks
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.chunks import ChatChunks, CompletionChunks, sse_event
from gateway.openai.schema import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
)

TEXTS = ["", "hello", " world", 'say "hi"', "back\\slash", "line\nbreak\ttab\r", "\x00\x01\x1f\x7f",
         "é ü ß 中文 日本語", "emoji 😀🎉", "\u2028\u2029 separators", "</script><!--", "{\"json\": [1, 2]}",
         "\ufeff bom", "\U0010ffff"]
MODELS = ["remote-model", 'odd "model"/ä', "m\n"]
FINISH = ["stop", "length", None]


def _outputs() -> list[RequestOutput]:
    outs = [RequestOutput(request_id="r", text=t) for t in TEXTS]
    outs += [RequestOutput(request_id="r", text=t, finished=True, finish_reason=f)  # type: ignore[arg-type]
             for t in ("", "last", "ünï") for f in FINISH]
    return outs


@pytest.mark.parametrize("fmt", [ChatChunks, CompletionChunks])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_chunk_templates_equal_the_general_path_byte_for_byte(fmt, include_usage, model):
    enc = fmt("chatcmpl-0123abc", 1796000000, model, include_usage)
    for index in (0, 1, 12):
        acc_t, acc_g = ChoiceAcc(), ChoiceAcc()  # the first output of a chat choice adds the role chunk
        for out in _outputs():
            assert chunks.templated(out)
            fast = enc.events(index, out, acc_t)
            slow = [sse_event(d) for d in enc.dicts(index, out, acc_g)]
            assert fast == slow, (out, fast, slow)
    for usage in (TokenUsage(0, 0, 0), TokenUsage(12, 345, 6)):
        assert enc.usage_event(usage) == sse_event(enc.usage_dict(usage))


def test_chunk_events_are_what_clients_parse():
    enc = ChatChunks("chatcmpl-x", 1, "m", False)
    acc = ChoiceAcc()
    events = enc.events(0, RequestOutput(request_id="r", text='a "b"\n'), acc)
    assert [json.loads(e[len(b"data: "):]) for e in events] == [
        {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                      "logprobs": None}], "system_fingerprint": "fp_sluice"},
        {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": 'a "b"\n'}, "finish_reason": None, "logprobs": None}],
         "system_fingerprint": "fp_sluice"}]
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)


@pytest.mark.parametrize("fmt", [ChatChunks, CompletionChunks])
def test_an_output_the_template_cannot_express_takes_the_general_path(fmt, monkeypatch):
    """Logprobs and tool calls: `templated` says no, the pydantic path encodes it."""
    out = RequestOutput(request_id="r", text="x", token_ids=[5],
                        logprobs=[TokenLogprob(token_id=5, logprob=-0.5)])
    assert not chunks.templated(out)
    enc = fmt("id", 1, "m", True)
    general: list[RequestOutput] = []
    dicts = enc.dicts

    def spy(index, o, acc):
        general.append(o)
        return dicts(index, o, acc)

    monkeypatch.setattr(enc, "dicts", spy)
    assert enc.events(0, out, ChoiceAcc()) == [sse_event(d) for d in dicts(0, out, ChoiceAcc())]
    assert general == [out]


def _accs() -> list[ChoiceAcc]:
    a = ChoiceAcc(text=["he", 'llo "', "ü\n"], finish_reason="stop", finished=True, completion_tokens=3,
                  cached_tokens=2)
    b = ChoiceAcc(text=[], finish_reason="length", finished=True, completion_tokens=5, cached_tokens=4)
    return [a, b]


def test_json_answers_equal_the_response_models():
    accs = _accs()
    usage = TokenUsage.of(7, accs)
    assert usage == TokenUsage(7, 8, 4) and usage.as_dict() == usage.model().model_dump()
    assert json.loads(usage.json()) == usage.as_dict()
    chat = ChatCompletionResponse(id="chatcmpl-1", created=5, model="m", usage=usage.model(), choices=[
        ChatChoice(index=i, message=ChatMessageOut(content="".join(a.text)), finish_reason=a.finish_reason)
        for i, a in enumerate(accs)]).model_dump()
    for c in chat["choices"]:  # a message's `tool_calls` is left out when None
        if c["message"].get("tool_calls", 0) is None:
            del c["message"]["tool_calls"]
    mine = answer.chat_response("chatcmpl-1", 5, "m", accs, usage)
    assert mine == chat and list(mine) == list(chat)  # the same keys in the same order
    assert jsonio.dumps(mine) == json.dumps(chat, separators=(",", ":"), ensure_ascii=False).encode()
    cmpl = CompletionResponse(id="cmpl-1", created=5, model="m", usage=usage.model(), choices=[
        CompletionChoice(index=i, text="".join(a.text), finish_reason=a.finish_reason)
        for i, a in enumerate(accs)]).model_dump()
    mine = answer.completion_response("cmpl-1", 5, "m", accs, usage)
    assert mine == cmpl and list(mine) == list(cmpl)


def test_jsonio_falls_back_to_the_stdlib():
    assert jsonio.dumps({"a": [1, "ü", None]}) == b'{"a":[1,"\xc3\xbc",null]}'
    assert jsonio.dumps(2**70) == b"1180591620717411303424"  # beyond orjson's 64 bits
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate: refused, as `sse_event` refuses it
        jsonio.dumps("\ud800")
    assert jsonio.loads(b'{"x": -Infinity, "y": 1}') == {"x": float("-inf"), "y": 1}
    with pytest.raises(ValueError):
        jsonio.loads(b"{not json")
