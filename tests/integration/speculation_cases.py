"""What the speculative-decoding tests share: prompts, the request variants each method must decode
as plain decoding does, the servers whose drafts come from a quantized copy of the model, greedy and
concurrent runs with and without speculation, and a chi-square test of two samples of tokens."""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import pathlib
import statistics

import pytest

from kvserve_server import REPO, Server, raw
from kvserve_server import choice_ids as tokens, complete_ids as complete, with_and_without_speculation as both

DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
GGUF = DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURES = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", REPO / ".fixtures"))
HEADWISE = "  snap_ada:\n    method: snapkv\n    budget: 48\n    window: 8\n    head_budgets: adaptive\n"

# A model and its quantized copy: the tiny model at int8, the default model with its own Q4_1 GGUF,
# Gemma 3 (sliding-window layers) at int4.
COPY_DRAFTS = ["tiny-int8", "default-gguf", "gemma3-int4"]


def copy_draft_server(param: str, spec_yaml) -> Server:
    """A server for one of COPY_DRAFTS, with the head-wise policy snap_ada and spec_yaml(**the copy's
    fields) as its speculative_config; skips when the model is not made."""
    model, fields = {
        "tiny-int8": (None, {"quantization": "int8"}),
        "default-gguf": (DEFAULT_MODEL, {"model": str(GGUF)}),
        "gemma3-int4": (FIXTURES / "gemma3", {"quantization": "int4"}),
    }[param]
    if model is not None and not (model / "config.json").exists():
        pytest.skip(f"{model} is not made")
    if "model" in fields and not pathlib.Path(fields["model"]).exists():
        pytest.skip(f"{fields['model']} is not made")
    s = Server(extra_yaml=HEADWISE + spec_yaml(**fields), model=str(model) if model else None, kv_cache_bytes="256MiB")
    s.param = param
    return s


def counts(srv) -> tuple[float, float]:
    """Draft tokens proposed and accepted so far (the server's counters)."""
    m = srv.metrics()
    return m["vllm:spec_decode_num_draft_tokens_total"], m["vllm:spec_decode_num_accepted_tokens_total"]


def greedy_runs_match(srv, prompts, max_tokens: int = 40) -> tuple[float, float]:
    """Each prompt greedy with and without speculation: the same tokens and texts. Returns the draft
    tokens proposed and accepted meanwhile (some proposed)."""
    before = counts(srv)
    for p in prompts:
        a, b = both(srv, {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert tokens(a) == tokens(b), p[:40]
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
    drafted, accepted = (x - y for x, y in zip(counts(srv), before))
    assert drafted > 0 and 0 <= accepted <= drafted
    return drafted, accepted


PASSAGE = ("The river runs past the old mill, under the stone bridge, and into the lake. "
           "Children play on the bridge in summer and skate on the lake in winter. ")
COPY = "Repeat the passage exactly.\n" + PASSAGE * 3 + "\n" + PASSAGE[:40]

STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could see "
         "the fishing boats returning, the gulls circling the harbour, and the storm clouds gathering far "
         "out over the grey sea. One night the lamp would not light, and he had to decide what to do. ")

# Sampling, logprobs, stop strings, max_tokens, penalties, policies (per layer and head-wise) and a
# grammar: each request must give plain decoding's tokens under speculation.
SAME_TOKEN_CASES = [
    {"temperature": 0.9, "seed": 11},
    {"temperature": 1.0, "seed": 100, "n": 6, "max_tokens": 24},
    {"temperature": 0, "logprobs": 2},
    {"temperature": 0, "stop": ["the"]},
    {"temperature": 0, "max_tokens": 5},
    {"temperature": 0, "repetition_penalty": 1.2},
    {"temperature": 0, "kv_policy": "snapkv"},
    {"temperature": 0, "kv_policy": "pyramidkv"},
    {"temperature": 0, "kv_policy": "snap_ada"},
    {"temperature": 0, "guided_regex": "[a-z ]{4,40}\\."},
]


def conversation_speculates_as_plainly(srv, param: str) -> None:
    """prefix_reuse: compressed: a turn's compressed (snapkv) KV is parked and the next turn continues
    from it. Both turns speculate (the second one's drafts are counted apart). A stop string ends the
    first turn, on the default model inside a run of accepted drafts: the K/V of the drafts past it
    must go before the KV is parked, so that the second turn reads the tokens its conversation was
    filed under, as plain decoding's second turn does."""
    status, _, data = raw(srv, "POST", "/tokenize", json.dumps({"prompt": COPY}))
    assert status == 200, data
    prompt = json.loads(data)["tokens"]
    complete(srv, {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_policy": "snapkv", "speculative": False})

    def conversation(spec: bool) -> tuple[list, str, list, float, float]:
        common = {"kv_policy": "snapkv", "prefix_reuse": "compressed", "temperature": 0, "speculative": spec}
        accepted = srv.metrics()["vllm:spec_decode_num_accepted_tokens_total"]
        first = complete(srv, {"prompt": prompt, "max_tokens": 40, "stop": ["bridge"], **common})
        ids = first["choices"][0]["token_ids"]
        drafted = srv.metrics()["vllm:spec_decode_num_draft_tokens_total"]
        second = complete(srv, {"prompt": prompt + ids + prompt[-12:], "max_tokens": 24, **common})
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(prompt) + len(ids) - 1, (spec, cached, len(prompt), len(ids))
        m = srv.metrics()
        assert m["kvserve:conversations_parked"] >= 1
        return (ids, first["choices"][0]["finish_reason"], second["choices"][0]["token_ids"],
                m["vllm:spec_decode_num_accepted_tokens_total"] - accepted,
                m["vllm:spec_decode_num_draft_tokens_total"] - drafted)

    fast, slow = conversation(True), conversation(False)
    assert fast[:3] == slow[:3]
    assert slow[3:] == (0, 0)
    assert fast[4] > 0, "the resumed turn was meant to draft"
    if param == "default":  # the default model copies the passage: drafts accepted, the stop inside a run
        assert fast[1] == "stop" and fast[3] > 0, fast


def drop_parted_stream(a: dict, b: dict, body: dict) -> None:
    """Where a sampled request of six or more streams ran twice (a, b), the stream that parted, if one
    did, leaves both responses' choices; two that part fail. Both runs queue their choices together
    and continue the prompt from the same cached blocks (with_and_without_speculation), and in measured
    runs no stream parts and every logprob is equal to the bit (also 45 runs of sixteen streams on
    a loaded machine). One is still allowed: at temperature 1 a last-bit difference in a prompt's
    prefill can move a draw across the boundary between two candidates. (A run under a concurrent
    build once failed for a cause not seen; a request outlasting raw()'s old 30 s timeout is the
    likely one.) A wrong use of the random streams (a draw taken twice or skipped) parts most of them."""
    if body.get("temperature", 1.0) == 0 or body.get("n", 1) < 6:
        return
    ta, tb = tokens(a), tokens(b)
    assert len(ta) == len(tb)
    apart = [(k, next((j for j, (x, y) in enumerate(zip(ta[k], tb[k])) if x != y), min(len(ta[k]), len(tb[k]))))
             for k in range(len(ta)) if ta[k] != tb[k]]
    assert len(apart) <= 1, (body, "streams parted at (stream, position)", apart)
    parted = {k for k, _ in apart}
    for r in (a, b):
        r["choices"] = [c for k, c in enumerate(r["choices"]) if k not in parted]


def assert_same_as_plain(srv, prompt: str, extra: dict) -> None:
    """The request with and without speculation: the same tokens, texts and finish reasons (and
    logprobs within 1e-4)."""
    a, b = both(srv, {"prompt": prompt, "max_tokens": 32, **extra})
    drop_parted_stream(a, b, extra)
    assert tokens(a) == tokens(b), extra
    for ca, cb in zip(a["choices"], b["choices"]):
        assert ca["text"] == cb["text"] and ca["finish_reason"] == cb["finish_reason"]
        if "logprobs" in extra:
            assert ca["logprobs"]["token_logprobs"] == pytest.approx(cb["logprobs"]["token_logprobs"], abs=1e-4)


def concurrent_rounds(srv, n: int, max_tokens: int) -> dict:
    """concurrent_runs until the pool has preempted (at most three rounds: whether requests overlap
    enough depends on when they arrive, and a loaded machine may spread them), each round's outputs
    equal with and without speculation. Returns the server's metrics after the last round."""
    for _ in range(3):
        fast, slow = concurrent_runs(srv, n, max_tokens)
        assert fast == slow
        m = srv.wait_idle()
        if m["kvserve:num_preemptions_total"] > 0:
            break
    return m


def concurrent_runs(srv, n: int, max_tokens: int) -> tuple[list, list]:
    """n prompts of growing length sent together, speculating, then together without: each run's
    greedy token ids."""
    prompts = [f"{i}: " + (STORY * 3)[: 400 + 80 * i] for i in range(n)]

    def run(i_spec):
        i, spec = i_spec
        return tokens(complete(srv, {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                                     "ignore_eos": True, "speculative": spec}))

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        fast = list(pool.map(run, [(i, True) for i in range(n)]))
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        slow = list(pool.map(run, [(i, False) for i in range(n)]))
    return fast, slow


def homogeneity(a: list, b: list) -> tuple[float, int]:
    """Pearson's chi-square of two samples of categories (rare categories pooled) and its degrees of freedom."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    cats, rare = [], (0, 0)
    for k in set(ca) | set(cb):
        if ca[k] + cb[k] < 10:
            rare = (rare[0] + ca[k], rare[1] + cb[k])
        else:
            cats.append((ca[k], cb[k]))
    if sum(rare):
        cats.append(rare)
    na, nb = len(a), len(b)
    stat = 0.0
    for oa, ob in cats:
        t = oa + ob
        ea, eb = t * na / (na + nb), t * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, len(cats) - 1


def chi2_critical(df: int, alpha: float) -> float:
    """The chi-square quantile at 1 - alpha (Wilson-Hilferty)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
