"""The miss explainer finds where a request left the cached path, and why."""

from __future__ import annotations

import pytest

from analysis.lab.miss_explainer import common_prefix_len, explain_miss


def dec(ids) -> str:
    return " ".join(str(i) for i in ids)


STATIC = list(range(1000, 1200))  # 200 tokens of static text


def test_planted_per_request_value_found_at_the_right_token():
    a = [1, 2, 3] + [500, 501] + STATIC  # value at tokens 3-4, static text after it
    b = [1, 2, 3] + [600, 601] + STATIC
    ex = explain_miss(b, [a], dec)
    assert ex.position == 3 and ex.cached_tokens == 3
    assert ex.kind == "per-request-value"
    assert ex.changed_text == "600 601" and ex.cached_changed_text == "500 501"
    assert ex.recomputed_identical_tokens == len(STATIC)
    assert ex.before_text == "1 2 3" and ex.after_text.startswith("600 601")


@pytest.mark.parametrize("where", [0, 1, 57, 150])
def test_divergence_position_is_exact(where):
    ref = STATIC + [7] * 10
    req = list(ref)
    req[where] = 99
    ex = explain_miss(req, [ref], dec)
    assert ex.position == where == common_prefix_len(req, ref)


def test_reference_with_longest_prefix_is_used():
    refs = [[1, 2, 9, 9], [1, 2, 3, 4, 5, 6, 70, 71], [8]]
    ex = explain_miss([1, 2, 3, 4, 5, 6, 7, 8, 9], refs, dec)
    assert ex.reference_index == 1 and ex.position == 6


def test_reordered_blocks():
    x, y, z = list(range(100, 130)), list(range(200, 230)), list(range(300, 330))
    ex = explain_miss([1] + y + x + z + [5], [[1] + x + y + z + [4]], dec)
    assert ex.position == 1 and ex.kind == "reordered"


def test_cold_full_hit_new_content_and_evicted():
    assert explain_miss([1, 2, 3], [], dec).kind == "cold"
    assert explain_miss([1, 2, 3, 4], [[1, 2, 3, 4, 5]], dec).kind == "full-hit"
    ex = explain_miss(STATIC + [1, 2, 3], [STATIC + [9]], dec)
    assert ex.kind == "new-content" and ex.position == len(STATIC)
    ex = explain_miss(STATIC[:50] + list(range(5000, 5200)), [STATIC[:50] + list(range(6000, 6200))], dec)
    assert ex.kind == "rewritten"
    ex = explain_miss(STATIC + [1], [STATIC + [2]], dec, cached_tokens=10)
    assert ex.kind == "evicted" and ex.position == 10


def test_whitespace_and_template_on_real_tokens(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tokenizer.decode(list(ids))  # noqa: E731
    body = "Answer the customer politely and cite the policy number. " * 6
    ex = explain_miss(enc("Rules:\n\n" + body), [enc("Rules:\n \n" + body)], decode)
    assert ex.kind == "whitespace"
    assert ex.position == common_prefix_len(enc("Rules:\n\n" + body), enc("Rules:\n \n" + body))


def test_timestamp_on_real_tokens(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tokenizer.decode(list(ids))  # noqa: E731
    policy = "You are a helpful airline assistant. Follow the baggage rules strictly. " * 8
    a = enc(f"Time: 09:12:05. {policy}")
    b = enc(f"Time: 09:47:31. {policy}")
    ex = explain_miss(b, [a], decode)
    assert ex.position == common_prefix_len(a, b)
    assert ex.kind == "per-request-value"
    assert "47" in ex.changed_text and "12" in ex.cached_changed_text
