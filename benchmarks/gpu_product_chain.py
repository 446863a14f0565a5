"""A one-row decode step's skinny products, layer after layer, replayed as one CUDA graph: launched
the plain way, and with programmatic dependent launch (each product starts while the one before
it finishes, asks L2 for the first lines of its weights, then waits for its x).

    python3 benchmarks/gpu_product_chain.py --json out.json
    python3 benchmarks/gpu_product_chain.py --models qwen3-0.6b --lines plain,0,4,16,64 --repeats 3

Per layer, as the engine runs one row: QKV with the add + RMSNorm folded in, O, gate/up with the
add + RMSNorm folded in, down with SiLU-and-multiply folded in (attention and the RoPE/store
kernels left out); random bf16 weights, every layer its own. --lines: `plain`, or the 128-byte
lines of each weight row prefetched under PDL (0: PDL without prefetch). Every variant's output is
checked bit for bit against the plain launch's. Bandwidth is on the weight bytes.
"""

from __future__ import annotations

import json

import torch

import bench_common

MODELS = {  # name: (hidden, q width, kv width, intermediate, layers)
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
    "qwen3-8b": (4096, 4096, 1024, 12288, 36),
}


def layer_weights(hidden: int, q: int, kv: int, inter: int, gen: torch.Generator) -> dict:
    def weight(n, k):
        return torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    def norm():
        return torch.rand(hidden, generator=gen, device="cuda", dtype=torch.bfloat16) + 0.5

    return dict(qkv=weight(q + 2 * kv, hidden), o=weight(hidden, q), gate_up=weight(2 * inter, hidden),
                down=weight(hidden, inter), norm1=norm(), norm2=norm())


def main(argv=None) -> dict:
    parser = bench_common.parser(__doc__, "")
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--lines", default="plain,0,4,16,64")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants; the median is kept")
    args = bench_common.parse_args(parser, argv)

    import triton.testing

    from zipage.kernels import triton_linear as tl_lin

    results = {**bench_common.device_description("cuda"), "args": vars(args), "rows": []}
    for model in args.models.split(","):
        hidden, q, kv, inter, layers = MODELS[model]
        gen = torch.Generator("cuda").manual_seed(0)
        weights = [layer_weights(hidden, q, kv, inter, gen) for _ in range(layers)]
        nbytes = sum(L[name].numel() * 2 for L in weights for name in ("qkv", "o", "gate_up", "down"))
        x0 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        r0 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)

        def chain(pdl: int) -> torch.Tensor:
            x, r = x0, r0
            for L in weights:
                y, r = tl_lin.skinny_matmul(x, L["qkv"], None, tl_lin.ADD_NORM, r, L["norm1"], 1e-6, pdl=pdl)
                o, _ = tl_lin.skinny_matmul(y[:, :q], L["o"], None, pdl=pdl)
                gu, r = tl_lin.skinny_matmul(o, L["gate_up"], None, tl_lin.ADD_NORM, r, L["norm2"], 1e-6, pdl=pdl)
                x, _ = tl_lin.skinny_matmul(gu, L["down"], None, tl_lin.SILU_MUL, pdl=pdl)
            return x

        graphs, outputs = {}, {}
        for label in args.lines.split(","):
            pdl = -1 if label == "plain" else int(label)
            chain(pdl)  # compile and warm outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs[label] = chain(pdl)
            graph.replay()
            torch.cuda.synchronize()
            graphs[label] = graph
        times = {label: [] for label in graphs}
        for _ in range(args.repeats):
            for label, graph in graphs.items():
                times[label].append(triton.testing.do_bench(graph.replay, warmup=5, rep=200, return_mode="median"))
        base = outputs.get("plain")
        for label, ms in times.items():
            ms = sorted(ms)[len(ms) // 2]
            row = dict(model=model, launch="plain" if label == "plain" else f"pdl, {label} lines", us=ms * 1e3,
                       weight_TBps=nbytes / (ms * 1e-3) / 1e12, products=4 * layers,
                       same_as_plain=None if base is None else bool(torch.equal(outputs[label], base)))
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del weights, graphs, outputs
        torch.cuda.empty_cache()
    bench_common.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
