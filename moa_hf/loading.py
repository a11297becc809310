"""One loading policy for targets and drafters, used by every `moa` command, the benchmark, tuning, serving and Hub.

- Nothing from a model folder is ever executed: `trust_remote_code` is never set. A published drafter folder carries
  remote code for users without moa_hf; moa_hf loads it with its own classes, dispatched by `config.model_type`.
- A local folder is read with `local_files_only=True`. A Hub id is fetched only where the caller allows downloads
  (`local_files_only=False`, the default); `HF_HUB_OFFLINE=1` keeps even that offline.
- dtypes are parsed once (`parse_dtype`). A target's "auto" is bfloat16 on a GPU and float32 on a CPU; its device
  defaults to cuda when available. A drafter follows the target (its device and dtype) when one is given; an explicit
  `dtype` / `device` wins over the target's. A drafter is loaded at its class's default dtype and then cast, so its
  buffers are cast along with its weights, as `.to(dtype)` always did here.
- Errors say what was wrong and how to fix it: `FileNotFoundError` for a missing folder, `ValueError` otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch

from .drafter_types import drafter_kinds, drafter_type
from .hardware import emulated_bf16_warning

__all__ = [
    "DRAFTER_KINDS",
    "default_device",
    "drafter_kind",
    "folder_kind",
    "load_drafter",
    "load_target",
    "parse_dtype",
]

logger = logging.getLogger(__name__)

DRAFTER_KINDS = drafter_kinds()  # the registered kinds (`moa_hf.drafter_types`) at import
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
}
_TRAIN_HINT = "train one with `moa train` (see README), or pass `default` for the shipped MoA drafter"


# ---------------------------------------------------------------------------------------------------------------------
# dtype and device
# ---------------------------------------------------------------------------------------------------------------------
def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch floating dtype from a name ("float32", "fp32", "bf16", "bfloat16", "torch.float16", "half", ...) or a
    `torch.dtype`; None for "auto" (or None): the caller's default (for a target: bf16 on a GPU, fp32 on a CPU)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16).")
    return _DTYPES[name]


def default_device() -> torch.device:
    """cuda when available, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------------
def _source(spec: str | os.PathLike, what: str, local_files_only: bool) -> tuple[str, bool]:
    """(what to pass to `from_pretrained`, whether it is a local folder). A folder must hold config.json; anything
    else is a Hub id, refused when `local_files_only`."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{what} {spec} is not a saved model folder (no config.json there); pass a folder written by "
                "`save_pretrained`."
            )
        return str(path), True
    if path.exists():
        raise FileNotFoundError(f"{what} {spec} is a file, not a model folder; pass the folder that holds it.")
    if local_files_only:
        raise FileNotFoundError(
            f"{what} {spec} is not a saved model folder (no such folder), and models are never downloaded here; "
            "pass a local model folder (with config.json and the tokenizer), or `default`."
        )
    return str(spec), False


def _read_model_type(folder: str) -> str | None:
    return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type")


# ---------------------------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------------------------
def load_target(
    spec: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    tokenizer: str | os.PathLike | None = None,
    require_tokenizer: bool = True,
    local_files_only: bool = False,
):
    """(model in eval mode on `device`, tokenizer) of a target.

    `spec`: "default" (SmolLM2-135M-Instruct from the GGUF package, offline; see `moa_hf.default_target`),
    "default:NAME" (its shipped fine-tune NAME, one of `moa_hf.DEFAULT_TARGET_VARIANTS`), a local folder
    (config.json, weights and tokenizer), or a Hub id (refused when `local_files_only`). `dtype`: see `parse_dtype`
    ("auto": bf16 on a GPU, fp32 on a CPU). `device`: default cuda when available. `tokenizer`: another tokenizer
    folder. Without a tokenizer in the folder: an error, or None with a warning when not `require_tokenizer` (a
    server whose clients send token ids).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    torch_dtype = parse_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if slow := emulated_bf16_warning(torch_dtype, device):
        warnings.warn(slow, stacklevel=2)
    from .default_target import is_default_target_spec, load_default_target, parse_default_target_spec

    if is_default_target_spec(spec):
        model, tok = load_default_target(dtype=torch_dtype, variant=parse_default_target_spec(str(spec)))
    else:
        source, local = _source(spec, "The target", local_files_only)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch_dtype, local_files_only=local, trust_remote_code=False
            )
        except (OSError, ValueError) as err:
            raise ValueError(
                f"Cannot load the target {spec!r} ({type(err).__name__}: {err}); pass a local folder of a causal "
                "LM with its tokenizer, a Hub id that can be downloaded, or `default`."
            ) from err
        tok = None
        if tokenizer is None:
            try:
                tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
            except (OSError, ValueError, TypeError) as err:
                if require_tokenizer:
                    raise ValueError(
                        f"No tokenizer for the target {spec!r} ({type(err).__name__}: {err}); save it next to the "
                        "model (`tokenizer.save_pretrained(folder)`)."
                    ) from err
                logger.warning("No tokenizer in %s: clients must send token ids or bring their own.", spec)
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    return model.to(device).eval(), tok


def target_folder(spec: str | os.PathLike) -> str:
    """What a serving engine (vLLM) loads for the target `spec` of `load_target`: the default target's cached folder
    (for "default:NAME", its fine-tune's merged folder), else the folder or Hub id itself."""
    from .default_target import (
        default_target_path,
        default_target_variant_path,
        is_default_target_spec,
        parse_default_target_spec,
    )

    if is_default_target_spec(spec):
        variant = parse_default_target_spec(str(spec))
        return str(default_target_path() if variant is None else default_target_variant_path(variant))
    return str(spec)


# ---------------------------------------------------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------------------------------------------------
def _model_class(kind: str):
    """The class a drafter of `kind` loads with: its registered model class, or `AutoModelForCausalLM` for the
    fallback kind (any causal LM)."""
    from transformers import AutoModelForCausalLM

    return drafter_type(kind).model_class or AutoModelForCausalLM


def _kind(model_type: str | None) -> str:
    return drafter_type({"model_type": model_type}).kind


def folder_kind(folder: str | os.PathLike) -> str:
    """The kind of drafter saved in `folder`, from its config.json `model_type`: "moa", "eagle", or "independent"
    (any other causal LM, used as an ordinary assistant)."""
    return _kind(_read_model_type(str(folder)))


def drafter_kind(model: torch.nn.Module) -> str:
    """The kind of a built drafter ("moa", "eagle" or "independent"), from its config's `model_type`: a drafter
    loaded as Hub remote code counts too."""
    return _kind(getattr(getattr(model, "config", None), "model_type", None))


def _drafter_folder(spec: str | os.PathLike) -> Path:
    if str(spec) == "default":
        from . import default_drafter_path

        folder = Path(default_drafter_path())
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"No trained default drafter at {folder}. Train one with `moa data` + `moa train --target default` "
                "(see README) and save it there, or pass a saved drafter folder."
            )
        return folder
    folder = Path(spec).expanduser()
    if not folder.exists() and str(spec).count("/") == 1:  # a Hub repo id: the copy in the local Hub cache
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            folder = Path(snapshot_download(str(spec), local_files_only=True))
        except LocalEntryNotFoundError as err:
            raise FileNotFoundError(
                f"The drafter {spec} is neither a folder nor a Hub repo in the local Hub cache (moa-hf never "
                f"downloads drafters while loading): run `huggingface-cli download {spec}` first."
            ) from err
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"The drafter {spec} is not a saved drafter folder (no config.json there); {_TRAIN_HINT}."
        )
    return folder


def _check_kind(found: str, kind: str | None, where: str) -> None:
    if kind in (None, "auto"):
        return
    if kind not in drafter_kinds():
        raise ValueError(f"Unknown drafter kind {kind!r}; use one of {', '.join(drafter_kinds())} (or auto).")
    if kind != found:
        raise ValueError(
            f"{where} holds a {found!r} drafter, not a {kind!r} one; pass a {kind} drafter, or ask for kind "
            f"{found!r} (or auto)."
        )


def _check_vocab(drafter: torch.nn.Module, target: torch.nn.Module, where: str) -> None:
    """An independent assistant must predict the target's tokens (the same tokenizer)."""
    vocab = drafter.get_output_embeddings().weight.shape[0]
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if vocab != target_vocab:
        raise ValueError(
            f"The independent drafter {where} has {vocab} output tokens but the target has {target_vocab}; it must "
            "use the target's tokenizer (build one with `moa train --kind independent`)."
        )


def load_drafter(
    spec,
    *,
    target: torch.nn.Module | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    kind: str | None = None,
):
    """A drafter from `spec`: "default" (the shipped MoA drafter), a saved folder, or a model (passed through).

    A folder is dispatched by its config's `model_type`: the MoA drafter, the EAGLE-style drafter, or any other causal
    LM (an independent assistant, `AutoModelForCausalLM`), loaded from its safetensors with `local_files_only` and
    never with `trust_remote_code`. `kind` ("moa", "eagle", "independent"; None or "auto": any) must match what is
    found. Placement: `dtype` / `device` when given, else the `target`'s when given, else as loaded (a passed model is
    then left untouched). With a `target`, an independent assistant must have the target's vocabulary size. A loaded
    drafter is returned in eval mode.
    """
    if isinstance(spec, torch.nn.Module):
        drafter, where = spec, f"({type(spec).__name__})"
        _check_kind(drafter_kind(drafter), kind, f"The given {type(spec).__name__}")
    else:
        folder = _drafter_folder(spec)
        where = f"at {folder}"
        found = folder_kind(folder)
        _check_kind(found, kind, str(folder))
        try:
            cls = _model_class(found)
            remote = {"trust_remote_code": False} if drafter_type(found).is_fallback else {}  # never code from it
            drafter = cls.from_pretrained(str(folder), local_files_only=True, **remote).eval()
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(
                f"Cannot load the {found} drafter at {folder} ({type(err).__name__}: {err}); {_TRAIN_HINT}."
            ) from err
    if target is not None and drafter_type(drafter).is_fallback:  # an independent assistant
        _check_vocab(drafter, target, where)
    to_dtype = parse_dtype(dtype) or (target.dtype if target is not None else None)
    to_device = device if device is not None else (target.device if target is not None else None)
    if to_dtype is not None or to_device is not None:
        drafter = drafter.to(device=to_device, dtype=to_dtype)
    return drafter
