"""Rollout rules end to end: the rule and policy in every response, per-rule metrics, and hot reload
(SIGHUP) under a continuously streaming client: no failed or truncated request, the new rule applies
to requests that start after the reload, an invalid file leaves the old config in force."""
from __future__ import annotations

import pathlib
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from kvserve_server import Server

ROLLOUT_A = """rollout:
  default: full
  allow_override: [snapkv]
  rules:
    - name: tenant-beta
      match: {headers: {x-tenant: beta}}
      policy: pyramidkv
    - name: stage
      policy: full
      canary: {policy: snapkv, percent: 0, sticky_by: user}
"""

ROLLOUT_B = ROLLOUT_A.replace("percent: 0,", "percent: 100,")

INVALID = ROLLOUT_A.replace("percent: 0,", "percent: 250,")


@pytest.fixture(scope="module")
def rserver():
    s = Server(extra_yaml=ROLLOUT_A)
    s.config_path = pathlib.Path(s.tmp.name) / "config.yaml"
    yield s
    s.close()


def client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def rewrite(s: Server, old: str, new: str) -> None:
    text = s.config_path.read_text()
    assert old in text
    s.config_path.write_text(text.replace(old, new))
    s.proc.send_signal(signal.SIGHUP)


def wait_for_log(s: Server, pattern: str, count: int, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(re.findall(pattern, s.log())) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {count}x {pattern!r} in log:\n{s.log()[-3000:]}")


def completion(s: Server, **kw):
    return client(s).completions.with_raw_response.create(model="tiny", prompt="Hello there", max_tokens=2,
                                                          temperature=0, **kw)


def test_rules_headers_usage_and_override(rserver):
    raw = completion(rserver, extra_headers={"X-Tenant": "beta"})
    assert raw.headers["x-kv-policy"] == "pyramidkv"
    assert raw.headers["x-kv-rollout-rule"] == "tenant-beta"
    body = raw.parse()
    assert body.usage.kv_policy == "pyramidkv" and body.usage.kv_rollout_rule == "tenant-beta"
    raw = completion(rserver, user="u1")
    assert (raw.headers["x-kv-policy"], raw.headers["x-kv-rollout-rule"]) == ("full", "stage")
    raw = completion(rserver, extra_body={"kv_policy": "snapkv"})
    assert (raw.headers["x-kv-policy"], raw.headers["x-kv-rollout-rule"]) == ("snapkv", "override")
    with pytest.raises(openai.BadRequestError) as e:
        completion(rserver, extra_body={"kv_policy": "pyramidkv"})
    assert "allow_override" in str(e.value)
    text = httpx.get(rserver.url + "/metrics").text
    assert re.search(r'kvserve:rollout_requests_total\{[^}]*rule="tenant-beta",policy="pyramidkv"\} [1-9]', text)
    assert re.search(r'kvserve:kv_policy_time_to_first_token_seconds_count\{[^}]*policy="pyramidkv"\} [1-9]', text)
    assert "kvserve:config_last_reload_success" in text


def test_hot_reload_under_streaming_load(rserver):
    stop = threading.Event()
    results: list[tuple[str, str, int, bool]] = []  # (phase-at-start, policy, tokens, finished)
    errors: list[str] = []
    phase = ["A"]

    def streamer(user: str) -> None:
        c = client(rserver)
        while not stop.is_set():
            started_in = phase[0]
            try:
                with c.chat.completions.with_streaming_response.create(
                        model="tiny", messages=[{"role": "user", "content": "Count to ten"}], max_tokens=12,
                        temperature=0, stream=True, user=user, stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True}) as raw:
                    policy = raw.headers["x-kv-policy"]
                    finish, usage = None, None
                    for chunk in raw.parse():
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                        if chunk.usage:
                            usage = chunk.usage
                    ok = finish == "length" and usage is not None and usage.completion_tokens == 12
                    results.append((started_in, policy, usage.completion_tokens if usage else -1, ok))
            except Exception as ex:  # noqa: BLE001
                errors.append(repr(ex))

    threads = [threading.Thread(target=streamer, args=(f"user-{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        # Invalid: the old config stays.
        before = rserver.log().count("config reload failed")
        rewrite(rserver, "percent: 0,", "percent: 250,")
        wait_for_log(rserver, "config reload failed", before + 1)
        m = rserver.metrics()
        assert m["kvserve:config_reload_failures_total"] >= 1
        assert m["kvserve:config_last_reload_success"] == 0
        time.sleep(1.5)
        # Valid: 100% canary -> snapkv for requests that start after.
        ok_before = rserver.log().count("config reloaded")
        phase[0] = "T"  # started between the rewrite and seeing the log line: either arm is right
        rewrite(rserver, "percent: 250,", "percent: 100,")
        wait_for_log(rserver, "config reloaded", ok_before + 1)
        phase[0] = "B"
        time.sleep(2.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors[:3]
    assert all(ok for _, _, _, ok in results), [r for r in results if not r[3]][:3]
    a = [p for ph, p, _, _ in results if ph == "A"]
    b = [p for ph, p, _, _ in results if ph == "B"]
    assert a and b, results
    assert set(b) == {"snapkv"}, b
    # Before the valid reload (including while the invalid file was in place) only the base arm ran.
    assert a.count("full") >= len(a) - 3  # one per streamer may be admitted only after the reload
    assert rserver.metrics()["kvserve:config_last_reload_success"] == 1


def test_reload_on_file_change_without_signal(rserver):
    before = len(re.findall(r"file change: config reloaded", rserver.log()))
    text = rserver.config_path.read_text()
    time.sleep(1.1)  # a distinct mtime even on coarse-grained file systems
    rserver.config_path.write_text(text.replace("policy: pyramidkv\n", "policy: snapkv\n", 1))
    wait_for_log(rserver, r"file change: config reloaded", before + 1)
    raw = completion(rserver, extra_headers={"X-Tenant": "beta"})
    assert (raw.headers["x-kv-policy"], raw.headers["x-kv-rollout-rule"]) == ("snapkv", "tenant-beta")


def test_restart_only_changes_are_logged_not_applied(rserver):
    before = rserver.log().count("need a restart")
    rewrite(rserver, "kv_cache_bytes: 64MiB", "kv_cache_bytes: 32MiB")
    wait_for_log(rserver, "need a restart", before + 1)
    assert completion(rserver).parse().choices[0].finish_reason in ("stop", "length")


def test_named_api_keys_authenticate_and_match_rules():
    s = Server(server_yaml="  api_keys: {team-a: key-a, team-b: key-b}\n",
               extra_yaml="rollout:\n  rules:\n    - name: team-a\n      match: {api_key: team-a}\n      policy: pyramidkv\n")
    try:
        def call(key):
            c = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)
            return c.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=1)
        raw = call("key-a")
        assert (raw.headers["x-kv-policy"], raw.headers["x-kv-rollout-rule"]) == ("pyramidkv", "team-a")
        raw = call("key-b")
        assert (raw.headers["x-kv-policy"], raw.headers["x-kv-rollout-rule"]) == ("full", "default")
        with pytest.raises(openai.AuthenticationError):
            call("wrong")
    finally:
        s.close()


def test_one_edit_plus_sighup_is_one_reload(rserver):
    """Saving the file and sending SIGHUP fire both triggers (the watcher polls the mtime every
    second); the second sees the content it already loaded and is neither reloaded nor counted."""
    time.sleep(1.5)  # a distinct mtime even on coarse-grained file systems; earlier edits seen
    m0 = rserver.metrics()
    ok_before = rserver.log().count("config reloaded")
    skipped_before = rserver.log().count("unchanged since it was last loaded")
    rserver.config_path.write_text(rserver.config_path.read_text() + "# edited once\n")
    rserver.proc.send_signal(signal.SIGHUP)
    wait_for_log(rserver, "config reloaded", ok_before + 1)
    time.sleep(2.5)  # the watcher's poll sees the new mtime too
    m1 = rserver.metrics()
    assert m1["kvserve:config_reloads_total"] - m0["kvserve:config_reloads_total"] == 1
    assert m1["kvserve:config_reload_failures_total"] == m0["kvserve:config_reload_failures_total"]
    log = rserver.log()
    assert log.count("config reloaded") == ok_before + 1
    assert log.count("unchanged since it was last loaded") == skipped_before + 1
