"""Hostile input against the Serve application on a local Ray cluster, real HTTP.

App "hostile" (one LLMReplica, the default body limit): text that is not Unicode, bodies that are
not JSON, and the error bodies clients see, none of which may stall or break the server or tell
anything about the cluster.
"""

from __future__ import annotations

import json

import httpx
import pytest
from ray import serve

from cluster.app import build_app
from tests.serve_cluster import serve_on_local_cluster

MAX_MODEL_LEN = 2048
HOSTILE = {"model": "tiny", "device": "cpu", "num_replicas": 1,
           "engine": {"kv_cache_tokens": 8192, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 32}}
TIMEOUT = httpx.Timeout(300.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def url():
    # the dashboard serves ray.util.state, which tells each replica's pid
    with serve_on_local_cluster(num_nodes=1, include_dashboard=True) as base:
        serve.run(build_app(HOSTILE), name="hostile", route_prefix="/hostile")
        yield f"{base}/hostile"


def _body(path: str, text: str) -> dict:
    """A request of `path` whose prompt (or user message) is text."""
    if path == "/v1/completions":
        return {"prompt": text, "max_tokens": 2}
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}


def _post(url: str, path: str, content: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {} if content_type is None else {"Content-Type": content_type}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=TIMEOUT)


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


@pytest.mark.parametrize("path", ENDPOINTS)
def test_text_that_is_not_unicode_is_a_400(url, path):
    # a lone surrogate escape (json.dumps writes "a\ud800b" so): once a 500, TypeError from the tokenizer
    error = _openai_error(_post(url, path, json.dumps(_body(path, "a\ud800b")).encode()), 400)
    assert error["code"] == "invalid_unicode" and error["type"] == "invalid_request_error"
    assert error["param"] == ("prompt" if path == "/v1/completions" else "messages"), error
    # ... in a content part, and in a key
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}
    assert _openai_error(_post(url, path, json.dumps(chat).encode()), 400)["code"] == "invalid_unicode"
    assert _openai_error(_post(url, path, b'{"\\ud800": 1, "prompt": "x"}'), 400)["code"] == "invalid_unicode"
    # bytes that are not UTF-8: a stray byte, a truncated sequence, an encoded surrogate, Latin-1
    good = json.dumps(_body(path, "Hello")).encode()
    for bad in (b"\xff", b"\xe2\x82", b"\xed\xa0\x80", "é".encode("latin-1")):
        error = _openai_error(_post(url, path, good.replace(b"Hello", b"He" + bad + b"llo")), 400)
        assert error["code"] == "invalid_utf8", (bad, error)
    # a surrogate pair is one character: served
    r = _post(url, path, json.dumps(_body(path, "a\U0001F600b")).encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ENDPOINTS)
def test_bodies_not_declared_json_are_refused(url, path):
    body = json.dumps(_body(path, "Hello")).encode()
    for content_type in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/xml"):
        error = _openai_error(_post(url, path, body, content_type), 415)
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"], error
    for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json", None):
        r = _post(url, path, body, content_type)
        assert r.status_code == 200, (content_type, r.text)

