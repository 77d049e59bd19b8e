"""Log formats: every supported line shape, every kind of bad line, timestamp order."""

from __future__ import annotations

import json

import pytest

from analysis.replay.log_formats import LogLineError, LogOrder, _iso_for_py310, parse_line, read_log

SYS = {"role": "system", "content": "Be brief."}


def test_messages_prompt_batch_and_sharegpt_lines():
    [m] = parse_line(json.dumps({"messages": [SYS, {"role": "user", "content": "Hi"}], "session": "s1",
                                 "max_new_tokens": 4, "response": "Hello"}), 1)
    assert m.messages[-1] == {"role": "user", "content": "Hi"} and m.session == "s1" and m.max_new_tokens == 4
    assert m.response == "Hello" and m.fmt == "messages"
    [p] = parse_line('{"prompt": "The capital of France is"}', 2)
    assert p.prompt == "The capital of France is" and p.messages is None and p.fmt == "prompt"
    [b] = parse_line(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "x", "messages": [{"role": "user", "content": "Q"}],
                                          "max_tokens": 7}}), 3)
    assert b.fmt == "batch" and b.messages[0]["content"] == "Q" and b.max_new_tokens == 7
    turns = parse_line(json.dumps({"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}, {"from": "human", "value": "Q3"}]}), 4)
    assert [t.turn for t in turns] == [0, 1, 2] and all(t.fmt == "sharegpt" for t in turns)
    assert [m["role"] for m in turns[2].messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [t.response for t in turns] == ["A1", "A2", None]  # each turn's reply, as logged
    assert turns[1].messages == turns[0].messages + ({"role": "assistant", "content": "A1"},
                                                     {"role": "user", "content": "Q2"})


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"text": "hi"}', "no request found"),
    ('{"messages": [], "prompt": "x"}', "both"),
    ('{"messages": "hi"}', "list of messages"),
    ('{"messages": [{"role": "user", "content": "   "}]}', "empty"),
    ('{"messages": [{"role": 3, "content": "x"}]}', "role"),
    ('{"messages": ["hi"]}', "role and a content"),
    ('{"messages": [{"role": "user", "content": {"type": "image"}}]}', "empty"),
    ('{"prompt": 42}', "must be text"),
    ('{"prompt": ""}', "empty"),
    ('{"body": "x"}', "Batch API"),
    ('{"body": {"model": "x"}}', "no request found"),
    ('{"conversations": []}', "non-empty list"),
    ('{"conversations": [{"from": "human"}]}', 'needs "from" and "value"'),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "unknown speaker"),
    ('{"conversations": [{"from": "gpt", "value": "x"}]}', "no user turn"),
    ('{"prompt": "x", "timestamp": "yesterday"}', "neither ISO 8601"),
    ('{"prompt": "x", "timestamp": true}', "timestamp"),
    ('{"prompt": "x", "max_new_tokens": -1}', "max_new_tokens"),
    ('{"prompt": "x", "session": [1]}', "session"),
])
def test_bad_lines_say_why(line, reason):
    with pytest.raises(LogLineError, match=reason.replace("(", r"\(")):
        parse_line(line, 7)


def test_read_log_skips_bad_lines_with_numbers_or_stops_when_strict():
    lines = ['{"prompt": "a"}', "", "oops", '{"prompt": "b"}', '{"prompt": 1}']
    skipped = []
    got = list(read_log(lines, on_skip=skipped.append))
    assert [r.prompt for r in got] == ["a", "b"] and [r.line for r in got] == [1, 4]
    assert [(s.line, s.reason[:14]) for s in skipped] == [(3, "not valid JSON"), (5, '"prompt" must ')]
    with pytest.raises(LogLineError, match="^line 3: not valid JSON"):
        list(read_log(lines, strict=True))


def test_timestamps_iso_and_epoch_order_requests():
    lines = [json.dumps({"prompt": "c", "timestamp": "2026-01-01T00:00:30Z"}),
             json.dumps({"prompt": "a", "timestamp": 1767225600}),  # 2026-01-01T00:00:00Z
             json.dumps({"prompt": "b", "timestamp": "2026-01-01T00:00:10+00:00"}),
             json.dumps({"prompt": "d"})]  # no timestamp: stays right after the line before it (b)
    got = list(read_log(lines))
    assert [r.prompt for r in got] == ["a", "b", "d", "c"]
    assert got[0].timestamp == 1767225600.0 and got[3].timestamp == 1767225630.0


@pytest.mark.parametrize(("text", "py310"), [
    ("2026-01-01T00:00:30Z", "2026-01-01T00:00:30+00:00"),
    ("2026-01-01T00:00:30.5Z", "2026-01-01T00:00:30.500000+00:00"),
    ("2026-01-01T00:00:30,1234567+02:00", "2026-01-01T00:00:30.123456+02:00"),
    ("2026-01-01T00:00:30.123", "2026-01-01T00:00:30.123000"),
    ("2026-01-01", "2026-01-01"),
])
def test_iso_timestamps_read_the_same_on_python_310(text, py310):
    # Python 3.10's fromisoformat (a ZeroGPU Space) reads only isoformat()'s own output: the rewrite
    # must give that, and mean the same instant as 3.11's reading of the original.
    from datetime import datetime
    assert _iso_for_py310(text) == py310
    assert datetime.fromisoformat(py310) == datetime.fromisoformat(text)


def test_reorder_window_is_bounded_and_counts_late_records():
    order = LogOrder(window=2)
    lines = [json.dumps({"prompt": str(t), "timestamp": t}) for t in (5, 6, 7, 8, 1)]
    got = [r.prompt for r in read_log(lines, order=order)]
    assert got == ["5", "6", "1", "7", "8"] and order.late == 1 and order.timed
