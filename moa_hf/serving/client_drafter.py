"""How `MoAClient` gets its drafter and tokenizer: the one given, the server's from the drafter cache or downloaded
into it, the newest cached copy while the server is unreachable; and the checks that it fits the server's target and
LSA (`ClientDrafterMixin`, a base of `MoAClient`)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import httpx
import torch

from .cache import CachedDrafter, CacheError
from .protocol import DRAFTER_FILE, TOKENIZER_DIR, decode_drafter, lsa_fingerprint, tokenizer_file_bytes

__all__ = ["ClientDrafterMixin"]

logger = logging.getLogger("moa_hf.serving.client")


class ClientDrafterMixin:
    """The drafter and tokenizer of `MoAClient` (which provides `connection`, a `ServerConnection`, and the cache)."""

    def prepare(self, dtype: torch.dtype = torch.float32) -> dict | None:
        """Ask the server for its /v1/info and get the drafter ready (see `load_drafter`); returns the info, or
        None when the server is unreachable (then the client starts offline, with a cached or given drafter)."""
        info = self.connection.try_info()
        if self.drafter is None or self._stale(info):
            self._dtype = dtype
            self._load_server_drafter(info, fall_back=True)
            info = self.connection.last_info
        self._check_fingerprint(info)
        return info

    def _stale(self, info: dict | None) -> bool:
        """Whether the server (answering with `info`) now announces another revision than the drafter it gave."""
        return info is not None and not self._given_drafter and info["drafter"].get("revision") != self.revision

    def load_drafter(self, dtype: torch.dtype = torch.float32):
        """The drafter: the one given; else the server's current one, from the cache when it holds the revision the
        server announces (downloaded into the cache otherwise); else, the server unreachable (or the download
        broken off), the newest valid cached copy. Raises `ConnectionError` when there is none of these."""
        if self.drafter is None:
            self.prepare(dtype)
        return self.drafter

    def _load_server_drafter(self, info: dict | None, fall_back: bool) -> None:
        """Load the drafter of the server whose /v1/info is `info` (None: unreachable) from the cache or a download;
        `fall_back`: when that fails for want of the server, take the newest valid cached copy."""
        revision = (info or {}).get("drafter", {}).get("revision")
        if info is not None and (self.cache is None or revision is None):  # no cache (or an older server)
            blob = self.connection.fetch("/v1/drafter", timeout=httpx.Timeout(600.0, connect=10.0)).content
            self._set_drafter(decode_drafter(blob, self._dtype), revision)
            return
        entry = None
        if info is not None:
            entry = self.cache.load(revision, self._dtype)
            if entry is None:
                try:
                    entry = self._download(revision, info)
                except (ConnectionError, CacheError) as err:  # the server went away (or changed) meanwhile
                    if not fall_back:
                        raise ConnectionError(str(err)) from err
                    logger.warning("downloading the server's drafter failed (%s)", err)
                    self.connection.forget(str(err))
        if entry is None and self.cache is not None:
            entry = self.cache.load(None, self._dtype)
            if entry is not None:
                logger.warning(
                    "server unreachable (%s): using the cached drafter %s, downloaded %s; every token stays "
                    "unverified until the server answers",
                    self.connection.unreachable,
                    entry.path,
                    time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.manifest["created_at"])),
                )
        if entry is None:
            where = f"{self.cache.folder} holds no valid cached drafter for it" if self.cache else "the cache is off"
            why = self.connection.unreachable or f"cannot reach the server at {self.server}"
            raise ConnectionError(
                f"{why}; and {where}. Start the server "
                "(`moa serve`) and run the client again (it then caches the drafter for offline use), or pass a "
                "drafter folder (`moa client --drafter DIR`, `MoAClient(drafter=...)`)."
            )
        self._use_entry(entry)

    def _download(self, revision: str, info: dict) -> CachedDrafter:
        """Download the server's drafter (and tokenizer) into a new cache entry; a failure leaves nothing behind."""
        logger.info("downloading the server's drafter (revision %s) into %s", revision, self.cache.folder)
        with self.cache.writing(revision, info) as tmp:
            self.connection.download("/v1/drafter", tmp / DRAFTER_FILE)
            if info.get("has_tokenizer"):
                self._write_tokenizer(tmp / TOKENIZER_DIR)
        entry = self.cache.load(revision, self._dtype)
        if entry is None:
            raise CacheError(f"the new cache entry {self.cache.folder / revision} does not load (see the warning)")
        return entry

    def _write_tokenizer(self, folder: Path) -> None:
        """Write the server's tokenizer files (GET /v1/tokenizer) into `folder`."""
        files = tokenizer_file_bytes(self.connection.fetch("/v1/tokenizer").json())
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)

    def _use_entry(self, entry: CachedDrafter) -> None:
        self._set_drafter(entry.drafter, entry.revision)
        self._cached_info = entry.server_info
        if not self._given_tokenizer and entry.tokenizer is not None:
            self.tokenizer = entry.tokenizer

    def _set_drafter(self, drafter, revision: str | None) -> None:
        self.drafter, self.revision = drafter.eval(), revision
        self._fingerprint = lsa_fingerprint(drafter)

    def load_tokenizer(self):
        """The target's tokenizer: the one given or cached with the drafter, else downloaded from the server (needed
        for text prompts and streaming)."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            with tempfile.TemporaryDirectory() as tmp:
                self._write_tokenizer(Path(tmp))
                self.tokenizer = AutoTokenizer.from_pretrained(tmp)
        return self.tokenizer

    def _recorded_targets(self) -> dict:
        """{target name: recorded target fingerprint (or None)} of the drafter: its primary target and, for a sorted
        multi-target drafter (`drafter.target_names`), the extra ones (`config.extra_targets`). {None: ...} for a
        drafter without named targets."""
        c = self.drafter.config
        extra = getattr(c, "extra_targets", None) or {}
        names = list(getattr(self.drafter, "target_names", None) or [None])
        primary = getattr(c, "target_fingerprint", None)
        return {name: extra[name].get("target_fingerprint") if name in extra else primary for name in names}

    def _check_fingerprint(self, info: dict | None) -> None:
        """Draft for the server's target and refuse a drafter that does not fit the server's: a multi-target drafter
        selects the target whose recorded fingerprint is the server target's (the client has no target to attach,
        `/v1/info` gives its fingerprint, or the cached copy's while it is unreachable); its LSA must be the one the
        server runs."""
        known_info = info or self._cached_info
        if known_info is None or self.drafter is None:
            return
        theirs, recorded = known_info.get("target_fingerprint"), self._recorded_targets()
        matched = [name for name, fp in recorded.items() if fp and fp == theirs]
        if matched and len(recorded) > 1:
            self.drafter.select_target(matched[0])
        if not self.check_drafter or info is None:
            return
        known = {name: fp for name, fp in recorded.items() if fp}
        if theirs and known and not matched:
            mine = ", ".join(f"{fp} ({name})" if name else fp for name, fp in known.items())
            raise ValueError(
                "This client's drafter was trained for other target weights than the server's target (target "
                f"fingerprint {mine} vs {theirs}). Use the drafter trained for the server's model, or let the client "
                "download the server's (no --drafter)."
            )
        server = info["drafter"]["lsa_fingerprint"]
        if server != self._fingerprint:
            raise ValueError(
                f"This client's drafter (LSA fingerprint {self._fingerprint}) differs from the server's ({server}): "
                "the context vectors the server computes would not fit it. Use the same drafter checkpoint on both "
                "sides, or let the client download the server's (no --drafter)."
            )
