"""chunkserve/cluster/tenants.py on its own: the tenant table's checks, keys -> tenants, cache salts
by policy, rate limits; and salts through the router's index, fed a real engine's digest."""

from __future__ import annotations

import hashlib
import time

import pytest
from pydantic import ValidationError

from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.tenants import DEFAULT, RateLimited, Tenants, Unauthorized, cache_salt
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.engine.sequence import Tenancy
from chunkserve.router.hashing import cache_seed, chunk_hashes
from chunkserve.router.index import PrefixIndex

TABLE = [
    {"name": "acme", "api_keys": ["key-acme"], "cache": "private"},
    {"name": "globex", "api_key_sha256": [hashlib.sha256(b"key-globex").hexdigest()], "cache": "group:partners"},
    {"name": "initech", "api_keys": ["key-initech"], "cache": "group:partners", "priority": 1},
    {"name": "hooli", "api_keys": ["key-hooli"], "cache": "shared", "requests_per_minute": 120},
    {"name": "umbrella", "api_keys": ["key-umbrella"], "tokens_per_minute": 600},
]


def tenants(**args) -> Tenants:
    return Tenants(AppConfig.model_validate({"tenants": TABLE, **args}))


def test_keys_name_tenants_and_bad_keys_are_refused():
    t = tenants(api_key="key-default")
    assert t.authorize("Bearer key-acme").name == "acme"
    assert t.authorize("bearer  key-globex ").name == "globex"  # by its hash; scheme in any case
    assert t.authorize("Bearer key-default") is DEFAULT
    for header in (None, "", "Bearer", "Bearer ", "Basic key-acme", "Bearer key-nobody", "key-acme"):
        with pytest.raises(Unauthorized):
            t.authorize(header)
    # no key and no table: every request is the default tenant's, as before tenants existed
    assert Tenants(AppConfig()).authorize(None) is DEFAULT


@pytest.mark.parametrize(
    "table, match",
    [
        ([{"name": "a"}], "needs a key"),
        ([{"name": "a", "api_keys": ["k"], "cache": "public"}], "cache"),
        ([{"name": "a", "api_key_sha256": ["ABC"]}], "64 lowercase hex"),
        ([{"name": "default", "api_keys": ["k"]}], "api_key's"),
        ([{"name": "a b", "api_keys": ["k"]}], "name"),
        ([{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}], "names must differ"),
        ([{"name": "a", "api_keys": ["k"], "requests_per_minute": 0}], "requests_per_minute"),
        ([{"name": "a", "api_keys": ["k"], "quota": 3}], "quota"),
    ],
)
def test_the_table_is_checked_naming_what_is_wrong(table, match):
    with pytest.raises(ValidationError, match=match):
        AppConfig.model_validate({"tenants": table})


def test_one_key_for_two_tenants_is_refused():
    table = [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_key_sha256": [hashlib.sha256(b"k").hexdigest()]}]
    with pytest.raises(ValueError, match="also 'a'"):
        Tenants(AppConfig.model_validate({"tenants": table}))
    with pytest.raises(ValueError, match="not set"):
        Tenants(AppConfig.model_validate({"tenants": [{"name": "a", "api_key_env": "CHUNKSERVE_NO_SUCH_VARIABLE"}]}))


def test_salts_follow_the_cache_policy_and_the_requests_salt():
    t = tenants()
    acme, globex, initech, hooli, umbrella = (t.authorize(f"Bearer key-{n}") for n in [x["name"] for x in TABLE])
    assert cache_salt(hooli, None) is None and cache_salt(DEFAULT, None) is None  # shared: today's cache
    assert cache_salt(globex, None) == cache_salt(initech, None) != cache_salt(acme, None)  # a group shares
    salts = {
        cache_salt(tenant, s) for tenant in (acme, globex, hooli, umbrella) for s in (None, "x", "y", '"x"', "null")
    }
    assert len(salts) == 4 * 5  # every (namespace, salt) its own
    assert cache_salt(hooli, "x") == cache_salt(DEFAULT, "x")  # shared tenants salting alike share again
    assert initech.priority == 1 and acme.priority == 0


def test_rate_limits_refuse_with_the_time_to_wait_and_refill():
    t = tenants()
    hooli, umbrella, acme = (t.authorize(f"Bearer key-{n}") for n in ("hooli", "umbrella", "acme"))
    for _ in range(20):  # 10 s worth at once (a bucket holds BURST_S)
        t.admit(hooli)
    with pytest.raises(RateLimited, match="120 requests per minute") as e:
        t.admit(hooli)
    assert 0 < e.value.retry_after_s <= 0.5 + 1e-6  # one request at 2 a second
    for _ in range(1000):
        t.admit(acme)  # no limits
    t.admit(umbrella)
    t.charge(umbrella, 900)  # tokens: the prompt when sent, the completion when done: into debt
    with pytest.raises(RateLimited, match="600 tokens per minute") as e:
        t.admit(umbrella)
    assert 79 < e.value.retry_after_s <= 80 + 1e-6  # 100 held less 900: 800 in debt, at 10 a second
    bucket = t._buckets["umbrella", "tokens"]
    bucket.at -= 81  # 81 s later
    t.admit(umbrella)


def test_limits_are_shared_out_over_the_ingress_replicas():
    t = tenants(ingress={"num_replicas": 4})
    hooli = t.authorize("Bearer key-hooli")
    for _ in range(5):  # a quarter of 10 s worth
        t.admit(hooli)
    with pytest.raises(RateLimited):
        t.admit(hooli)


def test_counts_by_tenant():
    t = tenants()
    t.counts.served("acme", 100, 64, 7)
    t.counts.served("acme", 50, 0, 3)
    t.counts.reject("hooli", "rate_limit_exceeded")
    snap = t.counts.snapshot()
    assert snap["totals"] == [["acme", 2, 150, 64, 10]]
    assert snap["rejected"] == [["hooli", "rate_limit_exceeded", 1]]


def test_the_routers_index_sees_a_salted_prefix_only_under_its_salt():
    # a replica's engine holds one prompt under tenant acme's salt; its digest, as the router
    # gets it, matches the chain the ingress hashes for acme's request and nothing of another
    # tenant's (or an unsalted) request for the same tokens
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=2048, chunk_size=16)
    t = tenants()
    acme, globex = t.authorize("Bearer key-acme"), t.authorize("Bearer key-globex")
    prompt = list(range(3, 200))
    salt = cache_salt(acme, None)
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0), Tenancy("acme", salt))
    while engine.has_unfinished():
        engine.step()
    index = PrefixIndex()
    index.replace_digest("r0", engine.cache_digest("tiny", 32), time.monotonic())

    def chain(tenant, request_salt=None) -> tuple[int, ...]:
        return tuple(chunk_hashes(prompt, 16, 32, cache_seed("tiny", cache_salt(tenant, request_salt))))

    assert index.depth("r0", chain(acme)) == len(prompt) // 16
    assert index.depth("r0", chain(globex)) == 0
    assert index.depth("r0", chain(DEFAULT)) == 0
    assert index.depth("r0", chain(acme, "another")) == 0


def test_the_readmes_tenant_table_is_a_valid_config():
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text[text.index("## Tenants") :], re.S).group(1)
    config = AppConfig.model_validate(yaml.safe_load(block)["args"])
    assert [t.name for t in config.tenants] == ["acme", "globex"]
    assert config.tenants[1].cache == "group:partners"


def test_session_keys_are_per_tenant():
    from chunkserve.cluster.tenants import session_key

    t = tenants()
    acme, hooli = t.authorize("Bearer key-acme"), t.authorize("Bearer key-hooli")
    assert session_key(acme, None) is None and session_key(acme, "") is None
    assert session_key(acme, "s1") == session_key(acme, "s1") != session_key(acme, "s2")
    assert session_key(acme, "s1") != session_key(hooli, "s1")  # two tenants' equal ids: two sessions


def test_concurrent_requests_cannot_all_pass_before_the_first_is_charged():
    # prompts are charged as they are sent, checked and taken at once: of 200 requests of 4000
    # tokens admitted together, those past the tenant's 10 s of tokens are refused as they are sent
    t = Tenants(AppConfig.model_validate({"tenants": [{"name": "a", "api_keys": ["k"], "tokens_per_minute": 60000}]}))
    a = t.authorize("Bearer k")
    for _ in range(200):
        t.admit(a)  # (no request limit; the tokens not spent yet)
    sent = 0
    for _ in range(200):
        try:
            t.take_prompt(a, 4000)
            sent += 1
        except RateLimited:
            pass
    assert sent == 3  # 10,000 tokens held: 3 prompts of 4000 take it into debt, then none
