"""Two writers and a reader on one library at the same time (WAL + busy timeout)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ENGINE, ROOT, assert_db_ok, chunk_texts_by_path, clean_env, req, serve, sp

# slow (out of the quick subset): engine processes writing and reading one library at once.
pytestmark = pytest.mark.slow


def _popen_ingest(lib, kb):
    request = lib.parent / f"{lib.name}.json"
    request.write_text(json.dumps({"paths": [str(lib)], "kb_root": str(kb)}))
    with open(request, "rb") as stdin:
        return subprocess.Popen([sys.executable, str(ENGINE), "ingest"], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=str(ROOT), env=clean_env())


def test_parallel_ingests_and_searches(tmp_path):
    kb = tmp_path / "kb"
    libs = [tmp_path / "a", tmp_path / "b"]
    for i in range(12):
        sp.make_filler_paper(libs[i % 2], i, pages=3)
    sp.make_onecolumn_paper(libs[0])
    procs = [_popen_ingest(lib, kb) for lib in libs]
    # a reader keeps searching while both writers run
    lines = [req(i, "search", {"query": "graphene nucleation", "kb_root": str(kb)}) for i in range(200)]
    rc, out, err = serve(lines, env=clean_env())
    outs = [p.communicate(timeout=300) for p in procs]
    assert rc == 0, err[-2000:]
    replies = [o for o in out if o.get("event") != "progress"]
    assert len(replies) == 200
    bad = [r for r in replies if not r["ok"] and r.get("code") != "busy"]
    assert not bad, bad[:3]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr.decode()[-2000:]
        j = json.loads(stdout)
        assert j["ok"] and j["totals"]["error"] == 0 and j["totals"]["added"] == j["totals"]["files"], j["totals"]
    assert_db_ok(kb)
    texts = chunk_texts_by_path(kb)
    assert len(texts) == 13
    rc, out, _ = serve([req("s", "search", {"query": "specimen005", "kb_root": str(kb)})])
    assert out[-1]["response"]["results"][0]["file"] == "filler_005.pdf"
