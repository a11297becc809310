"""What `moa tune` tunes: the generation-config keys of a drafting setting (`SETTING_KEYS`), its MoA prompt lookup
fields (`lookup_values`), how settings rank (`rank`), and `TuneError`."""

from __future__ import annotations

__all__ = ["SETTING_KEYS", "TuneError", "lookup_values", "rank"]

SETTING_KEYS = (
    "num_assistant_tokens",
    "assistant_confidence_threshold",
    "num_assistant_tokens_schedule",
    "lookup_num_tokens",  # MoA drafter only (0: off): its config's fields, see `moa_hf.modeling.LookupSettings`
    "lookup_min_ngram",
    "lookup_halve_per_ngram",
)


class TuneError(ValueError):
    """A tuning request that cannot run as given (the message says how to fix it)."""


def lookup_values(setting: dict) -> dict:
    """The MoA drafter config's lookup fields of `setting` (lookup off: 0 tokens, the config's own n-gram sizes)."""
    values = {
        "lookup_num_tokens": int(setting.get("lookup_num_tokens") or 0),
        "lookup_halve_per_ngram": bool(setting.get("lookup_halve_per_ngram")),
    }
    if setting.get("lookup_min_ngram") is not None:
        values["lookup_min_ngram"] = int(setting["lookup_min_ngram"])
    return values


def rank(row: dict) -> tuple[float, float]:
    """Best first: the highest speedup, then (ties) the highest acceptance length."""
    return row["speedup"] or 0.0, row["acceptance_length"] or 0.0
