"""benchmarks/gpu_decode_tiles.py, the decode attention timing the launches are chosen by, runs end to
end under the Triton interpreter (--device cpu): each shape's variants of every cache kind check out
against the reference on the same codes, and each row carries its rounds' median and spread."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Looked up, not imported: the interpreter tests switch it on before their own import of triton.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def test_decode_tiles_script_checks_and_times_every_variant(tmp_path):
    out = tmp_path / "tiles.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_decode_tiles.py"), "--device", "cpu",
                    "--shapes", "2x300,1x70", "--tiles", "64", "--ways", "auto,2", "--kv-heads", "2",
                    "--head-dim", "64", "--block-size", "16", "--rounds", "2", "--codes", "engine,ptx",
                    "--json", str(out)],
                   check=True, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    rows = json.loads(out.read_text())["rows"]
    # 8-bit caches once per --codes variant (under the interpreter both run the casts: it runs no PTX)
    caches = [("bf16", "engine")] + [(c, v) for c in ("fp8", "int8") for v in ("engine", "ptx")]
    assert [(r["batch"], r["ways"], r["cache"], r["codes"]) for r in rows] == [
        (b, w, c, v) for b in (2, 1) for w in ("auto", 2) for c, v in caches]
    assert all(r["rel_err"] < 1e-4 for r in rows), rows
    assert all(r["fastest_us"] <= r["us"] <= r["slowest_us"] for r in rows)
    assert {r["warps"] for r in rows if r["cache"] == "int8"} == {2}  # each cache kind's own launch
