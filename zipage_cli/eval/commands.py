"""`zipage eval`: one subcommand per task, sharing the options of eval_common."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable, NoReturn

import typer
from rich.console import Console

from zipage.cli.eval import common as ec
from zipage.engine.config import DEFAULT_MODEL

eval_app = typer.Typer(help="Measure answer quality under compression: a basket of tasks, each against full KV "
                            "and two baselines at equal budgets.", no_args_is_help=True)
err = Console(stderr=True)

SHARED = [
    ("model", str, DEFAULT_MODEL, "Model to evaluate."),
    ("split", str, "report", "Samples: 'selection' (to tune on) or 'report' (seeded, disjoint)."),
    ("budgets", str, "25%,50%,75%", "KV budgets, comma-separated: shares of each sample's context (50%) or blocks (8)."),
    ("configurations", str, None, f"Rows separated by ';' (default: {'; '.join(ec.SUITE)}). "
                                  f"Known: {'; '.join(ec.CONFIGURATIONS)}."),
    ("block_size", int, 32, "Tokens per block."),
    ("window", int, 16, "Observation window."),
    ("device", str, "cpu", "cpu or cuda."),
    ("threads", int, None, "Intra-op CPU threads (default: chosen as the engine's --cpu-threads is: one per "
                           "CPU that other jobs leave idle)."),
    ("json_path", str, None, "Write the results here as JSON, rewritten as each cell finishes."),
    ("trace", str, None, "Write into this folder, for each sample of each compressed run, an SVG of what its "
                         "KV cache held after each compression (one row per compression, colour = share of "
                         "layers and heads holding each token)."),
    ("quick", bool, False, "A first answer in a minute or two on a small CPU: one budget (50%), the default "
                           "configuration against full KV, and the task's smallest sample (options given "
                           "explicitly still count)."),
]
# What --quick sets where an option keeps its default value.
QUICK_SHARED = {"budgets": "50%", "configurations": "default"}


def shared_options(func):
    """Append the options every task shares, plus repeatable --set KNOB=VALUE."""
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    for name, typ, default, help_text in SHARED:
        decl = {"json_path": ["--json"], "quick": ["--quick"]}.get(name, [])
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=typ,
                                        default=typer.Option(default, *decl, help=help_text)))
    params.append(inspect.Parameter(
        "settings", inspect.Parameter.KEYWORD_ONLY, annotation=list[str],
        default=typer.Option([], "--set", metavar="KNOB=VALUE",
                             help="An engine knob applied on top of every row, for sweeps (repeatable); also "
                                  "pool_share=X: a KV pool of X times what each group of samples holds in full.")))

    @functools.wraps(func)
    def wrapper(**kwargs):
        shared = {name: kwargs.pop(name) for name, *_ in SHARED}
        shared["settings"] = kwargs.pop("settings")
        return func(shared=shared, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=[p for p in params if p.name != "shared"])
    return wrapper


def quick_options(shared: dict, options: dict, quick: dict, defaults: dict) -> tuple[dict, dict]:
    """The shared and task options with --quick's values wherever an option keeps its default."""
    shared_defaults = {name: default for name, _, default, _ in SHARED}
    shared = {**shared, **{k: v for k, v in QUICK_SHARED.items() if shared[k] == shared_defaults[k]}}
    options = {**options, **{k: v for k, v in quick.items() if options[k] == defaults[k]}}
    return shared, options


def run_task(module, shared: dict, **task_options) -> None:
    """Parse the shared options, run the task with progress bars, print its table; bad options exit 2."""
    from zipage.engine.execution.cpu_threads import use_cpu_threads

    try:
        if shared["threads"] is not None:
            ec.check_count("threads", shared["threads"])
        ec.check_trace_folder(shared["trace"])
        if shared["device"] == "cpu":  # once for every engine of the run, as an engine chooses them
            use_cpu_threads(shared["threads"])
        kwargs = dict(model=shared["model"], split=shared["split"], budgets=ec.parse_budgets(shared["budgets"]),
                      configurations=ec.parse_configurations(shared["configurations"]),
                      settings=ec.parse_settings(shared["settings"]), block_size=shared["block_size"],
                      window=shared["window"], device=shared["device"], json_path=shared["json_path"],
                      trace=shared["trace"])
        with ec.Progress(True) as bars:
            results = module.run(**kwargs, **task_options, progress=bars)
    except ValueError as e:
        _bad_input(f"{e}")
    typer.echo(ec.markdown_table(results, getattr(module, "cell", None)))


def _bad_input(message: str) -> NoReturn:
    err.print(f"[red]error:[/] {message}")
    raise typer.Exit(2)


def task_command(name: str, example: str, quick: dict, parse: dict[str, Callable[[str, str], object]] | None = None):
    """Register `zipage eval NAME` for the task module zipage.cli.eval.NAME. The decorated function only
    declares the task's own options (its docstring is the help); they reach the module's run() as they
    are, or through parse[option](flag, text) for those given there. The shared options are appended.
    `quick`: the task's options under --quick."""

    def register(declare):
        defaults = {p.name: p.default.default for p in inspect.signature(declare).parameters.values()}

        @eval_app.command(name, epilog=f"Example:\n\n  {example}\n\n  zipage eval {name} --quick")
        @shared_options
        @functools.wraps(declare)
        def command(shared: dict = None, **options):
            if shared.pop("quick"):
                shared, options = quick_options(shared, options, quick, defaults)
            for option, parser in (parse or {}).items():
                options[option] = parser("--" + option.replace("_", "-"), options[option])
            # Imported on use: a task pulls in torch, which `zipage --help` need not wait for.
            run_task(importlib.import_module(f"zipage.cli.eval.{name}"), shared, **options)

        return command

    return register


def _ints(option: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected integers separated by commas", param_hint=option) from None


@task_command("fidelity", "zipage eval fidelity --num-samples 2 --tokens 256 --budgets 4,8",
              quick={"num_samples": 1, "tokens": 96})
def fidelity_command(
    num_samples: int = typer.Option(4, help="Prompts from the split (8 per split)."),
    tokens: int = typer.Option(384, help="Greedy tokens generated per prompt by full KV, then teacher-forced."),
):
    """Teacher-forced top-1 agreement and KL divergence against full KV on free text."""


@task_command("needle", "zipage eval needle --lengths 1024,4096 --depths 0,50,100",
              quick={"lengths": "512", "depths": "50"}, parse={"lengths": _ints, "depths": _ints})
def needle_command(
    num_samples: int = typer.Option(1, help="Samples per length, depth and kind (single key / several keys)."),
    lengths: str = typer.Option("512,1024", help="Prompt lengths in tokens, comma-separated."),
    depths: str = typer.Option("0,50,100", help="Depths of the asked key, in % of the text (0 = first)."),
):
    """Key retrieval through a compressed prompt (needle in a haystack): exact-match accuracy per depth."""


@task_command("recall", "zipage eval recall --tokens 768 --num-samples 4",
              quick={"num_samples": 2, "tokens": 128})
def recall_command(
    num_samples: int = typer.Option(8, help="Samples (one fact each)."),
    tokens: int = typer.Option(384, help="Story tokens forced between the fact and the question."),
):
    """A fact, a long teacher-forced story compressed during decoding, then the question: exact match."""


@task_command("vartrack", "zipage eval vartrack --hops 3 --length 1024",
              quick={"num_samples": 2, "length": 256})
def vartrack_command(
    num_samples: int = typer.Option(12, help="Samples."),
    length: int = typer.Option(512, help="Prompt length in tokens."),
    hops: int = typer.Option(2, help="Variables in the asked chain (VAR A = 12345, VAR B = VAR A, ...)."),
):
    """Variable tracking through a compressed prompt: follow a chain of assignments (multi-step)."""


@eval_app.command("leaderboard", epilog="Example:\n\n  zipage eval leaderboard needle.json recall.json fidelity.json")
def leaderboard_command(paths: list[str] = typer.Argument(..., help="JSON results written by the tasks' --json.")):
    """One table from several tasks' JSON results: configuration x task x budget."""
    import json

    results = []
    for path in paths:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:
            _bad_input(f"{path}: {e}")
    typer.echo(ec.leaderboard(results))
