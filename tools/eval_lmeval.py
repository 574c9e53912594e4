#!/usr/bin/env python3
"""lm-evaluation-harness against a real kvserve server (`make eval-lmeval`; issue 51 item 4).

Starts `kvserve serve` on a free 127.0.0.1 port with the policies below, runs lm-eval's own CLI
(`lm_eval` from build-lmeval/venv, unmodified) on kvserve's local tasks (tools/lmeval_tasks/, data
from tools/make_lmeval_tasks.py; offline: HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1), and writes a
markdown table and a JSON file (docs/eval/lmeval.{md,json}):

  retrieval (generate_until)   `--model local-chat-completions --apply_chat_template`, one run per
                               policy x layout, the policy chosen per request by
                               `--gen_kwargs kv_policy=NAME` (lm-eval sends generation kwargs it does
                               not know as request fields). Layouts: `onemsg` (document and question in
                               one user message) and `docsys` (the document as the system message, the
                               question as the user message).
  kvserve_mc (loglikelihood)   `--model local-completions` with `tokenizer_backend=huggingface,
                               tokenizer=<model dir>` (or `--tokenizer-backend remote`: the server's
                               /tokenizer_info, /tokenize, /detokenize). lm-eval sends no generation
                               kwargs with loglikelihood requests, so each `--mc-policies` entry gets a
                               server of its own started with `--default-policy NAME`.

After each run the driver reads the server's /metrics (kvserve:kv_requests_total{policy} and the
kept / full token counters) so the table shows that the policy really served the requests and what
fraction of the KV it kept.

  python3 tools/eval_lmeval.py                                  # the full grid
  python3 tools/eval_lmeval.py --limit 10 --mc-policies full   # a reduced grid
  python3 tools/eval_lmeval.py --tokenizer-backend remote --policies '' --layouts ''
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
SERVED = "smollm2-135m-instruct"
# name -> YAML body of the policy (under `policies:`); `kv_policy` names these.
POLICIES = {
    "full": "{}",
    "kvzip-0.25": "{method: kvzip, budget: 0.25}",
    "kvzap-0.25": "{method: kvzap, budget: 0.25}",
    "snapkv-0.25": "{method: snapkv, budget: 0.25}",
}
LAYOUTS = {"onemsg": "kvserve_retrieval_onemsg", "docsys": "kvserve_retrieval_docsys"}
MC_TASK = "kvserve_mc"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def log(msg: str) -> None:
    print(f"[eval_lmeval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Server:
    """`kvserve serve` (under `nice`) on a free port with a generated config."""

    def __init__(self, name: str, kvserve: str, model: str, policies: list[str], workdir: pathlib.Path,
                 kv_cache_bytes: str, default_policy: str = "full", nice: int = 10):
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / f"{name}.yaml"
        pol = "".join(f"  {n}: {POLICIES[n]}\n" for n in dict.fromkeys(["full", *policies]))
        self.config.write_text(f"""model:
  path: {model}
  served_model_name: {SERVED}
  device: cpu
server:
  host: 127.0.0.1
  port: 0
  max_body_bytes: 8MiB
  request_timeout_s: 1800
cache:
  kv_cache_bytes: {kv_cache_bytes}
policies:
{pol}default_policy: {default_policy}
""")
        self.log_path = workdir / f"{name}.log"
        cfg = self.config.relative_to(REPO) if self.config.is_relative_to(REPO) else self.config
        self.args = nice_prefix(nice) + [kvserve, "serve", "--config", str(cfg)]
        self.binary_mtime = datetime.datetime.fromtimestamp(os.path.getmtime(kvserve)).isoformat(timespec="seconds")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        self.port = self._wait_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_healthy()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_port(self) -> int:
        deadline = time.time() + 120
        while time.time() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.text())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve exited with {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.1)
        raise RuntimeError(f"kvserve did not start listening:\n{self.text()}")

    def _wait_healthy(self) -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve exited with {self.proc.returncode}:\n{self.text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except Exception:  # noqa: BLE001 -- still loading
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kvserve never became healthy:\n{self.text()}")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def policy_counters(self) -> dict[str, dict[str, float]]:
        """{policy: {requests, kept, full}} from /metrics."""
        _, text = self.get("/metrics")
        out: dict[str, dict[str, float]] = {}
        names = {"kvserve:kv_requests_total": "requests", "kvserve:kv_kept_tokens_total": "kept",
                 "kvserve:kv_full_tokens_total": "full"}
        for line in text.splitlines():
            m = re.match(r'(kvserve:kv_(?:requests|kept_tokens|full_tokens)_total)\{[^}]*policy="([^"]+)"[^}]*\}\s+(\S+)',
                         line)
            if m and m.group(1) in names:
                out.setdefault(m.group(2), {})[names[m.group(1)]] = float(m.group(3))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def nice_prefix(level: int) -> list[str]:
    """`nice -n K` that brings a child to niceness `level` (absolute: a driver already run under nice
    does not push its children further down), or nothing."""
    k = level - os.nice(0)
    return ["nice", "-n", str(k)] if k > 0 else []


def delta(after: dict, before: dict, policy: str) -> dict:
    a, b = after.get(policy, {}), before.get(policy, {})
    d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in ("requests", "kept", "full")}
    d["kept_fraction"] = d["kept"] / d["full"] if d["full"] else None
    return d


def run_lm_eval(cmd: list[str], outdir: pathlib.Path, logfile: pathlib.Path, env: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(logfile, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    return rc, time.perf_counter() - t0


def read_results(outdir: pathlib.Path, task: str) -> tuple[dict, list[dict]]:
    """lm-eval's results_*.json metrics for `task` and its logged samples."""
    res = sorted(glob.glob(str(outdir / "**" / "results_*.json"), recursive=True))
    if not res:
        return {}, []
    data = json.loads(pathlib.Path(res[-1]).read_text())
    metrics = {k.split(",")[0]: v for k, v in data["results"][task].items() if "," in k and "stderr" not in k}
    metrics.update({k.split(",")[0]: v for k, v in data["results"][task].items() if "_stderr," in k})
    metrics["n"] = data.get("n-samples", {}).get(task, {}).get("effective")
    samples = []
    for f in sorted(glob.glob(str(outdir / "**" / f"samples_{task}_*.jsonl"), recursive=True)):
        for line in open(f):
            s = json.loads(line)
            row = {"doc_id": s["doc_id"], "target": s["target"]}
            if "contains" in s:
                row.update(answer=s["filtered_resps"][0] if s["filtered_resps"] else None,
                           contains=s["contains"], exact_match=s["exact_match"])
            else:
                row.update(acc=s.get("acc"))
            samples.append(row)
    return metrics, samples


def tail(path: pathlib.Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def pretty(cmd: list[str], port: int) -> str:
    """A command as it ran, with the server's URL written with $PORT (the free port differs per run)."""
    return " ".join(shlex.quote(c) for c in cmd).replace(f"127.0.0.1:{port}", "127.0.0.1:$PORT")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def tree_state() -> str:
    """'clean', or how many tracked files differ from HEAD (the binary may be built from them)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    except Exception:  # noqa: BLE001
        return "unknown"
    return "clean" if not out else f"{len(out)} tracked files modified"


def lm_eval_version(lm_eval: str) -> str:
    py = pathlib.Path(lm_eval).parent / "python"
    try:
        return subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def fmt(x, pct=True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f} %" if pct else f"{x}"


def binaries(report: dict) -> list[str]:
    """The distinct build times of the binary the runs' servers started from (it may be relinked mid-grid)."""
    return list(dict.fromkeys(r.get("kvserve_mtime") or report.get("kvserve_mtime") or "?" for r in report["runs"]))


def binaries_text(report: dict) -> str:
    b = binaries(report)
    if len(b) <= 1:
        return b[0] if b else str(report.get("kvserve_mtime"))
    return ", ".join(b) + " (relinked between the runs: the table's last column says which each run's server had)"


def write_report(out_md: pathlib.Path, report: dict) -> None:
    rows = report["runs"]
    L = [
        "# lm-evaluation-harness on kvserve",
        "",
        f"Written by `tools/eval_lmeval.py` (`make eval-lmeval`) on {report['date']}: kvserve commit "
        f"`{report['commit']}` (HEAD when the run started; work tree: {report['tree']}), lm-eval "
        f"{report['lm_eval_version']} (unmodified, from `build-lmeval/venv`), model `{report['model']}` on the CPU "
        f"(fp32), offline (`HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1`). Wall time {report['seconds'] / 60:.1f} "
        f"min{report['note']}. The binary `{report['kvserve']}` (`/version` {report.get('server_version', '?')}), "
        f"built {binaries_text(report)}.",
        "",
        "Tasks (tools/lmeval_tasks/, generated by `tools/make_lmeval_tasks.py`, seed 0): "
        "**kvserve_retrieval**: 30 documents of ~1,490 tokens of story filler, each hiding one "
        "\"The secret code of the <key> vault is <7 digits>.\" at a depth spread evenly over the documents, "
        "asked for with greedy decoding (24 tokens); `contains`: the code occurs in the answer, "
        "`exact_match`: the answer's first number is the code. Layouts: `onemsg` = document and question in one "
        "user message (the model's template adds its default system message), `docsys` = the document as the "
        "system message (the task's `description`), the question as the user message. **kvserve_mc**: 30 "
        "four-way questions about a 6-record delivery log, by loglikelihood (`acc`).",
        "",
        "Policies (`kv_policy`, a 25 % budget: a ratio of the prompt): " +
        ", ".join(f"`{n}` = `{POLICIES[n]}`" for n in report["policies"]) + ". "
        "`kept` is kvserve's own count (`/metrics`: kv_kept_tokens_total / kv_full_tokens_total of the run's "
        "requests under that policy) and `reqs` the requests the server counted under it.",
        "",
    ]
    many = len(binaries(report)) > 1
    L += ["| task | layout | policy | score | metric | n | kept | reqs | wall s |" + (" binary built |" if many else ""),
          "|---|---|---|---:|---|---:|---:|---:|---:|" + ("---|" if many else "")]
    for r in rows:
        m = r.get("metrics") or {}
        metric = "contains" if r["kind"] == "generate" else "acc"
        score = m.get(metric)
        extra = ""
        if r["kind"] == "generate" and m.get("exact_match") is not None:
            extra = f" (exact_match {100 * m['exact_match']:.1f} %)"
        if r["rc"] != 0:
            score_s = f"failed (rc {r['rc']})"
        else:
            score_s = fmt(score) + extra
        srv = r.get("server_counters") or {}
        L.append(f"| {r['task']} | {r['layout']} | {r['policy']} | {score_s} | {metric} | {m.get('n', '-')} | "
                 f"{fmt(srv.get('kept_fraction'))} | {int(srv.get('requests', 0))} | {r['seconds']:.0f} |" +
                 (f" {r.get('kvserve_mtime', '?')} |" if many else ""))
    L += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    L += ["", "## Commands", "",
          "The server (on a free port, `$PORT` below):", "",
          "```sh"] + report["server_commands"] + ["```", ""]
    for name, text in report.get("server_configs", {}).items():
        L += [f"`{name}`:", "", "```yaml", text.rstrip(), "```", ""]
    L += [
          "Each lm-eval run, exactly as it ran (environment: " +
          " ".join(f"{k}={v}" for k, v in OFFLINE_ENV.items()) + "):", "", "```sh"]
    L += [r["command"] for r in rows]
    L += ["```", ""]
    out_md.write_text("\n".join(L))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--lm-eval", default=str(REPO / "build-lmeval" / "venv" / "bin" / "lm_eval"))
    ap.add_argument("--tasks-dir", default="tools/lmeval_tasks")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--mc-policies", default="full", help="policies the loglikelihood task runs under ('' = none)")
    ap.add_argument("--tokenizer-backend", choices=("huggingface", "remote"), default="huggingface",
                    help="lm-eval's tokenizer for the loglikelihood task: huggingface (the model directory's "
                         "tokenizer) or remote (the server's /tokenizer_info, /tokenize, /detokenize)")
    ap.add_argument("--limit", type=int, default=0, help="documents per retrieval run (0 = all)")
    ap.add_argument("--mc-limit", type=int, default=-1, help="items per loglikelihood run (0 = all; default: --limit)")
    ap.add_argument("--kv-cache-bytes", default="3GiB")
    ap.add_argument("--nice", type=int, default=10, help="niceness (absolute) of the server and of lm_eval")
    ap.add_argument("--timeout", type=int, default=1800, help="lm-eval's per-request timeout, seconds")
    ap.add_argument("--work", default="build-lmeval/runs", help="lm-eval outputs and server logs")
    ap.add_argument("--out", default="docs/eval/lmeval.md", help="markdown report (the JSON goes beside it)")
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from the JSON beside it; run nothing")
    ap.add_argument("--merge", action="append", default=[],
                    help="with --report-only: add the runs, commands, configs and notes of this other report JSON")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    a = ap.parse_args(argv)
    if a.report_only:
        out_md = REPO / a.out
        report = json.loads(out_md.with_suffix(".json").read_text())
        for other in a.merge:
            o = json.loads(pathlib.Path(other).read_text())
            report["runs"] += o["runs"]
            report["server_commands"] += o["server_commands"]
            report["server_configs"].update(o["server_configs"])
            report["notes"] += [n for n in o["notes"] if n not in report["notes"]]
            report["policies"] = list(dict.fromkeys(report["policies"] + o["policies"]))
            report["seconds"] += o["seconds"]
        report["notes"] += [n for n in a.note if n not in report["notes"]]
        write_report(out_md, report)
        out_md.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        return 0
    policies = [p for p in a.policies.split(",") if p]
    layouts = [x for x in a.layouts.split(",") if x]
    mc_policies = [p for p in a.mc_policies.split(",") if p]
    for p in policies + mc_policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
    for x in layouts:
        if x not in LAYOUTS:
            ap.error(f"unknown layout {x!r} (known: {', '.join(LAYOUTS)})")
    if not os.path.exists(a.lm_eval):
        ap.error(f"{a.lm_eval} not found: `make eval-lmeval` makes build-lmeval/venv")
    work = REPO / a.work / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **OFFLINE_ENV, HF_DATASETS_CACHE=str(REPO / "build-lmeval" / "hf-datasets-cache"))
    env.pop("OPENAI_API_KEY", None)
    nice = nice_prefix(a.nice)
    limit = ["--limit", str(a.limit)] if a.limit else []
    mc_limit_n = a.limit if a.mc_limit < 0 else a.mc_limit
    mc_limit = ["--limit", str(mc_limit_n)] if mc_limit_n else []
    report = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
              "lm_eval_version": lm_eval_version(a.lm_eval), "model": a.model, "policies": [],
              "kvserve": a.kvserve, "tree": tree_state(),
              "kvserve_mtime": datetime.datetime.fromtimestamp(os.path.getmtime(a.kvserve)).isoformat(timespec="seconds")
              if os.path.exists(a.kvserve) else None,
              "limit": a.limit or None, "mc_limit": mc_limit_n or None, "runs": [], "notes": list(a.note), "server_commands": [], "server_configs": {}}
    report["policies"] = list(dict.fromkeys(["full", *policies, *mc_policies]))
    t_all = time.perf_counter()
    report["notes"] += [
        "Loglikelihood scores come from `/v1/completions` with `echo` and `logprobs` (docs/api.md): the prompt's "
        "logprobs are computed by one forward over the whole prompt before any KV compression, so they are the "
        "same under every policy by design; `--mc-policies` shows it rather than tests a policy.",
        "`kvserve_retrieval_onemsg` under kvzip / kvzap: a one-message prompt has no context before its last user "
        "message; binaries before commit 76ba974 compress the whole prompt, question included, and from it on the "
        "question is kept whole (`usage.kv_context_boundary`). `docsys` gives kvzip / kvzap the document alone as "
        "the context and keeps the question whole on either.",
    ]

    out_md = REPO / a.out

    def save(partial: bool) -> None:
        report["seconds"] = time.perf_counter() - t_all
        report["note"] = ""
        if a.limit or mc_limit_n:
            report["note"] = (f"; a reduced grid: `--limit {a.limit or 'all'}` retrieval documents per run, "
                              f"`--mc-limit {mc_limit_n or 'all'}` multiple-choice items")
        if partial:
            report["note"] += " (PARTIAL: the run is still going or was stopped)"
        out_md.parent.mkdir(parents=True, exist_ok=True)
        write_report(out_md, report)
        out_md.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")

    def run(srv: Server, kind: str, task: str, layout: str, policy: str, tag: str, cmd: list[str]) -> dict:
        outdir = work / tag
        log(f"{tag}: {pretty(cmd, srv.port)}")
        before = srv.policy_counters()
        rc, secs = run_lm_eval(cmd, outdir, work / f"{tag}.log", env)
        counters = delta(srv.policy_counters(), before, policy)
        metrics, samples = read_results(outdir, task) if rc == 0 else ({}, [])
        row = {"kind": kind, "task": task, "layout": layout, "policy": policy, "rc": rc, "seconds": secs,
               "metrics": metrics, "server_counters": counters, "command": pretty(cmd, srv.port),
               "kvserve_mtime": srv.binary_mtime,
               "samples": samples}
        if rc != 0:
            row["error_tail"] = tail(work / f"{tag}.log")
            log(f"{tag}: lm_eval failed (rc {rc}):\n{row['error_tail']}")
        else:
            log(f"{tag}: {json.dumps({k: v for k, v in metrics.items() if not k.endswith('_stderr')})} "
                f"in {secs:.0f} s; server: {counters}")
        report["runs"].append(row)
        save(partial=True)
        return row

    # Generation: one server, every policy x layout, kv_policy per request.
    if policies and layouts:
        srv = Server("kvserve-generate", a.kvserve, a.model, policies, work, a.kv_cache_bytes, nice=a.nice)
        report["server_commands"].append(" ".join(shlex.quote(x) for x in srv.args) + "   # listens on $PORT")
        report["server_configs"][str(srv.config.name)] = srv.config.read_text()
        report.setdefault("server_version", srv.get("/version")[1].strip())
        try:
            for layout in layouts:
                for policy in policies:
                    tag = f"{LAYOUTS[layout]}-{policy}"
                    cmd = nice + [a.lm_eval, "--model", "local-chat-completions", "--model_args",
                                  f"model={SERVED},base_url=http://127.0.0.1:{srv.port}/v1/chat/completions,"
                                  f"num_concurrent=1,max_retries=1,timeout={a.timeout}",
                                  "--tasks", LAYOUTS[layout], "--include_path", a.tasks_dir,
                                  "--apply_chat_template", "--gen_kwargs", f"kv_policy={policy}",
                                  "--output_path", str((work / tag).relative_to(REPO)),
                                  "--log_samples", *limit]
                    run(srv, "generate", LAYOUTS[layout], layout, policy, tag, cmd)
        finally:
            srv.stop()

    # Loglikelihood: a server per policy (--default-policy), since lm-eval sends no kv_policy with it.
    for policy in mc_policies:
        srv = Server(f"kvserve-mc-{policy}", a.kvserve, a.model, [policy], work, a.kv_cache_bytes,
                     default_policy=policy, nice=a.nice)
        report["server_commands"].append(" ".join(shlex.quote(x) for x in srv.args) + "   # listens on $PORT")
        report["server_configs"][str(srv.config.name)] = srv.config.read_text()
        try:
            if a.tokenizer_backend == "remote":
                status, body = srv.get("/tokenizer_info")
                report["tokenizer_info_status"] = status
                if status != 200:
                    note = (f"`--tokenizer-backend remote`: `GET /tokenizer_info` answered {status} "
                            f"(`{body.strip()[:160]}`), so lm-eval's remote tokenizer cannot start; "
                            "the run below shows lm-eval's error.")
                    report["notes"].append(note)
                    log(note)
                tok_args = "tokenizer_backend=remote"
            else:
                tok_args = f"tokenizer_backend=huggingface,tokenizer={a.model}"
            tag = f"{MC_TASK}-{a.tokenizer_backend}-{policy}"
            cmd = nice + [a.lm_eval, "--model", "local-completions", "--model_args",
                          f"model={SERVED},base_url=http://127.0.0.1:{srv.port}/v1/completions,{tok_args},"
                          f"num_concurrent=1,max_retries=1,timeout={a.timeout}",
                          "--tasks", MC_TASK, "--include_path", a.tasks_dir,
                          "--output_path", str((work / tag).relative_to(REPO)),
                          "--log_samples", *mc_limit]
            run(srv, "loglikelihood", MC_TASK, f"completion ({a.tokenizer_backend} tokenizer)", policy, tag, cmd)
        finally:
            srv.stop()

    save(partial=False)
    log(f"wrote {out_md} and {out_md.with_suffix('.json')} in {report['seconds']:.0f} s (outputs: {work})")
    return 0 if all(r["rc"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
