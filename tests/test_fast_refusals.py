"""Bad arguments are refused before torch or transformers load: every refusal below comes out of
a command line whose `torch` and `transformers` cannot be imported at all, so none of them waited
for either (their time is in docs/benchmarks.md, "Start-up of the command line")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "zipage.cli.main"]


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory) -> dict:
    """An environment in which importing torch or transformers fails loudly."""
    shadow = tmp_path_factory.mktemp("shadow")
    for name in ("torch", "transformers"):
        (shadow / name).mkdir()
        (shadow / name / "__init__.py").write_text(f"raise ImportError('{name} must not be imported here')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
    env.pop("ZIPAGE_API_KEY", None)
    return env


@pytest.mark.parametrize("args,message", [
    (["generate", "--model", "missing.gguf", "hi"], "GGUF file 'missing.gguf' not found"),
    (["generate", "--model", "random:nope", "hi"], "unknown random preset 'random:nope'"),
    (["generate", "--model", "no-such-model", "hi"], "model 'no-such-model' not found"),
    (["generate", "--model", str(ROOT / "README.md"), "hi"], "is a file but not a .gguf"),
    (["bench", "--mode", "bogus"], "unknown mode 'bogus'"),
    (["chat", "--plain", "--model", "missing.gguf"], "GGUF file 'missing.gguf' not found"),
    (["serve", "--model", "missing.gguf"], "GGUF file 'missing.gguf' not found"),
])
def test_refused_without_loading_torch(without_torch, args, message):
    result = subprocess.run(CLI + args, capture_output=True, text=True, env=without_torch, cwd=ROOT, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr and "must not be imported" not in result.stderr


def test_cuda_asked_without_a_driver_is_refused_without_torch(without_torch):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver")
    result = subprocess.run(CLI + ["generate", "--device", "cuda", "hi"], capture_output=True, text=True,
                            env=without_torch, cwd=ROOT, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "CUDA is not available on this machine" in result.stderr
