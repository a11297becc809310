"""transformers' `custom_generate` entry point of a published MoA drafter repo (this folder is copied into it).

`target.generate(**inputs, custom_generate="ORG/DRAFTER", trust_remote_code=True)` runs `generate(model=target, ...)`:
speculative decoding of `target` with the drafter given as `drafter=` (a loaded drafter, or a repo id / folder), else
with the drafter of the repo this file was published in: `moa publish` records its folder (`DRAFTER_FOLDER`, for a
folder that was not pushed; used while it exists) and its Hub repo id (`DRAFTER_REPO`). Every other
argument (`max_new_tokens`, `do_sample`, `return_dict_in_generate`, the tree settings `tree_depth`, `tree_top_k`,
`tree_budget`, `lookup`, ...) goes to `speculative_generate` (see engine.py).

`AutoModel.from_pretrained("ORG/DRAFTER", trust_remote_code=True)` also replaces the loaded drafter's own `generate`
with this function (transformers does that for every repo with a `custom_generate/` folder); for a drafter `model` it
calls the drafter class's `generate`, so `target.generate(assistant_model=drafter)` keeps working.
"""

from __future__ import annotations

import os

from transformers import AutoModel

from .engine import speculative_generate
from .tree import TreeDrafter

__all__ = ["DRAFTER_FOLDER", "DRAFTER_REPO", "generate"]

# The drafter of the repo this file was published in, recorded by `moa publish` (None here, in the package)
DRAFTER_REPO: str | None = None  # its Hub repo id
DRAFTER_FOLDER: str | None = None  # the absolute path of the repo folder, when it was built without pushing

# Loaded drafters by (repo, dtype, device). transformers runs this function afresh for every
# `target.generate(custom_generate=...)` call (keeping this module imported), and reloading the drafter's weights each
# time would cost more than a short generation; the cached drafters hold no per-call state (the engine attaches a
# drafter for the call and detaches it afterwards).
_LOADED_DRAFTERS: dict[tuple[str, str, str], object] = {}


def _is_drafter(model) -> bool:
    return isinstance(model, TreeDrafter)


def _load_drafter(repo: str, dtype, device):
    key = (repo, str(dtype), str(device))
    if key not in _LOADED_DRAFTERS:
        drafter = AutoModel.from_pretrained(repo, trust_remote_code=True, dtype=dtype)
        _LOADED_DRAFTERS[key] = drafter.to(device).eval()
    return _LOADED_DRAFTERS[key]


def _published_drafter() -> str | None:
    """Where the repo's own drafter loads from: its folder while that exists (a folder uploaded later with `hf upload`
    records a path of the machine that built it), else its Hub repo id."""
    if DRAFTER_FOLDER is not None and os.path.isdir(DRAFTER_FOLDER):
        return DRAFTER_FOLDER
    return DRAFTER_REPO


def _resolve_drafter(model, drafter):
    """The drafter object for target `model`: `drafter` itself, or loaded from its repo id / folder or the repo's."""
    if drafter is None:
        drafter = _published_drafter()
    if drafter is None:
        raise ValueError(
            "No drafter for this custom_generate call: the repo does not record one (it was not built by "
            "`moa publish`). Pass drafter=<a loaded drafter, or its Hub repo id or folder> to target.generate."
        )
    if isinstance(drafter, (str, os.PathLike)):
        return _load_drafter(os.fspath(drafter), model.dtype, model.device)
    if not _is_drafter(drafter):
        raise ValueError(
            f"drafter={type(drafter).__name__} is not a MoA/EAGLE drafter (it has no tree_catch_up); pass a drafter "
            "loaded with AutoModel.from_pretrained(<drafter repo>, trust_remote_code=True), or its repo id or folder."
        )
    return drafter


def generate(model, *args, **kwargs):
    """transformers' `custom_generate` contract: `model` is the model whose `generate` was called.

    A drafter (its `generate` replaced on loading): drafts as the drafter class does, for assisted generation.
    A target: `speculative_generate(model, drafter, ...)` with `drafter=` or the repo's own drafter.
    """
    if _is_drafter(model):
        return type(model).generate(model, *args, **kwargs)
    drafter = _resolve_drafter(model, kwargs.pop("drafter", None))
    return speculative_generate(model, drafter, *args, **kwargs)  # it passes generate's arguments on to generate
