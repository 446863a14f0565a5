"""Register the Triton kernels behind the dispatch seam (`kernels.TRITON_IMPLS`).

Importing this module never fails: without Triton, or without CUDA, it registers nothing and the
engine keeps the PyTorch reference path. The kernels themselves live in triton_attention,
triton_cache, triton_scores, triton_fused and
triton_linear; under TRITON_INTERPRET=1 tests call them directly on CPU tensors.
"""

from __future__ import annotations

import torch

from zipage import kernels

NAMES = kernels.DISPATCHED  # every kernel behind the seam has a Triton implementation

IMPLS: dict[str, object] = {}  # name -> Triton function (empty when Triton cannot be imported)
IMPORT_ERROR: BaseException | None = None

try:
    from zipage.kernels import triton_attention, triton_cache, triton_fused, triton_linear, triton_scores

    for _module in (triton_attention, triton_cache, triton_scores, triton_fused, triton_linear):
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
    (triton-lang/triton#9171). Re-patch the scalar conversion to take the element. Returns whether
    the patch was applied; harmless to call twice, and never needed on a GPU."""
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
    return True


REGISTERED = register()
