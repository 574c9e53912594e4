"""What the speculative-decoding tests share: prompts, the request variants each method must decode
as plain decoding does, a concurrent run with and without speculation, and a chi-square test of
two samples of tokens."""
from __future__ import annotations

import collections
import concurrent.futures
import statistics

import pytest

from kvserve_server import choice_ids as tokens, complete_ids as complete, with_and_without_speculation as both

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


def assert_same_as_plain(srv, prompt: str, extra: dict) -> None:
    """The request with and without speculation: the same tokens, texts and finish reasons (and
    logprobs within 1e-4)."""
    a, b = both(srv, {"prompt": prompt, "max_tokens": 32, **extra})
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
