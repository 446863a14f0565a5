"""The `zipage` command line."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.table import Table

from zipage_cli.options import engine_options

app = typer.Typer(
    name="zipage",
    help="Zipage: LLM inference with a bounded KV cache per request, and a console to watch it work.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)
err = Console(stderr=True)


@app.command(epilog="Examples:\n\n  zipage generate \"Why is the sky blue?\"\n\n"
                    "  echo \"Write a haiku about GPUs\" | zipage generate --max-tokens 64\n\n"
                    "  zipage generate --raw --temperature 0 \"The capital of France is\"")
@engine_options
def generate(
    prompt: str = typer.Argument(None, help="The prompt; read from standard input when omitted."),
    max_tokens: int = typer.Option(512, help="Most tokens to generate."),
    temperature: float = typer.Option(0.7, help="Sampling temperature; 0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, help="Sample from the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, help="Drop tokens below min_p times the top probability."),
    repetition_penalty: float = typer.Option(1.0, help="Penalty for tokens already in the context."),
    sample_seed: int = typer.Option(None, "--sample-seed", help="Seed for this request's sampling."),
    raw: bool = typer.Option(False, help="Send the prompt as is, without the model's chat template."),
    system: str = typer.Option(None, help="A system message for the chat template."),
    stats: bool = typer.Option(False, help="Print tokens, time and throughput to stderr at the end."),
    engine_kwargs: dict = None,
):
    """Stream the model's answer to a prompt to standard output."""
    import time

    from engine.config import SamplingParams
    from engine.service import EngineThread

    if prompt is None:
        if sys.stdin.isatty():
            err.print("[red]error:[/] give a prompt as an argument or on standard input")
            raise typer.Exit(2)
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            err.print(f"[red]error:[/] standard input is not valid UTF-8: {e}")
            raise typer.Exit(2)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                repetition_penalty=repetition_penalty, max_tokens=max_tokens, seed=sample_seed)
        with err.status("loading model..."):
            service = EngineThread(**engine_kwargs)
    except ValueError as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)
    try:
        messages = None
        if not raw and getattr(service.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
        start = time.monotonic()
        handle = service.submit(messages or prompt, params, session="cli")
        for delta in handle:
            sys.stdout.write(delta)
            sys.stdout.flush()
        out = handle.result()
        sys.stdout.write("\n")
        if out.finish_reason == "error":
            err.print(f"[red]error:[/] {out.error}")
            raise typer.Exit(1)
        if stats:
            seconds = time.monotonic() - start
            err.print(f"{len(out.token_ids)} tokens in {seconds:.2f} s "
                      f"({len(out.token_ids) / seconds:.1f} tok/s), finish: {out.finish_reason}")
    except ValueError as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)
    except KeyboardInterrupt:
        service.abort(handle)
        raise typer.Exit(130)
    finally:
        service.close()


@app.command(epilog="Example:\n\n  zipage models")
def models():
    """List the built-in models, the random-weight presets and the models in the local cache."""
    from engine.loader import list_models

    table = Table(title="Zipage models")
    table.add_column("name", style="bold")
    table.add_column("kind")
    table.add_column("available offline")
    table.add_column("description / path")
    for row in list_models():
        offline = row.get("available")
        table.add_row(row["name"], row.get("kind", ""), "yes" if offline else ("-" if offline is None else "no"),
                      str(row.get("path") or row.get("description", "")))
    Console().print(table)


eval_app = typer.Typer(help="Measure answer quality under compression.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


@eval_app.command("fidelity", epilog="Examples:\n\n  zipage eval fidelity\n\n"
                                     "  zipage eval fidelity --num-prompts 4 --tokens 256 --budgets 4,8 --json f.json")
def eval_fidelity(
    model: str = typer.Option("smollm2-135m", help="Model to evaluate."),
    num_prompts: int = typer.Option(16, help="Prompts (up to 16 built in)."),
    tokens: int = typer.Option(1024, help="Greedy tokens generated per prompt by full KV."),
    budgets: str = typer.Option("4,8,16", help="Block budgets to test, comma-separated."),
    block_size: int = typer.Option(32, help="Tokens per block."),
    window: int = typer.Option(16, help="Observation window."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    json_path: str = typer.Option(None, "--json", help="Write the results as JSON here."),
):
    """Teacher-forced top-1 agreement and KL divergence of compressed KV against full KV, for the
    scoring ablations and two baselines (random eviction; sinks + most recent) at equal budgets."""
    import json

    from zipage_cli import fidelity

    try:
        budget_list = [int(b) for b in budgets.split(",")]
        results = fidelity.run(model, num_prompts, tokens, budget_list, block_size, window, device,
                               progress=lambda line: err.print(line))
    except ValueError as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)
    Console().print(fidelity.markdown_table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app()
