"""The frozen target's states, computed once per dataset and memory-mapped for every epoch.

Training a drafter online runs the target over every batch of every epoch. Its outputs never change (the target is
frozen), so `cache_target_states` runs it once over a `moa data` dataset and writes, for every token:

- `target_kv.npy`: the keys/values of every layer, [N, L, 2*Hkv*hd] bfloat16 (the LSA input of MoA drafters), for
  every position, also in sliding-window layers (which of them a drafter could still read at inference depends on
  the prompt length: the trainer marks it, see `MoATrainer.held_target_kv`);
- `final_hidden.npy`: the post-norm final hidden state, [N, d] bfloat16 (the regression target, the teacher's logits
  through the target's head, and the feature input of EAGLE-style drafters);
- with `tli_layers=M > 0`, `tli_hidden.npy`: [N, M, d] bfloat16, the residual stream before the target's last n
  layers for n = 1..M (`hidden_states[L-n]`): the regression target of drafters with Target Layer Inference N <= M,
  whose last N layers read their keys/values from `target_kv` (see `split_target_kv`);

plus `states.json` (shapes, the target's signature, one (offset, length) per example). `TargetStatesDataset` pairs a
dataset with its states; `MoATrainer` then skips the target's forward (an epoch costs only the drafter).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import DynamicCache, PreTrainedModel

from ..modeling import CACHE_NAME, TargetStates, gather_target_kv, target_fingerprint, target_signature

__all__ = ["TargetStates", "TargetStatesDataset", "cache_target_states", "load_target_states", "states_bytes"]

logger = logging.getLogger(__name__)

_META = "states.json"
_KV, _HIDDEN, _TLI = "target_kv", "final_hidden", "tli_hidden"
_FORMAT = 1


def _signature(target: PreTrainedModel) -> dict:
    return {"name_or_path": getattr(target.config, "name_or_path", None), **target_signature(target.config)}


def _as_u16(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.uint16).cpu().numpy()  # bf16 bits, numpy has no bf16


def states_bytes(tokens: int, num_layers: int, kv_width: int, hidden_size: int, tli_layers: int = 0) -> int:
    """Bytes of cached states: per token every layer's keys/values, the final state and `tli_layers` inputs, bf16."""
    return 2 * tokens * (num_layers * kv_width + hidden_size * (1 + tli_layers))


def _check_room(out: Path, tokens: int, num_layers: int, kv_width: int, hidden_size: int, tli_layers: int) -> None:
    """Say what the states will take, and refuse before writing anything when the disk cannot hold them."""
    size = states_bytes(tokens, num_layers, kv_width, hidden_size, tli_layers)
    free = shutil.disk_usage(out).free
    logger.warning(
        "Caching the target's states in %s: %d tokens x (%d layers x %d K/V width + %d final state%s) x 2 bytes = "
        "%.2f GB (%.1f GB free).",
        out,
        tokens,
        num_layers,
        kv_width,
        hidden_size,
        f" x {1 + tli_layers}" if tli_layers else "",
        size / 1e9,
        free / 1e9,
    )
    if size > free:
        raise ValueError(
            f"The target's states for this data would take {size / 1e9:.2f} GB ({tokens} tokens x {num_layers} layers "
            f"x {kv_width} K/V width x 2 bytes, plus final states) but {out} has {free / 1e9:.2f} GB free. Train "
            "online instead (without --states: the target runs inside each training step), or cache fewer tokens "
            "(--max-length) or on a larger disk."
        )


@torch.no_grad()
def cache_target_states(
    target: PreTrainedModel,
    dataset,
    output_dir: str | os.PathLike,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
    tli_layers: int = 0,
) -> Path:
    """Run `target` once over `dataset` (examples with `input_ids`) and write its states to `output_dir`.

    Examples are batched by length (right padding, masked) and stored unpadded, truncated to `max_length`; with
    `tli_layers=M` the hidden states before the last 1..M layers are stored too (drafters with Target Layer Inference
    N <= M). Returns the folder. An existing complete folder for the same dataset size and target (and at least M
    such layers) is reused as is; one computed by another model (another signature, or other weights: another
    `target_fingerprint`, e.g. the base model of a fine-tune) is recomputed.
    """
    out = Path(output_dir)
    meta_path = out / _META
    fingerprint = target_fingerprint(target)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        same_weights = meta.get("fingerprint") in (None, fingerprint) or fingerprint is None  # None: not recorded
        if (
            meta.get("complete")
            and meta["num_examples"] == len(dataset)
            and meta["target"] == _signature(target)
            and same_weights
        ):
            if meta.get("tli_layers", 0) >= tli_layers:
                return out
            raise ValueError(
                f"The target states in {out} hold the inputs of the target's last {meta.get('tli_layers', 0)} "
                f"layers, but Target Layer Inference needs {tli_layers}. Cache the states in another folder (or "
                f"delete this one) to rebuild them with tli_layers={tli_layers}."
            )
    out.mkdir(parents=True, exist_ok=True)
    lengths = [min(len(ids), max_length or len(ids)) for ids in dataset["input_ids"]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    cfg = target.config.get_text_config()
    device = target.device
    probe_ids = torch.tensor([[0]], device=device)
    probe = target(input_ids=probe_ids, use_cache=True, **{CACHE_NAME: DynamicCache()})  # cache layout (L, W)
    width = gather_target_kv(getattr(probe, CACHE_NAME), 0, 1).shape[-1]
    num_layers = len(getattr(probe, CACHE_NAME).layers)
    _check_room(out, total, num_layers, int(width), cfg.hidden_size, tli_layers)
    kv = np.lib.format.open_memmap(out / (_KV + ".npy"), mode="w+", dtype=np.uint16, shape=(total, num_layers, width))
    hid = np.lib.format.open_memmap(
        out / (_HIDDEN + ".npy"), mode="w+", dtype=np.uint16, shape=(total, cfg.hidden_size)
    )
    tli = None
    if tli_layers > 0:
        if not 0 < tli_layers < num_layers:
            raise ValueError(f"tli_layers must be in 1..{num_layers - 1} for this target, got {tli_layers}.")
        tli = np.lib.format.open_memmap(
            out / (_TLI + ".npy"), mode="w+", dtype=np.uint16, shape=(total, tli_layers, cfg.hidden_size)
        )
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])  # similar lengths share a batch: little padding
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="target states", unit="tok")
    for rows in batches:
        T = max(lengths[i] for i in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : lengths[i]] = torch.as_tensor(dataset[i]["input_ids"][: lengths[i]])
            mask[r, : lengths[i]] = 1
        o = target(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
            **{CACHE_NAME: DynamicCache()},  # every layer keeps every position (sliding-window ones too)
        )
        states = gather_target_kv(getattr(o, CACHE_NAME), 0, T)  # [B, T, L, W]
        final = o.hidden_states[-1]  # [B, T, d] post-norm
        if tli is not None:  # hidden_states[L-n] for n = 1..M: [B, T, M, d]
            before_last = torch.stack([o.hidden_states[num_layers - n] for n in range(1, tli_layers + 1)], dim=2)
        for r, i in enumerate(rows):
            a, n = offsets[i], lengths[i]
            kv[a : a + n] = _as_u16(states[r, :n])
            hid[a : a + n] = _as_u16(final[r, :n])
            if tli is not None:
                tli[a : a + n] = _as_u16(before_last[r, :n])
        if bar is not None:
            bar.update(sum(lengths[i] for i in rows))
    if bar is not None:
        bar.close()
    for array in (kv, hid, tli):
        if array is not None:
            array.flush()
    meta = {
        "format": _FORMAT,
        "complete": True,
        "num_examples": len(dataset),
        "num_tokens": total,
        "num_layers": num_layers,
        "kv_width": int(width),
        "hidden_size": cfg.hidden_size,
        "tli_layers": tli_layers,
        "dtype": "bfloat16",
        "max_length": max_length,
        "offsets": offsets.tolist(),
        "target": _signature(target),
        "fingerprint": fingerprint,
    }
    meta_path.write_text(json.dumps(meta))
    return out


class _States:
    def __init__(self, folder: Path):
        self.meta = json.loads((folder / _META).read_text())
        if not self.meta.get("complete"):
            raise ValueError(f"{folder} holds incomplete target states; run `cache_target_states` again.")
        self.offsets = np.asarray(self.meta["offsets"], dtype=np.int64)
        # [N, L, W], [N, d] (and [N, M, d]), uint16 holding bf16 bits
        names = (_KV, _HIDDEN, _TLI) if self.meta.get("tli_layers", 0) > 0 else (_KV, _HIDDEN)
        self.arrays = {name: np.load(folder / (name + ".npy"), mmap_mode="r") for name in names}

    def example(self, i: int) -> dict[str, torch.Tensor]:
        """The states of example i: {name: bf16 tensor [T, ...]}."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return {name: torch.from_numpy(np.array(x[a:b])).view(torch.bfloat16) for name, x in self.arrays.items()}


def load_target_states(folder: str | os.PathLike, target: PreTrainedModel | None = None) -> _States:
    """Open the states written by `cache_target_states` (memory-mapped); checks they belong to `target`."""
    folder = Path(folder)
    if not (folder / _META).exists():
        raise FileNotFoundError(f"No target states in {folder}; build them with `cache_target_states` first.")
    states = _States(folder)
    if target is not None and states.meta["target"] != _signature(target):
        raise ValueError(
            f"The target states in {folder} were computed by {states.meta['target']}, not by this target "
            f"({_signature(target)}); recompute them for this target."
        )
    if target is not None:
        _check_fingerprint(states.meta, target_fingerprint(target), folder)
    return states


def _check_fingerprint(meta: dict, fingerprint: str | None, folder: Path) -> None:
    """Refuse states computed by other weights of the same signature (a base model and its fine-tune). Folders
    written before fingerprints were recorded are not checked."""
    recorded = meta.get("fingerprint")
    if recorded is not None and fingerprint is not None and recorded != fingerprint:
        raise ValueError(
            f"The target states in {folder} were computed by other weights than this target's (fingerprint "
            f"{recorded}, this target {fingerprint}: a fine-tune of it, or its base model?); give this target its "
            "own --states folder."
        )


class TargetStatesDataset(Dataset):
    """A `moa data` dataset whose examples also carry the target's cached `target_kv` [T, L, W] and
    `final_hidden` [T, d] (and, if cached, `tli_hidden` [T, M, d]; bf16 tensors), truncated like the states were."""

    def __init__(self, dataset, states: str | os.PathLike | _States, target: PreTrainedModel | None = None):
        self.dataset = dataset
        self.states = states if isinstance(states, _States) else load_target_states(states, target)
        if self.states.meta["num_examples"] != len(dataset):
            raise ValueError(
                f"The target states hold {self.states.meta['num_examples']} examples but the dataset has "
                f"{len(dataset)}; they were computed for another dataset."
            )

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        item = dict(self.dataset[i])
        states = self.states.example(i)
        item["input_ids"] = list(item["input_ids"])[: states[_KV].shape[0]]
        item.update(states)
        return item
