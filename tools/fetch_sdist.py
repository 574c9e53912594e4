#!/usr/bin/env python3
"""Fetch one pinned source distribution from the package index pip is configured with, and check
its sha256 before it is kept.

Why not `pip download --no-binary`: pip then builds the package's metadata, which for a
scikit-build-core package means its build backend and CMake, minutes of work the project never
uses (it compiles the C++ core itself). This asks the same index (pip's `index-url`, else pip's
default) through its simple JSON API for the file by name, version and hash.

    tools/fetch_sdist.py NAME VERSION SHA256 DEST_FILE
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request


def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                           capture_output=True, text=True)
        url = r.stdout.strip() if r.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI  # pip's own default index
        url = PyPI.simple_url
    return url.rstrip("/")


def main() -> int:
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    name, version, sha256, dest = sys.argv[1:]
    if os.path.exists(dest) and hashlib.sha256(open(dest, "rb").read()).hexdigest() == sha256:
        return 0
    want = f"{name}-{version}.tar.gz"
    req = urllib.request.Request(f"{index_url()}/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = json.load(r)["files"]
    match = [f for f in files if f["filename"] == want]
    if not match:
        print(f"fetch_sdist: the index has no {want}", file=sys.stderr)
        return 1
    with urllib.request.urlopen(match[0]["url"], timeout=300) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        print(f"fetch_sdist: {want} has sha256 {got}, expected {sha256}", file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dest)))
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)
    print(f"fetch_sdist: {want} ({len(data)} bytes, sha256 checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
