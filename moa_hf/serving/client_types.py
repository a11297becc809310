"""What `MoAClient` hands back and raises, and its settings: `GenerationEvent`, `GenerationResult`, `ServingError`,
the transient conditions its retry loop handles (`Unreachable`, `ServerBusy`, `CorruptedAnswer`, `SessionLost`), and
`ClientSettings` (every keyword of `MoAClient` besides the drafter, tokenizer and transport)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = [
    "ClientSettings",
    "CorruptedAnswer",
    "GenerationEvent",
    "GenerationResult",
    "ServerBusy",
    "ServingError",
    "SessionLost",
    "Unreachable",
]


class ServingError(RuntimeError):
    """The server refused a request (a 4xx that retrying cannot fix): `status` and the server's `detail`."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"the server answered {status}: {detail}")
        self.status, self.detail = status, detail


class Unreachable(Exception):
    """The server could not be reached (or answered a transient error): keep drafting, retry later."""


class ServerBusy(Exception):
    """The server answers but cannot take the call now (429, 503 with Retry-After, or a timeout while its health
    answers): wait `retry_after_s` and retry, drafting nothing meanwhile."""

    def __init__(self, why: str, retry_after_s: float = 1.0, queue_depth: int | None = None):
        super().__init__(why)
        self.retry_after_s, self.queue_depth = retry_after_s, queue_depth


class CorruptedAnswer(Exception):
    """An answer that is not a valid one (unparseable, wrong content type, digest mismatch, inconsistent fields)."""


class SessionLost(Exception):
    """The server no longer has the session (restart, expiry, or diverged state): create a new one."""


@dataclass
class GenerationEvent:
    """What `MoAClient.iter_generate` yields.

    kind: "verified" (tokens confirmed by the target, `text` is their decoded text), "unverified" (tokens drafted
    while the server was unreachable), "rollback" (that many unverified tokens were rejected and dropped),
    "offline" / "online" (the server became unreachable / reachable again), "waiting" (the server is busy: the
    client waits for admission, drafting nothing; `text` says why).
    `position`: index (among generated tokens) of the first token of `token_ids`.
    """

    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    position: int = 0


@dataclass
class GenerationResult:
    """One generation. `token_ids` are the generated tokens (prompt excluded); `verified` is True when the target
    verified every one of them, else `unverified_span` = [start, end) are the `unverified_tokens` at the end that no
    server verified (drafter-only text: the server was unreachable, or admission timed out); None when all were."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    server_calls: int
    verified: bool
    unverified_tokens: int
    unverified_span: list[int] | None
    offline_spans: list[dict]
    timings: dict
    stats: dict

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ClientSettings:
    """How a `MoAClient` drafts, talks to the server and caches its drafter; every field is also a keyword of
    `MoAClient` (`MoAClient(url, draft_length=4)` is `MoAClient(url, settings=ClientSettings(draft_length=4))`).

    token: the server's auth token (sent as a Bearer token).
    draft_length: a fixed number of drafted tokens per call (0: plain decoding, one call per token), or None to adapt
        it between `min_draft_length` and `max_draft_length`.
    context_format: how the server sends context vectors: "fp16", "int8" (with scales) or "fp32".
    draft_top_k: with sampling, the drafter samples from its top-k tokens (sent to the server as its q).
    timeout_s, connect_timeout_s: the HTTP timeouts of one call.
    backoff_initial_s, backoff_max_s: retry delays while the server is unreachable (doubling).
    reconnect_timeout_s: once every token is drafted offline, how long to keep retrying before returning the result
        with an unverified tail.
    admission_timeout_s: how long to wait for a busy server (429/503 with Retry-After) before drafting alone.
    corrupt_retries: how many times a corrupted answer is asked for again before the server counts as unreachable.
    check_drafter: refuse a given drafter whose LSA or recorded target differs from the server's.
    cache_dir: the drafter cache (default `$MOA_HF_DRAFTER_CACHE`, else `~/.cache/moa_hf/drafters`);
        `use_cache=False` keeps a downloaded drafter in memory only.
    offline: never contact the server: draft alone with the given or newest cached drafter (all unverified).
    info_max_age_s: a generation starting this long after the client last read /v1/info reads it again (and switches
        drafters if the server now runs another revision); it is read again after every outage too.
    """

    token: str | None = field(
        default=None, metadata={"help": "the token itself (visible in `ps`: prefer --token-file)"}
    )
    draft_length: int | None = field(
        default=None, metadata={"help": "fixed drafted tokens per call (0: plain decoding); default: adaptive"}
    )
    min_draft_length: int = 0
    max_draft_length: int = 16
    context_format: str = field(default="fp16", metadata={"choices": ["fp16", "int8", "fp32"]})
    draft_top_k: int = 32
    timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    reconnect_timeout_s: float = field(
        default=10.0, metadata={"help": "after drafting every token offline, how long to wait for the server"}
    )
    admission_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "how long to wait for a busy server (it answers 429/503 with Retry-After) before drafting alone"
        },
    )
    corrupt_retries: int = 3
    check_drafter: bool = True
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "the drafter cache: the server's drafter and tokenizer, one folder per revision, used when the "
            "server runs that revision or does not answer (default: $MOA_HF_DRAFTER_CACHE, else "
            "~/.cache/moa_hf/drafters)"
        },
    )
    use_cache: bool = True
    offline: bool = field(
        default=False,
        metadata={
            "help": "do not contact the server: generate with --drafter or the newest cached drafter alone "
            "(unverified)"
        },
    )
    info_max_age_s: float = 60.0
