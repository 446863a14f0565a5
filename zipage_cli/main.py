"""The `zipage` command line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from zipage.cli.eval.commands import eval_app
from zipage.cli.options import engine_options
from zipage.engine.config import DEFAULT_MODEL

app = typer.Typer(
    name="zipage",
    help="Zipage: LLM inference with a bounded KV cache per request, and a console to watch it work.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)
err = Console(stderr=True)


INTERRUPTED = 130  # the shell's status for a command stopped by Ctrl+C (128 + SIGINT)


def _exit_with_error(message: str, status: int) -> NoReturn:
    err.print(f"[red]error:[/] {message}")
    raise typer.Exit(status)


def usage_error(message: str) -> NoReturn:
    """Bad input on the command line: one red line on stderr and exit status 2, no traceback."""
    _exit_with_error(message, 2)


def run_failed(message: str) -> NoReturn:
    """The input was fine but the work failed: one red line on stderr and exit status 1, no traceback."""
    _exit_with_error(message, 1)


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """The checks of options and prompts raise ValueError: inside this block, that is a usage error."""
    try:
        yield
    except ValueError as e:
        usage_error(f"{e}")


@contextlib.contextmanager
def exit_on_interrupt(clean_up: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Ctrl+C inside this block ends the command quietly, after `clean_up`, with no traceback."""
    try:
        yield
    except KeyboardInterrupt:
        # A second Ctrl+C must not break the clean-up; the handler is put back after it, since the
        # command may run inside a longer-lived process (tests), whose children inherit an ignored SIGINT.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            clean_up()
        finally:
            signal.signal(signal.SIGINT, previous)
        raise typer.Exit(INTERRUPTED)


@app.command(epilog="Examples:\n\n  zipage generate \"Why is the sky blue?\"\n\n"
                    "  echo \"Write a haiku about GPUs\" | zipage generate --max-tokens 64\n\n"
                    "  zipage generate --raw --temperature 0 \"The capital of France is\"\n\n"
                    "  zipage generate --kv-budget 4 --budget-policy elastic \"Explain KV caches\"")
@engine_options
def generate(
    prompt: str = typer.Argument(None, help="The prompt; read from standard input when omitted."),
    max_tokens: int = typer.Option(512, help="Most tokens to generate."),
    temperature: float = typer.Option(0.7, help="Sampling temperature; 0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, help="Sample from the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, help="Drop tokens below min_p times the top probability."),
    repetition_penalty: float = typer.Option(1.0, help="Penalty for tokens already in the context."),
    frequency_penalty: float = typer.Option(0.0, help="Subtracted from a token's logit per time it is in the "
                                                      "answer so far, in [-2, 2]."),
    presence_penalty: float = typer.Option(0.0, help="Subtracted from the logit of every token already in the "
                                                     "answer, in [-2, 2]."),
    sample_seed: int = typer.Option(None, "--sample-seed", help="Seed for this request's sampling."),
    # Read as text so that a value that is no whole number is one line of error, like 0 or too large a budget.
    kv_budget: str = typer.Option(None, "--kv-budget", metavar="BLOCKS",
                                  help="This request's KV budget in blocks (its floor under --budget-policy "
                                       "elastic); default: the engine's --max-cache-blocks-per-seq."),
    raw: bool = typer.Option(False, "--raw", metavar="",
                             help="Send the prompt as is, without the model's chat template."),
    system: str = typer.Option(None, help="A system message for the chat template."),
    stats: bool = typer.Option(False, "--stats", metavar="", help="Print tokens, time and throughput to stderr at the end."),
    logprobs: int = typer.Option(None, "--logprobs", metavar="K",
                                 help="After the answer, print each token's log-probability and the K most likely "
                                      "tokens at its place (K in [0, 20])."),
    json_schema: Path = typer.Option(None, "--json-schema", metavar="FILE",
                                     help="Answer in JSON that matches the JSON schema in FILE (structured output)."),
    engine_kwargs: dict = None,
):
    """Stream the model's answer to a prompt to standard output."""
    from zipage.engine.config import SamplingParams

    prompt = _read_prompt(prompt)
    with usage_errors():
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, max_tokens=max_tokens, seed=sample_seed,
                                kv_budget=_blocks(kv_budget, "--kv-budget"), logprobs=logprobs,
                                json_schema=_read_schema(json_schema))
    service = _load_engine(engine_kwargs)
    try:
        _answer(service, prompt, params, raw, system, stats)
    finally:
        service.close()


def _read_schema(path: Path | None) -> dict | None:
    """The JSON schema in a --json-schema file; ValueError (a usage error) when it cannot be read."""
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--json-schema {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"--json-schema {path}: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object, this file holds a {type(schema).__name__}")
    return schema


def _read_prompt(prompt: str | None) -> str:
    """The prompt argument, else standard input (unless that is a terminal nobody types into)."""
    if prompt is None:
        if sys.stdin.isatty():
            usage_error("give a prompt as an argument or on standard input")
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            usage_error(f"standard input is not valid UTF-8: {e}")
    if not prompt.strip():
        usage_error("the prompt is empty; give some text to answer")
    return prompt


def _answer(service, prompt: str, params, raw: bool, system: str | None, stats: bool) -> None:
    """Submit the prompt and stream its answer; Ctrl+C aborts the request, so that its blocks are freed."""
    handle = None

    def abort() -> None:
        if handle is not None:
            service.abort(handle)

    with exit_on_interrupt(abort), usage_errors():
        request = _chat_or_text(service, prompt, raw, system)
        start = time.monotonic()
        handle = service.submit(request, params, session="cli")
        out = _write_answer(handle)
        if out.logprobs:
            from zipage.cli.logprob_table import logprob_table

            sys.stdout.write("\n" + logprob_table(service.tokenizer, out.logprobs))
        _check_complete(out, params.max_tokens)
        if stats:
            seconds = time.monotonic() - start
            err.print(f"{len(out.token_ids)} tokens in {seconds:.2f} s "
                      f"({len(out.token_ids) / seconds:.1f} tok/s), finish: {out.finish_reason}")


def _chat_or_text(service, prompt: str, raw: bool, system: str | None):
    """Chat messages for a model with a chat template (unless --raw), else the prompt as is."""
    if raw or not getattr(service.tokenizer, "chat_template", None):
        return prompt
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _write_answer(handle):
    """Write the answer to standard output as it arrives; its final output once it ends."""
    for delta in handle:
        sys.stdout.write(delta)
        sys.stdout.flush()
    out = handle.result()
    sys.stdout.write("\n")
    return out


def _check_complete(out, max_tokens: int | None = None) -> None:
    if out.finish_reason == "error":
        run_failed(f"{out.error}")
    if out.error:  # ended early for a reason of its own (e.g. it outgrew the KV pool): the answer is cut
        run_failed(f"the answer was cut short ({out.finish_reason}): {out.error}")
    if out.finish_reason == "length" and max_tokens is not None and len(out.token_ids) >= max_tokens:
        err.print(f"[yellow]note:[/] the answer stopped at --max-tokens ({max_tokens} tokens); raise it for more")


def _blocks(value: str | None, option: str) -> int | None:
    """An option's text as a count of blocks >= 1 (None stays None); ValueError naming the option otherwise."""
    if value is None:
        return None
    try:
        blocks = int(value)
    except ValueError:
        blocks = 0
    if blocks < 1:
        raise ValueError(f"{option} {value}: must be a whole number of blocks >= 1")
    return blocks


@app.command(epilog="Example:\n\n  zipage models")
def models():
    """List the built-in models, the random-weight presets and the models in the local cache."""
    from zipage.engine.loading.loader import list_models

    table = Table(title="Zipage models")
    table.add_column("name", style="bold")
    table.add_column("kind")
    table.add_column("available offline")
    table.add_column("description / path", overflow="fold")  # a path wraps whole, never cut
    for row in list_models():
        offline = row.get("available")
        # What a GGUF's weights run as on the CPU (weight_dtype auto); other models run in --dtype.
        runs_at = f"\nCPU weights: {row['runs_at']}" if row.get("runs_at") else ""
        table.add_row(row["name"], row.get("kind", ""), "yes" if offline else ("-" if offline is None else "no"),
                      str(row.get("path") or row.get("description", "")) + runs_at)
    Console().print(table)


app.add_typer(eval_app, name="eval")


def _engine_process(engine_kwargs: dict):
    """The engine in a child process (for the server): this process keeps the interpreter to itself."""
    from zipage.engine.config import EngineConfig
    from zipage.engine.api.process import EngineProcess

    return EngineProcess(EngineConfig.from_kwargs(**engine_kwargs))


# Interactive commands (chat, top, serve) keep a CPU step near this long while a prompt is prefilled,
# and give a step half the tokens a batch run does: a long prompt then pauses the other streams half
# as long for the same time to its first token (docs/design-notes.md, "Scheduling"); one-shot
# generate and bench keep the engine's defaults.
INTERACTIVE_CPU_STEP_MS = 250
INTERACTIVE_STEP_TOKENS = 2048


def interactive(engine_kwargs: dict) -> dict:
    """The knobs of an engine that serves people as they watch, unless the user chose otherwise."""
    return {"cpu_step_target_ms": INTERACTIVE_CPU_STEP_MS, "max_num_batched_tokens": INTERACTIVE_STEP_TOKENS,
            **engine_kwargs}


def _nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded, read off the file system (torch takes seconds to import)."""
    return os.path.exists("/proc/driver/nvidia/version") or any(
        name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev") if os.path.isdir("/dev"))


def preflight(engine_kwargs: dict) -> None:
    """The refusals that need no torch, made before loading it: a model name or file that does not
    exist, CUDA asked for on a machine without an NVIDIA driver. ValueError, as the engine's own."""
    from zipage.engine.loading.loader import model_kind

    model_kind(engine_kwargs.get("model") or DEFAULT_MODEL)
    device = engine_kwargs.get("device") or ""
    if device.startswith("cuda") and not _nvidia_driver_present():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine (no NVIDIA driver)")


def _load_engine(engine_kwargs: dict, start=None):
    """Start the engine (an EngineThread, or what `start(engine_kwargs)` returns) behind a spinner; bad
    knobs or models exit with status 2, Ctrl+C with 130."""
    interrupted = []

    def on_interrupt(signum, frame):
        # Remembered as well as raised: an import deep inside the load may swallow the exception.
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        with exit_on_interrupt(), usage_errors():
            preflight(engine_kwargs)
            try:
                with err.status(f"loading {engine_kwargs.get('model', DEFAULT_MODEL)}..."):
                    engine = (start or _engine_thread)(engine_kwargs)
            except RuntimeError as e:
                from zipage.engine.loading.loader import ModelUnavailable  # loaded already by whatever raised
                from zipage.engine.api.process import EngineGone

                if isinstance(e, ModelUnavailable):  # the built-in model is missing and could not be downloaded
                    usage_error(f"{e}")
                if not isinstance(e, EngineGone):
                    raise
                run_failed(f"{e}")  # the engine's own process did not come up
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        engine.close()
        raise typer.Exit(INTERRUPTED)
    return engine


def _attach(url: str, api_key: str | None, engine_kwargs: dict):
    """Connect to a running `zipage serve`; its engine is already configured, so engine options are refused."""
    from zipage.cli.serve.remote import RemoteEngine

    if engine_kwargs:
        options = ", ".join("--" + k.replace("_", "-") for k in engine_kwargs)
        usage_error(f"engine options ({options}) configure a local engine; with --attach the server's engine is used")
    with usage_errors(), err.status(f"connecting to {url}..."):
        return RemoteEngine(url, api_key)


SERVE_LIMITS_PANEL = "Limits and shutdown"
ATTACH_HELP = "Use the engine of a running `zipage serve` at this URL (e.g. http://127.0.0.1:8000)."
API_KEY_HELP = "The server's API key, with --attach."
SAVED_PANEL = "Saved chats"


def _check_writable(path: str | None, option: str) -> None:
    """Fail before a long run, not after it, when its results could not be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        usage_error(f"{option} {path}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        usage_error(f"{option} {path}: not writable")


def _check_theme(theme: str) -> None:
    from zipage.cli.console.themes import check_theme

    with usage_errors():
        check_theme(theme)


@app.command(epilog="Examples:\n\n  zipage chat\n\n"
                    "  zipage chat --sessions 3 --theme light --temperature 0.3\n\n"
                    "  zipage chat --plain --max-tokens 128\n\n"
                    "  printf 'Hi!\\nName three planets.\\n' | zipage chat --plain --temperature 0\n\n"
                    "  zipage chat --attach http://127.0.0.1:8000   (chat with a running zipage serve)\n\n"
                    "  zipage chat --resume   (reopen the sessions the last chat left open)\n\n"
                    "  zipage chat --list-saved;  zipage chat --export 3 --output chat.md\n\n"
                    "Keys: Ctrl+N new session, Alt+W close, Alt+←/→ switch, ↑/↓ earlier messages, "
                    "Ctrl+B send to all sessions, Esc or Ctrl+C stop the answer (Ctrl+C twice quits), F3 or Alt+K what the "
                    "answer's KV still holds, F4 or Alt+P how likely each of its tokens was, Ctrl+O or Alt+O saved "
                    "chats, Ctrl+T theme, F1 help, Ctrl+Q quit.")
@engine_options
def chat(
    session: str = typer.Argument(None, metavar="SESSION", show_default=False,
                                  help="With --resume: the saved session to reopen, by number or name."),
    plain: bool = typer.Option(False, "--plain", metavar="", help="Line-mode chat instead of the full-screen app (also used when "
                                           "standard input or output is not a terminal)."),
    sessions: int = typer.Option(1, min=1, max=16, help="Chat sessions to open at start."),
    temperature: float = typer.Option(0.7, help="Sampling temperature of new sessions; 0 = greedy."),
    max_tokens: int = typer.Option(512, help="Most tokens per answer in new sessions."),
    system: str = typer.Option(None, help="A system message for new sessions."),
    theme: str = typer.Option("dark", help="Colour theme: dark, light or high-contrast."),
    attach: str = typer.Option(None, help=ATTACH_HELP),
    api_key: str = typer.Option(None, envvar="ZIPAGE_API_KEY", help=API_KEY_HELP),
    resume: bool = typer.Option(False, "--resume", metavar="", rich_help_panel=SAVED_PANEL,
                                help="Reopen the sessions the last chat left open; with SESSION, that saved session "
                                     "(zipage chat --list-saved lists them)."),
    no_save: bool = typer.Option(False, "--no-save", metavar="", rich_help_panel=SAVED_PANEL,
                                 help="Keep nothing of this chat on disk. Otherwise every session is saved as it "
                                      "goes, in $ZIPAGE_DATA (default ~/.local/share/zipage)."),
    list_saved: bool = typer.Option(False, "--list-saved", metavar="", rich_help_panel=SAVED_PANEL,
                                    help="List the saved sessions, then exit."),
    export_session: str = typer.Option(None, "--export", metavar="SESSION", rich_help_panel=SAVED_PANEL,
                                       help="Print a saved session (number or name) as Markdown, or write it to "
                                            "--output (JSON for a .json file), then exit."),
    output: str = typer.Option(None, "--output", metavar="PATH", rich_help_panel=SAVED_PANEL,
                               help="With --export: the file to write."),
    engine_kwargs: dict = None,
):
    """Chat in several concurrent sessions, with KV blocks, events, throughput and memory live beside.
    Every session is saved as it goes; --resume reopens them."""
    from zipage.engine.config import SamplingParams
    from zipage.cli.console.plain_chat import Conversation, run_plain

    if list_saved or export_session:
        _saved_chats_command(list_saved, export_session, output)
        return
    _check_theme(theme)
    with usage_errors():
        SamplingParams(temperature=temperature, max_tokens=max_tokens)
    if session is not None and not resume:
        usage_error(f"a saved session to reopen goes with --resume: zipage chat --resume {session}")
    store, resumed = _saved_chats(no_save, resume, session)
    if not plain and sys.stdin.isatty() and sys.stdout.isatty():
        if attach:
            _run_chat_app(_attach(attach, api_key, engine_kwargs), attach, theme, sessions, temperature, max_tokens,
                          system, store, resumed)
        else:
            _run_chat_app(lambda: _engine_thread(interactive(engine_kwargs)), engine_kwargs.get("model", DEFAULT_MODEL),
                          theme, sessions, temperature, max_tokens, system, store, resumed)
        return
    engine = _attach(attach, api_key, engine_kwargs) if attach else _load_engine(interactive(engine_kwargs))
    try:
        run_plain(engine, Conversation("chat", temperature, max_tokens, system),
                  saver=_saver(store, engine.config.model), resumed=resumed[0] if resumed else None)
    finally:
        engine.close()
        if store is not None:
            store.close()


def _saved_chats(no_save: bool, resume: bool, session: str | None):
    """The saved-chats file (None with --no-save) and the sessions --resume asks for (`session`, or what
    the last chat left open); a file that cannot be used is a one-line error before anything loads."""
    if no_save:
        if resume:
            usage_error("--resume reopens saved chats: leave out --no-save")
        return None, []
    from zipage.cli.console.saved.commands import to_resume
    from zipage.cli.console.saved.store import ChatStore

    with usage_errors():
        store = ChatStore()
        return store, to_resume(store, session) if resume else []


def _saver(store, model: str):
    from zipage.cli.console.saved.saver import ChatSaver

    return ChatSaver(store, model)


def _saved_chats_command(list_saved: bool, export_session: str | None, output: str | None) -> None:
    """--list-saved and --export: the saved chats alone, no model loaded."""
    from zipage.cli.console.saved.commands import export_saved, listing
    from zipage.cli.console.saved.store import ChatStore

    if output is not None and not export_session:
        usage_error("--output goes with --export SESSION")
    _check_writable(output, "--output")
    with usage_errors():
        store = ChatStore()
        try:
            if list_saved:
                Console().print(listing(store))
            else:
                note = export_saved(store, export_session, output, sys.stdout)
                if note:
                    err.print(note)
        finally:
            store.close()


def _engine_thread(engine_kwargs: dict):
    from zipage.engine.api.thread import EngineThread

    return EngineThread(**engine_kwargs)


def _run_chat_app(engine, model_name: str, theme: str, sessions: int, temperature: float, max_tokens: int,
                  system: str | None, store=None, resumed=()) -> None:
    """The full-screen chat draws at once; given a function that starts the engine (rather than an
    engine), it loads the model in the background."""
    from zipage.cli.console.chat import ChatApp

    saved_as = model_name if callable(engine) else engine.config.model  # an attached server's model, not its URL
    app = ChatApp(engine, theme, sessions, temperature, max_tokens, system, model_name=model_name,
                  saver=_saver(store, saved_as), resume=resumed)
    try:
        app.run()
    finally:
        if app.engine is not None:
            app.engine.close()
        if store is not None:
            store.close()
    if app.load_error is not None:
        usage_error(f"{app.load_error}")


@app.command(epilog="Examples:\n\n  zipage top\n\n"
                    "  zipage top --concurrency 16 --input-len 256 --output-len 1024 --rate 2\n\n"
                    "  zipage top --teach --num-kv-blocks 64 --block-size 16 --window 8\n\n"
                    "  zipage top --prompts questions.jsonl   (one {\"prompt\": \"...\"} per line)\n\n"
                    "  zipage top --attach http://127.0.0.1:8000   (watch a running zipage serve)\n\n"
                    "Keys: t teaching mode (pause), space one step, ↑/↓ select a request, k what its KV still "
                    "holds, p (teaching mode) how likely its tokens were, Ctrl+T theme, F1 help, q quit.")
@engine_options
def top(
    concurrency: int = typer.Option(8, min=1, help="Requests kept in flight."),
    input_len: int = typer.Option(128, min=1, help="Prompt length of synthetic requests, in tokens."),
    output_len: int = typer.Option(512, min=1, help="Tokens generated per request."),
    rate: float = typer.Option(None, min=0.001, help="Start at most this many requests per second."),
    prompts: str = typer.Option(None, help="JSONL file of prompts ({\"prompt\": ...} per line), cycled; "
                                           "default: random-token prompts."),
    teach: bool = typer.Option(False, "--teach", metavar="", help="Start in teaching mode: paused, one engine step per key press."),
    theme: str = typer.Option("dark", help="Colour theme: dark, light or high-contrast."),
    attach: str = typer.Option(None, help=ATTACH_HELP + " Its clients are the load: none is generated."),
    api_key: str = typer.Option(None, envvar="ZIPAGE_API_KEY", help=API_KEY_HELP),
    engine_kwargs: dict = None,
):
    """Watch the engine under load, block by block; teaching mode explains it one step at a time."""
    from zipage.engine.config import SamplingParams
    from zipage.cli.console.top import LoadGenerator, TopApp, check_prompts, prompt_source, read_prompts

    _check_theme(theme)
    if attach:
        if teach or prompts:
            usage_error("--teach and --prompts need a local engine; leave them out with --attach")
        engine = _attach(attach, api_key, engine_kwargs)
        try:
            TopApp(engine, None, theme).run()
        finally:
            engine.close()
        return
    with usage_errors():
        texts = read_prompts(prompts) if prompts else None
    engine = _load_engine(interactive(engine_kwargs))
    try:
        if texts is not None:
            with usage_errors():
                check_prompts(engine, texts, prompts)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=texts is None)
        source = prompt_source(engine, texts, input_len, engine.config.seed)
        TopApp(engine, LoadGenerator(engine, source, params, concurrency, rate), theme, teach).run()
    finally:
        engine.close()


@app.command(epilog="Examples:\n\n  zipage serve --model smollm2-135m\n\n"
                    "  zipage serve --model random:qwen3-0.6b --device cuda --port 8000 --api-key secret\n\n"
                    "Then: zipage top --attach http://127.0.0.1:8000, or any OpenAI client with "
                    "base_url http://127.0.0.1:8000/v1.")
@engine_options
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 opens the server to the network)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port."),
    api_key: str = typer.Option(None, envvar="ZIPAGE_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    log_level: str = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug."),
    max_body_mb: float = typer.Option(32.0, min=0.001, rich_help_panel=SERVE_LIMITS_PANEL,
                                      help="Largest request body, in MiB; a larger one gets 413 before it is read."),
    allowed_origins: str = typer.Option(None, rich_help_panel=SERVE_LIMITS_PANEL,
                                        help="Comma-separated web origins (e.g. https://app.example) whose pages may "
                                             "call the server (CORS). None by default."),
    keep_alive_timeout: float = typer.Option(5.0, min=0.1, rich_help_panel=SERVE_LIMITS_PANEL,
                                             help="Seconds an idle connection stays open, and the most a client may "
                                                  "take to send a request's headers."),
    max_connections: int = typer.Option(1000, min=1, rich_help_panel=SERVE_LIMITS_PANEL,
                                        help="Connections served at once; a request on one more gets 503."),
    shutdown_timeout: float = typer.Option(5.0, min=0.0, rich_help_panel=SERVE_LIMITS_PANEL,
                                           help="On SIGTERM or Ctrl+C, seconds open requests get to finish before "
                                                "they end with an error."),
    stall_timeout: float = typer.Option(60.0, min=0.1, rich_help_panel=SERVE_LIMITS_PANEL,
                                        help="/health answers 503 when requests are open and no engine step has "
                                             "finished for this many seconds."),
    engine_kwargs: dict = None,
):
    """Serve the model over an OpenAI-compatible HTTP API, with Prometheus metrics and a feed for the console.
    Limits, shutdown and metrics: docs/serving.md."""
    with usage_errors():
        preflight(engine_kwargs)  # before the server's modules bring torch in
    from zipage.cli.serve.guards import MIB, ServeLimits
    from zipage.cli.serve.lifecycle import serve as run_server

    limits = ServeLimits(max_body_bytes=int(max_body_mb * MIB), allowed_origins=_origins(allowed_origins),
                         keep_alive_s=keep_alive_timeout, max_connections=max_connections,
                         shutdown_grace_s=shutdown_timeout, stall_s=stall_timeout)
    engine = _load_engine(interactive(engine_kwargs), _engine_process)
    try:
        err.print(f"serving {engine.config.model} on {engine.first_snapshot.device} at http://{host}:{port}/v1")
        run_server(engine, host, port, api_key, log_level, limits)
    finally:
        engine.close()


def _origins(option: str | None) -> tuple[str, ...]:
    return tuple(origin.strip().rstrip("/") for origin in (option or "").split(",") if origin.strip())


@app.command(epilog="Examples:\n\n  zipage bench\n\n"
                    "  zipage bench --model random:qwen3-0.6b --mode zipage --mode fullkv --mode hf "
                    "--num-requests 64 --input-len 256 --output-len 2048 --json results.json\n\n"
                    "  zipage bench --mode zipage --mode fullkv --max-cache-blocks-per-seq 4")
@engine_options
def bench(
    mode: list[str] = typer.Option(["zipage", "fullkv"], "--mode",
                                   help="zipage (compression on, budgets as --budget-policy says), elastic (zipage "
                                        "with elastic budgets), fullkv (same engine, compression off) or hf "
                                        "(transformers continuous batching); repeat to compare, first is the base."),
    num_requests: int = typer.Option(16, min=1, help="Requests, all submitted at once."),
    input_len: int = typer.Option(128, min=1, help="Random prompt tokens per request."),
    output_len: int = typer.Option(256, min=1, help="Tokens generated per request (greedy, EOS ignored)."),
    repeats: int = typer.Option(3, min=1, help="Timed runs per mode, interleaved across modes, after a warm-up."),
    json_path: str = typer.Option(None, "--json", help="Also write the results as JSON here."),
    engine_kwargs: dict = None,
):
    """Throughput of Zipage against full KV and transformers on the same weights and prompts: median and
    spread of several interleaved runs per mode."""
    from zipage.cli.bench import MODES

    bad = [m for m in mode if m not in MODES]
    if bad:
        usage_error(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    _check_writable(json_path, "--json")
    model = engine_kwargs.pop("model", DEFAULT_MODEL)
    results = _run_bench_with_progress(model, mode, num_requests, input_len, output_len, repeats, engine_kwargs)
    title = (f"{model} · {num_requests} requests · {input_len} in / {output_len} out · {results['device']} · "
             f"median of {repeats} run{'s' if repeats != 1 else ''} per mode")
    _print_bench_table(results, title, base=mode[0])
    _print_bench_notes(results, base=mode[0])
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


def _run_bench_with_progress(model: str, modes: list[str], num_requests: int, input_len: int, output_len: int,
                             repeats: int, engine_kwargs: dict) -> dict:
    """run_bench with a progress bar per mode on stderr (plain lines when stderr is no terminal); a mode
    that fails to run exits with status 1."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from zipage.cli.bench import run_bench
    from zipage.cli.progress_lines import ProgressLines, is_terminal

    lines = None if is_terminal() else ProgressLines()
    with Progress(TextColumn("{task.description:<8}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                  TimeElapsedColumn(), console=err, disable=lines is not None) as bar, \
            (lines or contextlib.nullcontext()):
        total = num_requests * output_len * repeats
        tasks = {m: bar.add_task(m, total=total, start=False) for m in modes}

        def progress(m: str, done: int, total: int) -> None:
            if lines is not None:
                lines.update(m, done, total)
                return
            bar.start_task(tasks[m])
            bar.update(tasks[m], completed=done)

        # Errors are printed inside the bar's block, so that they land under the bars as they stood.
        with usage_errors():
            try:
                return run_bench(model, modes, num_requests, input_len, output_len, engine_kwargs, progress,
                                 repeats=repeats, note=lambda line: bar.console.print(f"[yellow]note:[/] {line}"))
            except RuntimeError as e:  # a mode failed to run
                run_failed(f"{e}")


def _print_bench_table(results: dict, title: str, base: str) -> None:
    table = Table(title=title)
    for column in ("mode", "tok/s", "spread (min–max)", "time (s)", "output tokens", "peak concurrency",
                   f"vs {base}"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results["results"]:
        low, high = r["spread"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}×" + (" (noise)" if r["within_noise"] else "")
        table.add_row(r["mode"], f"{r['tokens_per_s']:.1f}", f"{low:.1f}–{high:.1f}", f"{r['seconds']:.2f}",
                      str(r["output_tokens"]), "-" if r["peak_concurrency"] is None else str(r["peak_concurrency"]),
                      ratio)
    Console().print(table)


def _print_bench_notes(results: dict, base: str) -> None:
    """Say which differences are only noise, and what compression could buy where the KV pool is the limit."""
    noisy = [r["mode"] for r in results["results"] if r["within_noise"]]
    if noisy:
        Console().print(f"(noise): the runs of {', '.join(noisy)} overlap those of {base}; the difference is "
                        "inside the run-to-run noise of this machine, not a result.")
    footprint = results.get("kv_footprint")
    if footprint:
        Console().print(f"KV footprint of this workload: full KV holds {footprint['full_kv_blocks']:.1f} blocks per "
                        f"request on average, Zipage {footprint['zipage_blocks']:.1f}. When the pool is the limit, "
                        f"compression can buy up to {footprint['ratio']:.2f}× the concurrency.")


if __name__ == "__main__":
    app()
