"""Admission on queue time (issue 50): with `scheduler.max_queue_time_s`, a burst of long prompts larger
than the server prefills in that time is answered, never timed out: each request gets its 200 or a
503 with Retry-After naming the limit (refused at once once the engine has measured its prefill
rate, or failed after waiting that long without starting), and the server ends with nothing running
and no block held."""
from __future__ import annotations

import concurrent.futures
import json
import random

from kvserve_server import Server, raw

LONG = 3000


def complete(srv, seed: int) -> tuple[int, dict, dict]:
    rng = random.Random(seed)
    body = {"model": "tiny", "prompt": [rng.randrange(3, 2000) for _ in range(LONG)], "max_tokens": 2}
    status, headers, data = raw(srv, "POST", "/v1/completions", json.dumps(body))
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(data)


def test_burst_beyond_max_queue_time_gets_503_with_retry_after():
    srv = Server(server_yaml="  retry_after_s: 2\n", extra_yaml="", kv_cache_bytes="256MiB",
                 extra_args=("--max-queue-time-s", "0.3", "--max-num-seqs", "2"))
    try:
        key = 'kvserve:http_responses_total{model_name="tiny",status="503"}'
        before = srv.metrics().get(key, 0)  # /health answers 503 while the model loads
        results = []
        for burst in range(2):  # the second burst may meet a queue already over half the limit
            with concurrent.futures.ThreadPoolExecutor(24) as pool:
                results += list(pool.map(lambda i: complete(srv, 100 * burst + i), range(24)))
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
        for status, headers, body in results:
            if status == 503:
                assert headers["retry-after"] == "2"
                assert "max_queue_time_s" in body["error"]["message"], body
            else:
                assert body["usage"]["completion_tokens"] == 2
        m = srv.wait_idle()  # cached prompt blocks count as free
        assert m[key] - before == statuses.count(503)
    finally:
        srv.close()
