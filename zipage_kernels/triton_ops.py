"""Register the Triton kernels behind the dispatch seam (`kernels.TRITON_IMPLS`).

Importing this module never fails: without Triton, or without CUDA, it registers nothing and the
engine keeps the PyTorch reference path. The kernels themselves live in triton_attention,
triton_cache, triton_scores, triton_fused, triton_linear and sampling/triton_sampling; under
TRITON_INTERPRET=1 tests call them directly on CPU tensors.
"""

from __future__ import annotations

import torch

from zipage import kernels

NAMES = kernels.DISPATCHED  # every kernel behind the seam has a Triton implementation

IMPLS: dict[str, object] = {}  # name -> Triton function (empty when Triton cannot be imported)
IMPORT_ERROR: BaseException | None = None

try:
    from zipage.kernels import triton_attention, triton_cache, triton_fused, triton_linear, triton_scores
    from zipage.kernels.sampling import triton_sampling

    for _module in (triton_attention, triton_cache, triton_scores, triton_fused, triton_linear, triton_sampling):
        for _name in NAMES:
            if hasattr(_module, _name):
                IMPLS[_name] = getattr(_module, _name)
except Exception as exc:  # triton missing or unusable: the reference path stays
    IMPORT_ERROR = exc
    IMPLS = {}


def available() -> bool:
    """Triton kernels can be used: Triton imported and a CUDA device is present."""
    return bool(IMPLS) and len(IMPLS) == len(NAMES) and torch.cuda.is_available()


def register() -> list[str]:
    """Put every Triton implementation into kernels.TRITON_IMPLS (when available()); returns the names."""
    if not available():
        return []
    kernels.TRITON_IMPLS.update(IMPLS)
    return sorted(IMPLS)


def unregister() -> None:
    for name in IMPLS:
        kernels.TRITON_IMPLS.pop(name, None)


def patch_interpreter_for_numpy2() -> bool:
    """Tests only (TRITON_INTERPRET=1): Triton 3.6's interpreter converts scalars to Python ints with
    int() on a one-element 1-d array, which NumPy >= 2.4 refuses, so dynamic loop bounds fail
    (triton-lang/triton#9171). Re-patch the scalar conversion to take the element, and the fp8 and
    bf16 casts (below). Returns whether the patch was applied; harmless to call twice, never needed on a GPU."""
    try:
        from triton.runtime import interpreter
    except Exception:
        return False
    original = interpreter._patch_lang_tensor
    if getattr(original, "_zipage_patched", False):
        return True

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._zipage_patched = True
    interpreter._patch_lang_tensor = patched
    _patch_interpreter_casts(interpreter)
    return True


def _patch_interpreter_casts(interpreter) -> None:
    """Two float32 down-casts of the interpreter, sent through torch to round as the GPU does.
    fp8: Triton 3.7's interpreter rounds ties away from zero and loses the carry when rounding
    overflows the mantissa (7.94 -> 4: triton-lang/triton#8322, #11897); torch rounds to nearest
    even, and clamping first mirrors the GPU's saturating cvt.rn.satfinite.e4m3x2.f32. bf16: the
    interpreter truncates; the GPU's cvt.rn.bf16.f32 rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir

    from zipage.kernels.reference import FP8_MAX

    original = interpreter.InterpreterBuilder.create_fp_to_fp
    if getattr(original, "_zipage_patched", False):
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if (dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32
                and rounding_mode == ir.ROUNDING_MODE.RTNE):
            x = torch.from_numpy(np.array(src.data, dtype=np.float32))
            codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(codes.reshape(np.shape(src.data)), dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp._zipage_patched = True
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp

    # (its cast_impl converts float32 -> bfloat16 with no rounding mode)
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def rounded_cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            x = torch.from_numpy(np.array(src.data, dtype=np.float32))
            halves = x.to(torch.bfloat16).view(torch.uint16).numpy()
            return interpreter.TensorHandle(halves.reshape(np.shape(src.data)), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = rounded_cast_impl


REGISTERED = register()
