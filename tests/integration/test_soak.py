"""The soak (tools/soak.py, `make soak` runs 10,000 requests) in a short version: 1,000 requests of
the same mix against a real server: every response correct or the intended error, no 5xx, every
KV block back after 20 % disconnecting clients and cancelled streams, RSS flat after the warm-up,
a clean SIGTERM."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from kvserve_server import REPO, kvserve_bin


def test_short_soak(tmp_path: pathlib.Path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "soak.py"), "--kvserve", kvserve_bin(),
                           "--requests", "1000", "--concurrency", "16", "--seed", "7", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["problems"] == [] and s["failures"] == []
    assert s["client_5xx"] == 0 and s["server_5xx"] == 0
    # Nothing held but what parked conversations (prefix_reuse: compressed) keep for a next turn.
    assert s["kv_blocks_used_at_end"] == s["kv_blocks_parked_at_end"]
    assert s["running_at_end"] == 0 and s["waiting_at_end"] == 0
    # The mix really happened: disconnects at every point, cancels, malformed bodies, greedy repeats.
    kinds = s["kinds"]
    assert all(kinds.get(k, 0) > 0 for k in ("disconnect_sending", "disconnect_sent", "disconnect_reading", "cancel",
                                             "malformed", "generate", "route", "conversation_turn")), kinds
    assert s["greedy_repeats_checked"] > 50
    assert s["aborted_requests"] > 0
    assert all(kinds.get(k, 0) > 0 for k in ("structured_schema", "structured_required", "structured_named")), kinds


def test_short_soak_at_twice_the_admitted_capacity(tmp_path: pathlib.Path):
    """--overload: 16 clients against 4 running + 4 waiting and a 0.1 s queue time: every request is
    answered as in the soak above or refused with 429 / 503 and Retry-After, and nothing is held at
    the end."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "soak.py"), "--kvserve", kvserve_bin(),
                           "--requests", "1000", "--concurrency", "16", "--seed", "11", "--overload", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["problems"] == [] and s["failures"] == []
    assert s["client_5xx"] == 0 and s["server_5xx"] == 0  # 503s with Retry-After are refusals
    assert sum(s["refused"].values()) > 0, s["statuses"]
    assert s["kv_blocks_used_at_end"] == s["kv_blocks_parked_at_end"]
    assert s["running_at_end"] == 0 and s["waiting_at_end"] == 0
    kinds = s["kinds"]
    assert all(kinds.get(k, 0) > 0 for k in ("structured_schema", "structured_required", "structured_named")), kinds
    assert s["admitted_stream_ttft_s"]["n"] > 0
