"""Fuzz the serve loop: thousands of random and malformed lines, exactly one
reply each, and a real search still answers at the end.

Seed: env KB_FUZZ_SEED (default 20240229); line count: env KB_FUZZ_LINES (default 3000).
"""
from __future__ import annotations

import json
import os
import random
import time

import pytest

from helpers import clean_env, req, serve, sp

SEED = int(os.environ.get("KB_FUZZ_SEED", "20240229"))
N_LINES = int(os.environ.get("KB_FUZZ_LINES", "3000"))

WORDS = ["graphene", "copper", "nucleation", "folding", "ribosome", "lithium", "钙钛矿", "稳定性", "the", "of", "AND",
         "OR", "NOT", "NEAR", "*", '"', "'", "(", ")", ":", "^", "-", "+", "title:", "text:", "{", "}", "\\", "%", "_",
         "\u2028", "\u0085", "\ufb03", "e\u0301", "\U0001F600", "\x00", "\t", ";", "--", "/*", "NULL"]
VALID = ("search", "docs", "stats", "dedup", "ingest")  # clear is only ever sent without confirm
COMMANDS = ["search", "docs", "stats", "dedup", "clear", "ingest", "serve", "", "summarise", "delete",
            "__init__", "execute", "close", "__class__", None, 5, ["search"], {"c": 1}]


class Fuzzer:
    def __init__(self, seed, kb):
        self.rng = random.Random(seed)
        self.kb = str(kb)

    def scalar(self):
        r = self.rng
        return r.choice([
            lambda: r.randint(-10**6, 10**6), lambda: r.randint(-2**70, 2**70), lambda: r.random() * 1e6,
            lambda: self.text(), lambda: None, lambda: r.choice([True, False]), lambda: "",
            lambda: "\ud800" + self.text(), lambda: 0, lambda: -1, lambda: 10**12,
        ])()

    def value(self, depth=0):
        r = self.rng
        if depth > 2 or r.random() < 0.6:
            return self.scalar()
        if r.random() < 0.5:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        return {self.text(8): self.value(depth + 1) for _ in range(r.randint(0, 4))}

    def text(self, n=None):
        r = self.rng
        n = r.randint(0, 12) if n is None else r.randint(0, n)
        return " ".join(r.choice(WORDS) for _ in range(n))

    def payload(self, command):
        r = self.rng
        if r.random() < 0.1:
            return self.value()
        p = {}
        if r.random() < 0.9:
            p["kb_root"] = self.kb if r.random() < 0.9 else r.choice([5, None, [], {}, True])
        if command == "search":
            if r.random() < 0.9:
                p["query"] = self.text() if r.random() < 0.8 else self.value()
            for key, gen in (("top_k", lambda: r.choice([r.randint(-5, 50), 10**12, 0, "10", 2.5, None, [], True])),
                             ("snippet", lambda: r.choice([r.randint(-5, 5000), 0, "300", None, 1e9])),
                             ("mode", lambda: r.choice(["keyword", "vector", "hybrid", "", 3, None])),
                             ("filters", lambda: self.filters())):
                if r.random() < 0.4:
                    p[key] = gen()
        elif command in ("docs",):
            for key in ("limit", "offset"):
                if r.random() < 0.5:
                    p[key] = r.choice([r.randint(-3, 100), 10**15, "5", None, 1.5, []])
        elif command == "clear":
            p.update(r.choice([{}, {"confirm": False}]))
        elif command == "dedup":
            p.update(r.choice([{}, {"apply": False}]))
        elif command == "ingest":
            p["paths"] = r.choice([5, None, {"a": 1}, [12], [None], ["/nonexistent/kb-fuzz/x.pdf"],
                                   "/nonexistent/kb-fuzz/y.pdf", [[]]])
            if r.random() < 0.3:
                p["force"] = r.choice([True, False, "yes", 1])
        else:
            for _ in range(r.randint(0, 3)):
                p[self.text(3)] = self.value()
        return p

    def filters(self):
        r = self.rng
        if r.random() < 0.2:
            return self.value()
        keys = ["authors", "title", "journal", "kind", "year", "section", "doi", self.text(2)]
        out = {}
        for k in r.sample(keys, r.randint(0, 4)):
            out[k] = r.choice([self.text(3), self.scalar(), [2019, 2021], [r.randint(-9, 3000)], {"from": 2020},
                               {"from": "x", "to": []}, ["pdf", "md"], ["pdf", 5], [None, None]])
        return out

    def line(self):
        """(raw line, expected id or 'NULL', must_fail)"""
        r = self.rng
        kind = r.random()
        if kind < 0.15:  # random bytes, never a valid request
            raw = bytes(r.choice([b for b in range(256) if b not in (10, 13)]) for _ in range(r.randint(1, 120)))
            if not raw.strip():
                raw = b"x" + raw
            return raw, "ANY", True
        if kind < 0.25:  # a truncated request
            full = json.dumps({"id": r.randint(0, 99), "command": "search", "payload": {"query": self.text()}})
            return full[:r.randint(1, len(full) - 1)].encode(), "NULL", True
        if kind < 0.32:  # JSON that is not an object
            text = json.dumps(self.value(), ensure_ascii=r.random() < 0.5)
            return text.encode("utf-8", "surrogatepass"), "NULL", True
        if kind < 0.34:  # deep nesting and huge lines
            depth = r.choice([50, 5000, 100000])
            if r.random() < 0.5:
                return (b"[" * depth + b"]" * depth), "NULL", True
            return json.dumps({"id": "big", "command": "search",
                               "payload": {"query": "graphene " * r.randint(1000, 30000), "kb_root": self.kb}}
                              ).encode(), "big", False
        command = r.choice(COMMANDS) if r.random() < 0.3 else r.choice(["search", "search", "docs", "stats",
                                                                          "dedup", "clear", "ingest"])
        obj = {}
        if r.random() < 0.9:
            obj["id"] = self.scalar() if r.random() < 0.4 else r.randint(0, 10**6)
        obj["command"] = command
        if r.random() < 0.9:
            obj["payload"] = self.payload(command)
        if r.random() < 0.05:
            obj[self.text(2)] = self.value()
        text = json.dumps(obj, ensure_ascii=r.random() < 0.5)
        must_fail = not isinstance(command, str) or command not in VALID
        expect = obj.get("id", "MISSING")
        if "\ud800" in text:  # a raw lone surrogate cannot be valid UTF-8: the line is undecodable
            return text.encode("utf-8", "surrogatepass"), "ANY", True
        return text.encode("utf-8"), expect, must_fail


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    kb = base / "kb"
    lib = base / "lib"
    sp.make_onecolumn_paper(lib)
    sp.make_chinese_paper(lib)
    fz = Fuzzer(SEED, kb)
    lines = [req("setup", "ingest", {"paths": [str(lib)], "kb_root": str(kb)})]
    meta = [("setup", False)]
    for _ in range(N_LINES):
        raw, exp, must_fail = fz.line()
        lines.append(raw)
        meta.append((exp, must_fail))
    lines.append(req("final", "search", {"query": "graphene nucleation copper", "kb_root": str(kb)}))
    meta.append(("final", False))
    t0 = time.time()
    rc, out, err = serve(lines, env=clean_env(KB_ROOT=kb), cwd=base, timeout=180)
    return dict(rc=rc, out=out, err=err, lines=lines, meta=meta, seconds=time.time() - t0)


def test_one_reply_per_line(fuzz_run):
    out, lines, meta = fuzz_run["out"], fuzz_run["lines"], fuzz_run["meta"]
    assert fuzz_run["rc"] == 0, fuzz_run["err"][-3000:]
    replies = [o for o in out if o.get("event") != "progress"]
    assert len(replies) == len(lines), f"{len(replies)} replies for {len(lines)} lines (seed {SEED})"
    for raw, (exp, must_fail), rep in zip(lines, meta, replies):
        assert isinstance(rep, dict) and isinstance(rep.get("ok"), bool), (raw[:200], rep)
        if exp == "NULL" or exp == "MISSING":
            assert rep.get("id") is None, (raw[:200], rep)
        elif exp != "ANY":
            if isinstance(exp, (bool, list, dict)) and rep.get("id") is None:
                pass  # echoing non-scalar ids is checked strictly in test_serve.py
            else:
                assert rep.get("id") == exp, (raw[:200], rep)
        if must_fail:
            assert rep["ok"] is False, (raw[:200], rep)
        if rep["ok"] is False:
            assert isinstance(rep.get("error"), str) and isinstance(rep.get("code"), str), (raw[:200], rep)


def test_real_search_still_answers(fuzz_run):
    replies = [o for o in fuzz_run["out"] if o.get("event") != "progress"]
    assert replies and replies[0]["id"] == "setup" and replies[0]["ok"], replies[:1]
    assert replies[0]["response"]["totals"]["added"] == 2
    last = replies[-1]
    assert last["id"] == "final" and last["ok"], last
    assert last["response"]["results"][0]["file"] == "graphene_cvd_copper.pdf"


def test_fuzz_is_fast_enough(fuzz_run):
    assert fuzz_run["seconds"] < 60, f"{len(fuzz_run['lines'])} lines took {fuzz_run['seconds']:.1f}s"


def test_no_internal_errors(fuzz_run):
    """User input (odd queries, wrong types) is rejected as bad_request or answered,
    never reported as an internal failure."""
    replies = [o for o in fuzz_run["out"] if o.get("event") != "progress"]
    internal = [(raw[:150], rep.get("error")) for raw, rep in zip(fuzz_run["lines"], replies)
                if rep.get("ok") is False and rep.get("code") == "internal"]
    assert not internal, f"{len(internal)} internal errors, e.g. {internal[:5]}"
