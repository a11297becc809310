"""The client's drafter cache: the server's drafter and tokenizer kept on the device, one folder per revision.

    <root>/<server key>/<revision>/manifest.json          every file's size and sha256, the server's /v1/info
                                  /drafter.safetensors    the drafter exactly as the server sent it
                                  /tokenizer/...          the tokenizer's files

<root>: `cache_dir`, else `$MOA_HF_DRAFTER_CACHE`, else `~/.cache/moa_hf/drafters` (next to the default target's
`~/.cache/moa_hf/smollm2-135m-instruct`). <server key>: the server's host and port. <revision>: the
`protocol.download_revision` of the files, which the server announces in /v1/info: a folder's name says what it
holds, as in the Hugging Face cache, and an entry is never modified once written.

An entry is written into a temporary folder of the same filesystem (`.tmp-<revision>-<pid>-...`), fsynced, and
renamed into place with its manifest last; a download that breaks off leaves nothing (the temporary folder is
removed, or swept later when its process died). Every load re-hashes the files against the manifest and recomputes
the revision: a corrupt, partial or tampered entry (a flipped byte, a missing or extra file, a truncated safetensors
file, no manifest) is never loaded; it is removed, and the newest valid entry (or a fresh download) is used instead.
Safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from .protocol import DRAFTER_FILE, TOKENIZER_DIR, decode_drafter, download_revision, sha256_hex

__all__ = ["CACHE_ENV_VAR", "DEFAULT_CACHE_DIR", "CacheError", "CachedDrafter", "DrafterCache", "server_key"]

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "MOA_HF_DRAFTER_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/moa_hf/drafters")
MANIFEST = "manifest.json"
_FORMAT = 1
_REVISION = re.compile(r"[0-9a-f]{16}")
_TMP, _TRASH = ".tmp-", ".trash-"
_STALE_TMP_S = 3600.0  # a temporary folder this old is a leftover even if a process with its pid still runs


class CacheError(ValueError):
    """A cache entry (or a download into one) is not what its revision says."""


@dataclass
class CachedDrafter:
    """A checked cache entry, loaded: the drafter (own embeddings), the tokenizer (None if the server had none)."""

    path: Path
    revision: str
    manifest: dict
    drafter: torch.nn.Module
    tokenizer: object | None

    @property
    def server_info(self) -> dict:
        """The server's /v1/info when the entry was downloaded (limits and EOS ids for an offline start)."""
        return self.manifest["server_info"]


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else `$MOA_HF_DRAFTER_CACHE`, else `~/.cache/moa_hf/drafters`."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser().absolute()


def server_key(url: str) -> str:
    """A folder name for a server URL: its host and port (and path), e.g. `127.0.0.1_8000`."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    key = f"{parts.hostname or 'localhost'}_{port}{parts.path.rstrip('/')}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


class DrafterCache:
    """The cache entries of one server (see the module doc). `keep`: how many revisions to keep per server (the
    current one and the previous ones, to fall back on while a newer one cannot be downloaded)."""

    def __init__(self, server: str, cache_dir: str | os.PathLike[str] | None = None, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep}: a cache must keep at least one revision")
        self.root = resolve_cache_dir(cache_dir)
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(
                f"The drafter cache {self.root} is a file, not a folder: pass another cache_dir (--cache-dir) or set "
                f"${CACHE_ENV_VAR} to a folder."
            )
        self.folder = self.root / server_key(server)
        self.keep = keep

    # -- reading ----------------------------------------------------------------------------------------------------
    def load(self, revision: str | None = None, dtype: torch.dtype = torch.float32) -> CachedDrafter | None:
        """The entry of `revision` (None: the newest valid entry), checked and loaded; None if there is none.
        Invalid entries met on the way are removed (with a warning) and never loaded."""
        if revision is not None:
            _check_revision(revision)
        for path in self._entries() if revision is None else [self.folder / revision]:
            if not path.is_dir():
                continue
            try:
                return self._load(path, dtype)
            except CacheError as err:
                logger.warning("ignoring the cached drafter %s: %s", path, err)
                self._discard(path)
        return None

    def revisions(self) -> list[str]:
        """The revisions held (newest first, by download time), without checking their files."""
        return [path.name for path in self._entries()]

    def _entries(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        entries = [p for p in self.folder.iterdir() if p.is_dir() and _REVISION.fullmatch(p.name)]
        return sorted(entries, key=_created_at, reverse=True)

    def _load(self, path: Path, dtype: torch.dtype) -> CachedDrafter:
        manifest, blob = _check_entry(path)  # the drafter's bytes as checked: decoded without reading them again
        try:
            drafter = decode_drafter(blob, dtype)
        except Exception as err:  # hash-valid but not a drafter: a broken entry all the same
            raise CacheError(f"{DRAFTER_FILE} is not a loadable drafter ({err})") from err
        tokenizer = None
        if (path / TOKENIZER_DIR).is_dir():
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(path / TOKENIZER_DIR)
            except Exception as err:
                raise CacheError(f"its tokenizer does not load ({err})") from err
        return CachedDrafter(path, path.name, manifest, drafter, tokenizer)

    # -- writing ----------------------------------------------------------------------------------------------------
    @contextmanager
    def writing(self, revision: str, server_info: dict) -> Iterator[Path]:
        """Yields an empty temporary folder to download `revision`'s files into (`DRAFTER_FILE`, `TOKENIZER_DIR/`);
        on a normal exit they are checked against `revision`, fsynced and renamed into place; on an error (or a
        revision mismatch) the folder is removed: nothing half-written remains."""
        _check_revision(revision)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._sweep()
            tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}{revision}-{os.getpid()}-", dir=self.folder))
            tmp.chmod(0o755)  # mkdtemp makes it private (0o700); the renamed entry should be a normal folder
        except OSError as err:
            raise OSError(
                f"cannot write the drafter cache in {self.folder} ({err}): pass a writable cache_dir (--cache-dir), "
                f"set ${CACHE_ENV_VAR}, or turn the cache off (--no-cache)"
            ) from err
        try:
            yield tmp
            self._commit(tmp, revision, server_info)
        except OSError as err:
            if isinstance(err, ConnectionError):  # the download's own error, not the disk's
                raise
            raise OSError(
                f"writing the drafter cache in {self.folder} failed ({err}): free some space, pass another cache_dir "
                "(--cache-dir), or turn the cache off (--no-cache)"
            ) from err
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a commit

    def _commit(self, tmp: Path, revision: str, server_info: dict) -> Path:
        files = {path: _record((tmp / path).read_bytes()) for path in _relative_files(tmp)}
        found = download_revision({path: record["sha256"] for path, record in files.items()})
        if found != revision:
            raise CacheError(
                f"the downloaded files have revision {found}, the server announced {revision}: the server changed "
                "its drafter during the download, or the transfer was corrupted; start the client again"
            )
        manifest = {
            "format": _FORMAT,
            "revision": revision,
            "created_at": time.time(),
            "files": files,
            "server_info": server_info,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        final = self.folder / revision
        if final.exists():  # a broken entry being replaced (a valid one is not downloaded again)
            self._discard(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            check_entry(final)  # another client stored the same revision first: keep theirs if it is valid
        _fsync_dir(self.folder)
        self._prune()
        return final

    def _discard(self, path: Path) -> None:
        """Remove an entry: renamed aside first (atomic), so a half-deleted folder never looks like an entry."""
        trash = path.with_name(f"{_TRASH}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.rename(path, trash)
        except OSError as err:
            logger.warning("could not remove the cache entry %s (%s)", path, err)
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove leftovers: temporary folders of processes that died (or older than an hour), trash."""
        now = time.time()
        for path in self.folder.iterdir():
            if path.name.startswith(_TRASH):
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith(_TMP):
                pid = path.name[len(_TMP) :].split("-")[1:2]
                alive = bool(pid) and pid[0].isdigit() and _pid_alive(int(pid[0]))
                try:
                    stale = now - path.stat().st_mtime > _STALE_TMP_S
                except FileNotFoundError:  # its writer just finished or removed it
                    continue
                if not alive or stale:
                    logger.info("removing the leftover of an interrupted download: %s", path)
                    shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        for path in self._entries()[self.keep :]:
            self._discard(path)


def _check_revision(revision: str) -> None:
    """A revision names a folder: 16 hex digits, nothing a server could use to point elsewhere (`../x`)."""
    if not isinstance(revision, str) or not _REVISION.fullmatch(revision):
        raise CacheError(f"the server announced revision {revision!r}, not 16 hex digits: is it a `moa serve`?")


def check_entry(path: Path) -> dict:
    """The manifest of the entry at `path` once every file matches it (size, sha256, no file missing or extra) and
    the files' revision is the folder's name; raises `CacheError` saying what is wrong."""
    return _check_entry(path)[0]


def _check_entry(path: Path) -> tuple[dict, bytes]:
    """(manifest, the drafter file's bytes) of a checked entry (see `check_entry`)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CacheError(f"no {MANIFEST} (an interrupted or foreign folder)") from None
    except (OSError, ValueError) as err:
        raise CacheError(f"unreadable {MANIFEST} ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or manifest.get("revision") != path.name:
        raise CacheError(f"{MANIFEST} is not a format-{_FORMAT} manifest of revision {path.name}")
    files = manifest.get("files")
    if not isinstance(files, dict) or DRAFTER_FILE not in files or not isinstance(manifest.get("server_info"), dict):
        raise CacheError(f"{MANIFEST} lists no {DRAFTER_FILE} or no server info")
    present = set(_relative_files(path)) - {MANIFEST}
    if present != set(files):
        missing, extra = sorted(set(files) - present), sorted(present - set(files))
        raise CacheError(f"files missing {missing}, unexpected {extra}")
    blob = b""
    for name, record in files.items():
        data = (path / name).read_bytes()
        if _record(data) != record:
            raise CacheError(f"{name} does not match its size and sha256 in {MANIFEST} (truncated or corrupted)")
        blob = data if name == DRAFTER_FILE else blob
    found = download_revision({name: record["sha256"] for name, record in files.items()})
    if found != path.name:
        raise CacheError(f"its files have revision {found}, not {path.name}")
    return manifest, blob


def _relative_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _record(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": sha256_hex(data)}


def _created_at(path: Path) -> float:
    try:
        return float(json.loads((path / MANIFEST).read_text(encoding="utf-8"))["created_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return path.stat().st_mtime  # a broken manifest: the entry fails its check when it is loaded


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):  # files and subfolders before their parent
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(path)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make a folder's entries (new names, renames) durable; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it there: rely on the age of the folder alone
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
