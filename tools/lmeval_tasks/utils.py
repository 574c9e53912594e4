"""Helpers of kvserve's local lm-evaluation-harness tasks (the YAMLs beside this file; data written by
tools/make_lmeval_tasks.py). The datasets load from the .jsonl files here, whatever the working
directory, without the Hugging Face hub."""
from __future__ import annotations

import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent


def _load(name: str):
    import datasets
    return datasets.DatasetDict({"test": datasets.load_dataset("json", data_files=str(HERE / name), split="train")})


def load_retrieval(**kwargs):
    """The secret-code documents (retrieval.jsonl) as a DatasetDict with a `test` split."""
    return _load("retrieval.jsonl")


def load_mc(**kwargs):
    """The multiple-choice delivery-log items (mc.jsonl) as a DatasetDict with a `test` split."""
    return _load("mc.jsonl")


def process_retrieval(doc: dict, results: list) -> dict:
    """contains: the code occurs anywhere in the answer; exact_match: the answer's first run of digits
    is the code (a verbose "The secret code is 1234567." still counts, a wrong first number does not)."""
    answer = results[0] or ""
    digits = re.findall(r"\d+", answer)
    return {"contains": float(doc["answer"] in answer),
            "exact_match": float(bool(digits) and digits[0] == doc["answer"])}
