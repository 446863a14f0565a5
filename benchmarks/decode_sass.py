"""What the decode attention kernel compiles to on Hopper, without a GPU: registers, spills, shared
memory and the instruction mix of its key loops, from Triton's own ptxas and cuobjdump for sm_90.

    python3 benchmarks/decode_sass.py --cache int8
    python3 benchmarks/decode_sass.py --cache fp8 --warps 2 --tile 32 --max-registers 0 --json out.json
    python3 benchmarks/decode_sass.py --cache fp8 --sass fp8_loops.sass   # the loops' instructions themselves

A decode program's time goes to the instructions of its loop over key tiles, and its registers set
how many programs share an SM (65,536 registers a multiprocessor). Launch settings default to the
engine's (`triton_attention.DECODE_LAUNCH`); --max-registers 0 lifts the cap. --values-keys-first
compiles for a value cache laid out keys-contiguous within a block ([blocks, kv_heads, head_dim,
block_size]), which the engine does not use. Counts are static (instructions in the loop body, per
warp and tile), not timings; the kernel's speed is measured by gpu_decode_tiles.py on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import tempfile

CODE_TYPES = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}


def signature(fn, cache: str, constexprs: dict, values_keys_first: bool) -> tuple[dict, dict, dict]:
    """Triton types of the kernel's arguments as the engine passes them: unit strides become
    constants (Triton specialises them so at launch), other integers are multiples of 16, and the
    caches' descriptors (TMA) are tiles of BLOCK_N keys by HEAD_DIM."""
    quant = cache != "bf16"
    desc = (f"tensordesc<{CODE_TYPES[cache][1:]}[{constexprs['BLOCK_N']}, {constexprs['HEAD_DIM']}]>"
            if constexprs.get("TMA") else CODE_TYPES[cache])
    pointers = {"q_ptr": "*bf16", "k_ptr": CODE_TYPES[cache], "v_ptr": CODE_TYPES[cache],
                "k_desc": desc, "v_desc": desc,
                "ks_ptr": "*fp32" if quant else CODE_TYPES[cache], "vs_ptr": "*fp32" if quant else CODE_TYPES[cache],
                "table_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32",
                "acc_ptr": "*fp32"}
    unit = {"s_qd", "s_kd", "s_tn", "s_od", "ss_o", "s_vo" if values_keys_first else "s_vd"}
    unspecialised = {"table_width", "num_partitions", "min_partition", "s_tb"}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name in unit:
            sig[name] = "constexpr"
            consts[name] = constexprs.get(name, 1)
        elif name in pointers:
            sig[name] = pointers[name]
            if pointers[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in unspecialised:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of each loop: those between a backward branch and its target."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for addr, text in ins:
        target = re.search(r"BRA\s.*0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            found.append([t for a, t in ins if start <= a <= addr])
    return found


def instruction_mix(body: list[str]) -> collections.Counter:
    """A loop's instruction mix (opcodes without their modifiers or predicates)."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def copy_groups_left_at_wait(body: list[str]) -> int | None:
    """How many groups of asynchronous copies a loop leaves in flight where it waits for its tile
    (DEPBAR.LE SB0, N): 0 means it waits for every copy it issued, so a tile's load overlaps no
    computation of its own program; None: the loop issues no such wait."""
    for line in body:
        m = re.match(r"DEPBAR\.LE SB0, (0x[0-9a-f]+|\d+)", line)
        if m:
            return int(m.group(1), 0)
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", choices=sorted(CODE_TYPES), default="int8")
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--tile", type=int, default=None, help="keys a step of the loop")
    parser.add_argument("--stages", type=int, default=None, help="copy pipeline stages (default: the launch's)")
    parser.add_argument("--max-registers", type=int, default=None, help="0: no cap (default: the engine's)")
    parser.add_argument("--masked", action="store_true", help="every tile through the masked loop")
    # (the query is bf16, so an fp8 cache takes fp16 products as the engine's launch says)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--values-keys-first", action="store_true")
    parser.add_argument("--ptx-codes", choices=("auto", "on", "off"), default="auto",
                        help="8-bit codes meet fp16 products through codes_as's PTX (on), through the compiler's "
                             "casts (off), or as the engine's launch has it (auto)")
    parser.add_argument("--tma", choices=("auto", "on", "off"), default="auto",
                        help="whole tiles come by bulk copy (on; whole tiles for every cache), by each thread's "
                             "loads (off), or as the engine's launch has it (auto)")
    parser.add_argument("--table-ahead", type=int, default=None,
                        help="table entries the whole-tile loop holds in registers at a time (0: one loaded a tile; "
                             "default: the launch's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sass", default=None, help="write each loop's instructions to this file")
    args = parser.parse_args(argv)

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zipage.engine.execution.model_runner import KV_CODE_DTYPES
    from zipage.kernels import triton_attention as ta

    launch = ta.decode_launch(KV_CODE_DTYPES.get(args.cache, torch.bfloat16))
    if args.ptx_codes == "on":
        launch = launch.with_ptx_codes()
    elif args.ptx_codes == "off":
        launch = dataclasses.replace(launch, ptx_codes=False)
    if args.tma != "auto":  # (bulk copies are for whole tiles)
        launch = dataclasses.replace(launch, tma=args.tma == "on", whole_tiles=launch.whole_tiles or args.tma == "on")
    if args.table_ahead is not None:
        launch = dataclasses.replace(launch, table_ahead=args.table_ahead)
    warps, tile = args.warps or launch.warps, args.tile or launch.tile
    args.stages = args.stages or launch.stages
    cap = launch.max_registers if args.max_registers is None else (args.max_registers or None)
    constexprs = dict(GROUP=args.group, G_PAD=max(16, ta.next_pow2(args.group)), HEAD_DIM=args.head_dim,
                      D_PAD=max(16, ta.next_pow2(args.head_dim)), BLOCK_SIZE=args.block_size, BLOCK_N=tile,
                      SINGLE=True, PREC="tf32", QUANT=args.cache != "bf16",
                      WHOLE_TILES=launch.whole_tiles and not args.masked, F16=launch.fp16_products, PDL=False,
                      PTX=launch.fp16_products and launch.ptx_codes,
                      TMA=launch.tma and launch.whole_tiles and not args.masked, TABLE_AHEAD=launch.table_ahead)
    fn = ta._decode_partition_kernel
    sig, consts, attrs = signature(fn, args.cache, constexprs, args.values_keys_first)
    options = dict(num_warps=warps, num_stages=args.stages, **({"maxnreg": cap} if cap else {}))
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    resources = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    programs_per_sm = 65536 // (resources["reg"] * 32 * warps)
    # Hopper: 228 KB of shared memory a multiprocessor, 1 KB of it reserved per resident program
    bodies = loop_bodies(sass)
    by_shared = 228 * 1024 // (kernel.metadata.shared + 1024) if kernel.metadata.shared else None
    result = {"triton": triton.__version__, "cache": args.cache, "warps": warps, "tile": tile,
              "stages": args.stages, "max_registers": cap, "whole_tiles": constexprs["WHOLE_TILES"],
              "fp16_products": launch.fp16_products, "ptx_codes": launch.ptx_codes,
              "tma": constexprs["TMA"], "table_ahead": launch.table_ahead,
              "values_keys_first": args.values_keys_first, **resources, "shared": kernel.metadata.shared,
              "programs_per_sm_by_registers": programs_per_sm, "programs_per_sm_by_shared": by_shared,
              "loops": [{"instructions": len(body), "mix": dict(instruction_mix(body).most_common(14)),
                         "copy_groups_left_at_wait": copy_groups_left_at_wait(body)} for body in bodies]}
    print(f"{args.cache}, {warps} warps, {tile} keys a step, {args.stages} stages, register cap {cap}: "
          f"{resources['reg']} registers ({programs_per_sm} programs an SM), stack {resources['stack']} B, "
          f"shared {kernel.metadata.shared} B ({by_shared} programs an SM)")
    for i, loop in enumerate(result["loops"]):
        mix = ", ".join(f"{op} {n}" for op, n in loop["mix"].items())
        print(f"  loop {i}: {loop['instructions']} instructions a warp and tile, "
              f"{loop['copy_groups_left_at_wait']} copy groups left in flight at its wait: {mix}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.sass:
        with open(args.sass, "w") as f:
            for i, body in enumerate(bodies):
                f.write(f"// loop {i}: {len(body)} instructions a warp and tile\n" + "\n".join(body) + "\n")
    return result


if __name__ == "__main__":
    main()
