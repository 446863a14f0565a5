"""`zipage generate` tells on stderr why an answer ended where the reader might not expect it, and
answers in the JSON a schema file asks for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "zipage.cli.main", "generate", "--model", "random:llama-tiny", "--device", "cpu",
       "--raw", "--temperature", "0"]


def test_an_answer_cut_by_max_tokens_says_so():
    cut = subprocess.run(CLI + ["--max-tokens", "5", "hello"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert cut.returncode == 0, cut.stderr
    assert "stopped at --max-tokens (5 tokens)" in cut.stderr
    whole = subprocess.run(CLI + ["--max-tokens", "5", "--stats", "hello"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert "finish: length" in whole.stderr  # the same answer, with its stats


def test_json_schema_answers_in_that_json_and_bad_files_are_usage_errors(tmp_path):
    schema = {"type": "object", "required": ["answer"], "additionalProperties": False,
              "properties": {"answer": {"enum": ["yes", "no"]}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    run = subprocess.run(CLI + ["--json-schema", str(tmp_path / "schema.json"), "Is it?"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["answer"] in ("yes", "no")
    (tmp_path / "list.json").write_text("[1]")
    for name, why in (("missing.json", "No such file"), ("list.json", "holds a list")):
        bad = subprocess.run(CLI + ["--json-schema", str(tmp_path / name), "x"], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
        said = " ".join(bad.stderr.split())  # the error line is wrapped to the terminal's width
        assert bad.returncode == 2 and why in said and "Traceback" not in said
