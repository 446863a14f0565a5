"""A GGUF file re-quantized by llama.cpp (through llama-cpp-python), e.g. the default model's Q4_1 file
as llama.cpp's Q4_K_M mix, to run Zipage and llama.cpp on the types such files hold.

    python benchmarks/llama_cpp_quantize.py IN.gguf OUT.gguf --type Q4_K_M

Run it under an interpreter with llama-cpp-python (the `bench-llama` extra). A quantized input is
re-quantized (its values are the input's dequantized ones), so the output suits speed runs and
agreement with its own dequantized values, not quality against the original model.
"""

from __future__ import annotations

import argparse
import ctypes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("--type", default="Q4_K_M", help="a llama.cpp file type: Q4_K_M, Q5_K_M, Q8_0, ...")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        raise SystemExit(f"llama.cpp has no file type {args.type!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, args.threads
    if llama_cpp.llama_model_quantize(args.source.encode(), args.target.encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not quantize {args.source}")


if __name__ == "__main__":
    main()
