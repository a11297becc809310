"""Following vLLM's rows from step to step: rows move, join and leave between steps, so what the proposer keeps per
row (its drafter state, its life so far) is found again by the tokens each row was seen with."""

from __future__ import annotations

import numpy as np

from .pricing import OutputLengths

__all__ = ["RowLives", "pair_rows"]


def pair_rows(states: list, histories: list, continues) -> list[int | None]:
    """For each row's verified tokens `histories[b]` (vLLM's row order), the index of the state that it continues
    (`continues(state, history)`), the state at the same position tried first, each state paired once; None: none."""
    taken: set[int] = set()
    pairs: list[int | None] = []
    for b, history in enumerate(histories):
        order = ([b] if b < len(states) else []) + [i for i in range(len(states)) if i != b]
        found = next((i for i in order if i not in taken and continues(states[i], history)), None)
        if found is not None:
            taken.add(found)
        pairs.append(found)
    return pairs


class RowLives:
    """Follows vLLM's rows from step to step by the tokens each was first seen with, and counts what each generated;
    a row no longer seen has finished and its length goes to `lengths` (what the policy prices catch-ups by)."""

    def __init__(self, lengths: OutputLengths, signature: int = 16):
        self.lengths, self.signature = lengths, signature
        self.lives: list[tuple[int, np.ndarray, int]] = []  # (length first seen, its last tokens, length last seen)

    def update(self, histories: list) -> list[int]:
        """Each row's generated tokens so far (`histories[b]`: its verified tokens this step)."""
        pairs = pair_rows(self.lives, histories, self._continues)
        lives = []
        for history, found in zip(histories, pairs):
            if found is None:
                born = len(history)
                lives.append((born, np.array(history[max(0, born - self.signature) : born]), born))
            else:
                born, tail, _ = self.lives[found]
                lives.append((born, tail, len(history)))
        for i in sorted(set(range(len(self.lives))) - set(pairs)):  # rows no longer seen: finished
            born, _, last = self.lives[i]
            self.lengths.record(last - born + 1)
        self.lives = lives
        return [len(history) - born + 1 for history, (born, _, _) in zip(histories, lives)]

    @staticmethod
    def _continues(life: tuple, history) -> bool:
        born, tail, last = life
        return len(history) >= last and np.array_equal(history[born - len(tail) : born], tail)
