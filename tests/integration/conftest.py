"""Fixtures for the integration tests: real `kvserve serve` processes (see kvserve_server.py)."""
from __future__ import annotations

import pytest

from kvserve_server import Server


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    rc = s.stop()
    log = s.log()
    s.tmp.cleanup()
    assert rc == 0, f"kvserve exited with {rc} on SIGTERM:\n{log[-4000:]}"


@pytest.fixture(scope="module")
def strict_server():
    """API key required; one sequence at a time and a one-slot queue, so it overloads quickly."""
    s = Server(api_key="sekret", extra_yaml="scheduler:\n  max_num_seqs: 1\n  max_waiting: 1\n")
    yield s
    s.close()
