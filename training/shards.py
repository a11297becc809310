"""Resumable shards of a dataset being built (`moa data`): `write_shards` writes the shards a folder lacks, each
atomically, under a manifest that refuses other inputs; `join_shards` saves them as one dataset. One writer for
prompt data and conversations alike: `part` takes every N-th item (`take_part`), `max_shards` the first shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "datasets_progress",
    "inputs_fingerprint",
    "join_shards",
    "save_shard",
    "shard_folder",
    "shard_seed",
    "take_part",
    "write_shards",
]

_MANIFEST = "manifest.json"
_COLUMN_TYPES = {"prompt_length": "int32", "prompt_index": "int64", "conversation_index": "int64"}

# make_shard(k, lo, hi, answerer, advance) -> shard k's columns: items [lo, hi), `answerer` the entered engine (None
# without one), `advance(n)` moves the progress bar n units
MakeShard = Callable[[int, int, int, object, Callable[[int], None]], dict[str, list]]


@contextlib.contextmanager
def datasets_progress(enabled: bool):
    """Silence `datasets`' own progress bars for the block when `enabled` is False (restored afterwards)."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            ds_logging.enable_progress_bar()


def inputs_fingerprint(**parts) -> str:
    """A hash of the inputs a dataset folder is built from (its manifest records it)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def shard_seed(seed: int, shard: int) -> int:
    """The sampling seed of shard `shard` of a run seeded `seed`."""
    return int(hashlib.sha256(f"{seed}-{shard}".encode()).hexdigest()[:15], 16)


def shard_folder(output_dir: Path) -> Path:
    """Where a dataset folder keeps its finished shards."""
    return Path(output_dir) / "shards"


def take_part(items: Sequence, part: tuple[int, int] | None) -> tuple[list, int, int]:
    """(items k, k+n, k+2n, ..., k, n) for `part` (k, n); (all the items, 0, 1) for None. Item i of the part is item
    k + n * i of the whole list."""
    if part is None:
        return list(items), 0, 1
    first, stride = int(part[0]), int(part[1])
    if not 0 <= first < stride:
        raise ValueError(f"part must be (k, n) with 0 <= k < n, got {part}.")
    return list(items)[first::stride], first, stride


def _check_manifest(shard_dir: Path, fingerprint: str, num_items: int) -> None:
    """Refuse to resume into a folder whose shards were made from other inputs; start its manifest otherwise."""
    manifest = shard_dir / _MANIFEST
    if manifest.exists():
        if json.loads(manifest.read_text()).get("fingerprint") != fingerprint:
            raise ValueError(
                f"{shard_dir.parent} holds shards generated with other prompts, target or settings. Use a new output "
                "folder, or delete it to start over."
            )
    else:
        manifest.write_text(json.dumps({"fingerprint": fingerprint, "num_prompts": num_items}, indent=1))


def _shard_path(shard_dir: Path, k: int) -> Path:
    return shard_dir / f"shard-{k:06d}"


def save_shard(shard_dir: Path, k: int, columns: dict[str, list], progress: bool) -> None:
    """Shard k of a dataset being built, written atomically (its folder exists only once complete)."""
    import datasets

    features = {
        name: datasets.Sequence(datasets.Value("int8" if name == "response_mask" else "int32"))
        if name in ("input_ids", "response_mask")
        else datasets.Value(_COLUMN_TYPES[name])
        for name in columns
    }
    shard = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    tmp = shard_dir / f".tmp-shard-{k:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    with datasets_progress(progress):
        shard.save_to_disk(str(tmp))
    os.replace(tmp, _shard_path(shard_dir, k))


def write_shards(
    output_dir: Path,
    fingerprint: str,
    num_items: int,
    shard_size: int,
    make_shard: MakeShard,
    *,
    max_shards: int | None = None,
    engine: contextlib.AbstractContextManager | None = None,
    units: Callable[[int, int], int] | None = None,
    desc: str = "target answers",
    unit: str = "prompt",
    progress: bool = True,
) -> tuple[int, int]:
    """Writes the shards of `num_items` items that `output_dir` lacks (shard k: items [k * shard_size, (k + 1) *
    shard_size)), only the first `max_shards` of them (None: all): `make_shard(k, lo, hi, answerer, advance)` gives
    shard k's columns, saved atomically (`save_shard`). Finished shards are kept (a run resumes after them, or goes on
    with a larger `max_shards`); a folder whose manifest records another `fingerprint` is refused.

    engine: a context manager entered around the missing shards (not at all when none is missing); what it gives is
    `answerer`. units(lo, hi): the progress bar's units of items [lo, hi) (default: one per item, `unit`).
    Returns (shards answered: the first ones, shards in the list)."""
    from tqdm.auto import tqdm

    if shard_size < 1 or (max_shards is not None and max_shards < 1):
        raise ValueError(f"shard_size and max_shards must be positive, got {shard_size} and {max_shards}.")
    shard_dir = shard_folder(output_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    _check_manifest(shard_dir, fingerprint, num_items)
    units = units or (lambda lo, hi: hi - lo)
    shards_in_list = (num_items + shard_size - 1) // shard_size
    num_shards = min(shards_in_list, max_shards or shards_in_list)  # the first ones; the fingerprint covers all
    bounds = [(k * shard_size, min(num_items, (k + 1) * shard_size)) for k in range(num_shards)]
    todo = [k for k in range(num_shards) if not _shard_path(shard_dir, k).is_dir()]
    bar = tqdm(
        total=units(0, bounds[-1][1]) if bounds else 0,
        initial=sum(units(*bounds[k]) for k in range(num_shards) if k not in todo),
        desc=desc,
        unit=unit,
        disable=not progress,
    )
    with engine if engine is not None and todo else contextlib.nullcontext() as answerer:
        for k in todo:
            save_shard(shard_dir, k, make_shard(k, *bounds[k], answerer, bar.update), progress)
    bar.close()
    return num_shards, shards_in_list


def join_shards(output_dir: Path, shards: int | list[int], progress: bool):
    """All shards (the first `shards`, or those listed) as one dataset, saved in `output_dir` itself."""
    import datasets

    shard_dir = shard_folder(output_dir)
    shards = range(shards) if isinstance(shards, int) else shards
    dataset = datasets.concatenate_datasets([datasets.load_from_disk(str(_shard_path(shard_dir, k))) for k in shards])
    if len(dataset):
        with datasets_progress(progress):
            dataset.save_to_disk(str(output_dir))
    return dataset
