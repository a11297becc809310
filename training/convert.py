"""Conversions of trained drafters: `with_own_embeddings` lives in `moa_hf.embeddings` (serving and the Hub code
use it too); `moa_hf.training.with_own_embeddings` is the same function."""

from moa_hf.embeddings import with_own_embeddings

__all__ = ["with_own_embeddings"]
