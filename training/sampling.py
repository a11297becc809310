"""What the trainer's data loader reads: each target's training data (`datasets_by_target`), its examples tagged with
their index and their target (`IndexedDataset`, `TaggedDataset`), and one-target batches of similar lengths
(`TargetBatchSampler`, reading the lengths with `example_lengths`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.utils.data import ConcatDataset, Dataset, Sampler

from moa_hf.modeling import PRIMARY_TARGET

from .cycles import mix64

__all__ = [
    "IndexedDataset",
    "TaggedDataset",
    "TargetBatchSampler",
    "datasets_by_target",
    "default_target",
    "example_lengths",
    "main_target",
    "training_dataset",
]


def example_lengths(dataset, max_length: int | None = None) -> list[int] | None:
    """Token counts of a training dataset's examples (through `IndexedDataset`, `TaggedDataset`, `ConcatDataset` and
    cached-states wrappers down to `datasets.Dataset`s), read from their `input_ids` column without loading cached
    states; None when a part is not such a dataset."""
    if isinstance(dataset, ConcatDataset):
        parts = [example_lengths(d, max_length) for d in dataset.datasets]
        return None if any(p is None for p in parts) else [n for p in parts for n in p]
    inner = getattr(dataset, "dataset", None)
    if inner is not None and not hasattr(dataset, "column_names"):
        return example_lengths(inner, max_length)
    if "input_ids" not in (getattr(dataset, "column_names", None) or []):
        return None
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")["input_ids"]  # the lengths without reading the token ids into Python
    lengths = pc.list_value_length(column).to_pylist()
    return [min(n, max_length) for n in lengths] if max_length else lengths


class IndexedDataset(Dataset):
    """A map-style dataset whose items also carry their index (`sample_index`)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return {**self.dataset[idx], "sample_index": int(idx)}


class TaggedDataset(Dataset):
    """A map-style dataset whose items also carry the index of the target that produced them (`target_index`)."""

    def __init__(self, dataset, target_index: int):
        self.dataset = dataset
        self.target_index = target_index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return {**self.dataset[idx], "target_index": self.target_index}


class TargetBatchSampler(Sampler[int]):
    """Indices into the concatenation of several targets' datasets (sizes `sizes`, in that order) such that every
    consecutive block of `batch_size` indices comes from one target: each epoch, every dataset is shuffled and cut
    into blocks (its last block filled up with its own first examples of the epoch), and all blocks are shuffled
    together, so targets are mixed in proportion to their dataset sizes. A pure function of (seed, epoch).

    With `lengths` (the examples' token counts, in the same concatenated order), each dataset's shuffled order is cut
    into groups of `GROUP_BATCHES` blocks and each group sorted by length before it is cut into blocks: a block holds
    examples of similar lengths, so a right-padded batch computes little padding (the blocks are still shuffled).

    A DataLoader with this sampler and the same `batch_size` yields one-target batches (Accelerate hands whole
    batches to processes: the same holds per process under DDP).
    """

    GROUP_BATCHES = 16

    def __init__(self, sizes: Sequence[int], batch_size: int, seed: int = 0, lengths: Sequence[int] | None = None):
        if batch_size < 1 or not sizes or min(sizes) < 1:
            raise ValueError(f"Need a positive batch size and non-empty datasets, got {batch_size} and {list(sizes)}.")
        self.sizes = [int(n) for n in sizes]
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        if lengths is not None and len(lengths) != sum(self.sizes):
            raise ValueError(f"{len(lengths)} lengths for {sum(self.sizes)} examples.")
        self.lengths = None if lengths is None else [int(n) for n in lengths]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _blocks(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(int(mix64(self.seed, self.epoch, 0x7A67) >> 1))
        blocks, offset = [], 0
        for n in self.sizes:
            order = (offset + torch.randperm(n, generator=g)).tolist()
            if self.lengths is not None:  # sort groups of GROUP_BATCHES blocks by length, longest first
                group = self.GROUP_BATCHES * self.batch_size
                order = [i for s in range(0, n, group) for i in sorted(order[s : s + group], key=self._length)]
            width = -(-n // self.batch_size) * self.batch_size
            order = (order * -(-width // n))[:width]  # filled up with the first ones again
            blocks += [order[i : i + self.batch_size] for i in range(0, width, self.batch_size)]
            offset += n
        return [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]

    def _length(self, i: int) -> int:
        return -self.lengths[i]

    def __iter__(self):
        for block in self._blocks():
            yield from block

    def __len__(self) -> int:
        return sum(-(-n // self.batch_size) for n in self.sizes) * self.batch_size


# ---------------------------------------------------------------------------------------------------------------------
# Each target's data
# ---------------------------------------------------------------------------------------------------------------------
def main_target(target_names: Sequence[str]) -> str:
    """The primary target (`"main"`) when it is among `target_names`, else the first one."""
    return PRIMARY_TARGET if PRIMARY_TARGET in target_names else target_names[0]


def datasets_by_target(train_dataset, target_names: Sequence[str]) -> dict[str, Dataset] | None:
    """{target name: dataset} from `train_dataset` (a plain one is the main target's, or the only target's)."""
    if train_dataset is None:
        return None
    if not isinstance(train_dataset, Mapping):
        if PRIMARY_TARGET not in target_names and len(target_names) > 1:
            raise ValueError(
                f"Pass the training data of several targets as {{target name: dataset}} (targets: "
                f"{list(target_names)})."
            )
        return {main_target(target_names): train_dataset}
    unknown = sorted(set(train_dataset) - set(target_names))
    if unknown:
        raise ValueError(f"Training data for {unknown}, which are not among the targets {list(target_names)}.")
    empty = [name for name, d in train_dataset.items() if len(d) == 0]
    if empty:
        raise ValueError(f"The training data of target(s) {empty} is empty.")
    return {name: d for name, d in train_dataset.items()}


def default_target(by_target: Mapping[str, Dataset] | None, target_names: Sequence[str]) -> str:
    """The target of untagged batches (evaluation data): the one trained on, else the main one (`main_target`)."""
    return next(iter(by_target)) if by_target and len(by_target) == 1 else main_target(target_names)


def training_dataset(by_target: Mapping[str, Dataset], target_names: Sequence[str]) -> IndexedDataset:
    """What the data loader indexes: the examples with their index; several targets' data concatenated, each example
    tagged with the index of its target in `target_names`."""
    if len(by_target) == 1:
        return IndexedDataset(next(iter(by_target.values())))
    tagged = [TaggedDataset(d, list(target_names).index(name)) for name, d in by_target.items()]
    return IndexedDataset(ConcatDataset(tagged))
