"""A one-row decode step's skinny products, layer after layer, replayed as one CUDA graph: launched
the plain way, and with programmatic dependent launch (each product starts while the one before
it finishes, asks L2 for the first lines of its weights, then waits for its x).

    python3 benchmarks/gpu_product_chain.py --json out.json
    python3 benchmarks/gpu_product_chain.py --models qwen3-0.6b --lines plain,0,4,16,64 --repeats 3
    python3 benchmarks/gpu_product_chain.py --models qwen3-0.6b --sweep table.json

Per layer, as the engine runs one row: QKV with the add + RMSNorm folded in, O, gate/up with the
add + RMSNorm folded in, down with SiLU-and-multiply folded in (attention and the RoPE/store
kernels left out); random bf16 weights, every layer its own. --lines: `plain`, or the 128-byte
lines of each weight row prefetched under PDL (0: PDL without prefetch). Every variant's output is
checked bit for bit against the plain launch's. Bandwidth is on the weight bytes.

--sweep PATH: instead, the one-row config of each product chosen inside the chain, launched as the
engine launches it: for each shape in turn, the committed table's config and then each of
`one_row_candidates` timed as the whole chain's graph; a candidate replaces the config kept when it is
at least 1.5% faster and its output within 2e-2 of the committed table's. Then the committed and the
chosen tables, interleaved --repeats times; PATH gets the chosen table in the format
`gpu_skinny.load_table` reads (so `gpu_decode.py --skinny-table PATH` runs an engine with it).
"""

from __future__ import annotations

import dataclasses
import json

import torch

import bench_common

MODELS = {  # name: (hidden, q width, kv width, intermediate, layers)
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
    "qwen3-8b": (4096, 4096, 1024, 12288, 36),
}
PRODUCTS = ("qkv", "o", "gate_up", "down")
SWEEP_ORDER = ("qkv", "gate_up", "down", "o")


def one_row_candidates(name: str) -> list:
    """The one-row configs --sweep tries per Qwen3-0.6B product besides the committed one (the
    committed run tried these around the table before it, whose configs are among them)."""
    from zipage.kernels.triton_linear import Config as C

    return {
        "qkv": [C(16, 256, dot=False), C(16, 1024, dot=False), C(8, 1024, dot=False), C(32, 512, dot=False),
                C(32, 256, dot=False), C(16, 512, split_k=2, dot=False), C(16, 512, dot=False, num_stages=2)],
        "o": [C(32, 256, split_k=4), C(16, 256, split_k=8, dot=False), C(16, 512, split_k=4, dot=False),
              C(32, 128, split_k=8), C(64, 256, split_k=8), C(32, 256, split_k=8, num_stages=2)],
        "gate_up": [C(16, 1024, dot=False), C(32, 512, dot=False), C(16, 512, dot=False), C(8, 1024, dot=False),
                    C(16, 512, split_k=2, dot=False), C(16, 512, dot=False, num_stages=2)],
        "down": [C(32, 256, split_k=8), C(64, 128, split_k=8), C(32, 128, split_k=4), C(16, 256, split_k=8, dot=False),
                 C(32, 128, split_k=8), C(32, 128, split_k=8, num_stages=2)],
    }[name]


def layer_weights(hidden: int, q: int, kv: int, inter: int, gen: torch.Generator) -> dict:
    def weight(n, k):
        return torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    def norm():
        return torch.rand(hidden, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5

    return dict(qkv=weight(q + 2 * kv, hidden), o=weight(hidden, q), gate_up=weight(2 * inter, hidden),
                down=weight(hidden, inter), norm1=norm(), norm2=norm())


def replay_us(graph) -> float:
    import triton.testing

    return triton.testing.do_bench(graph.replay, warmup=5, rep=200, return_mode="median") * 1e3


def sweep(model: str, weights: list, chain, repeats: int, path: str) -> dict:
    """--sweep: the one-row configs chosen by coordinate descent inside the chain (module docstring)."""
    from zipage.kernels import triton_linear as tl_lin

    shapes = {name: tuple(weights[0][name].shape) for name in PRODUCTS}
    committed = {name: tl_lin.pick_config(*shapes[name], 1, torch.device("cuda")) for name in PRODUCTS}
    base_graph, base_out = bench_common.graph_of(lambda: chain(None, committed))
    chosen, trials = dict(committed), []
    for name in SWEEP_ORDER:
        kept_us = replay_us(bench_common.graph_of(lambda: chain(None, chosen))[0])
        for config in one_row_candidates(name):
            trial = dict(chosen, **{name: config})
            graph, out = bench_common.graph_of(lambda: chain(None, trial))
            us = replay_us(graph)
            err = ((out.float() - base_out.float()).norm() / base_out.float().norm()).item()
            row = dict(model=model, product=name, config=str(config), us=us, kept_us=kept_us, rel_err=err)
            trials.append(row)
            print(json.dumps(row), flush=True)
            if us < 0.985 * kept_us and err < 2e-2:
                chosen[name], kept_us = config, us
    chosen_graph, _ = bench_common.graph_of(lambda: chain(None, chosen))
    rounds = [dict(committed_us=replay_us(base_graph), chosen_us=replay_us(chosen_graph)) for _ in range(repeats)]
    print(json.dumps(dict(rounds=rounds, chosen={k: str(v) for k, v in chosen.items()})), flush=True)
    table = {f"{n}x{k}": [dataclasses.asdict(c) for c in pair] for (n, k), pair in tl_lin.TABLE.items()}
    for name, (n, k) in shapes.items():
        table[f"{n}x{k}"] = [dataclasses.asdict(chosen[name]),
                             dataclasses.asdict(tl_lin.pick_config(n, k, 2, torch.device("cuda")))]
    with open(path, "w") as f:
        json.dump({"table": table}, f, indent=1)
    return dict(trials=trials, rounds=rounds, chosen={k: str(v) for k, v in chosen.items()})


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "")
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--lines", default="plain,0,4,16,64")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants; the median is kept")
    parser.add_argument("--sweep", default=None, help="choose the one-row configs in the chain; write the table here")
    args = bench_common.parse_args(parser, argv)
    if args.sweep and args.models != "qwen3-0.6b":
        parser.error("--sweep takes --models qwen3-0.6b (its candidates are that model's products)")

    from zipage.kernels import triton_linear as tl_lin

    results = {**bench_common.device_description("cuda"), "args": vars(args), "rows": []}
    for model in args.models.split(","):
        hidden, q, kv, inter, layers = MODELS[model]
        gen = torch.Generator("cuda").manual_seed(0)
        weights = [layer_weights(hidden, q, kv, inter, gen) for _ in range(layers)]
        nbytes = sum(L[name].numel() * 2 for L in weights for name in PRODUCTS)
        x0 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        r0 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)

        def chain(pdl: int | None, configs: dict | None = None) -> torch.Tensor:
            """The step's products; pdl None launches them as the engine does."""
            cfg = configs or {}
            x, r = x0, r0
            for L in weights:
                y, r = tl_lin.skinny_matmul(x, L["qkv"], None, tl_lin.ADD_NORM, r, L["norm1"], 1e-6,
                                            config=cfg.get("qkv"), pdl=pdl)
                o, _ = tl_lin.skinny_matmul(y[:, :q], L["o"], None, config=cfg.get("o"), pdl=pdl)
                gu, r = tl_lin.skinny_matmul(o, L["gate_up"], None, tl_lin.ADD_NORM, r, L["norm2"], 1e-6,
                                             config=cfg.get("gate_up"), pdl=pdl)
                x, _ = tl_lin.skinny_matmul(gu, L["down"], None, tl_lin.SILU_MUL, config=cfg.get("down"), pdl=pdl)
            return x

        if args.sweep:
            results["sweep"] = sweep(model, weights, chain, args.repeats, args.sweep)
            bench_common.write_json(args.json, results)
            return results
        graphs, outputs = {}, {}
        for label in args.lines.split(","):
            graphs[label], outputs[label] = bench_common.graph_of(lambda: chain(-1 if label == "plain" else int(label)))
        times = {label: [] for label in graphs}
        for _ in range(args.repeats):
            for label, graph in graphs.items():
                times[label].append(replay_us(graph))
        base = outputs.get("plain")
        for label, us in times.items():
            us = sorted(us)[len(us) // 2]
            row = dict(model=model, launch="plain" if label == "plain" else f"pdl, {label} lines", us=us,
                       weight_TBps=nbytes / (us * 1e-6) / 1e12, products=4 * layers,
                       same_as_plain=None if base is None else bool(torch.equal(outputs[label], base)))
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del weights, graphs, outputs
        torch.cuda.empty_cache()
    bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
