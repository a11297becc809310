"""`moa serve`, `moa client`, `moa serve-bench` and `moa serve-load`.

`moa client` exit codes: 0 the whole text verified by the target (or `--best-effort`), 1 a server error (or the server
unreachable with no drafter to fall back on), 2 a usage error (one-line message, nothing sent), 3 some of the text
was never verified (server unreachable, or no admission within `--admission-timeout-s`), 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from .. import build_drafter
from ..default_target import DEFAULT_TARGET_NAME
from ..embeddings import with_own_embeddings
from ..loading import load_drafter, load_target
from ..modeling import target_fingerprint
from .client_types import ClientSettings
from .loadtest import LoadTestArguments  # standard library only: cheap for `moa --help`
from .state import ServerLimits

__all__ = [
    "EXIT_SERVER_ERROR",
    "EXIT_UNVERIFIED",
    "EXIT_USAGE",
    "ClientCommandArguments",
    "ServeArguments",
    "ServeBenchArguments",
    "load_server_drafter",
    "read_token",
    "register",
]

logger = logging.getLogger(__name__)

_DTYPE_CHOICES = ("bfloat16", "float32")
_TOKEN_ENV = "MOA_SERVE_TOKEN"
EXIT_SERVER_ERROR, EXIT_USAGE, EXIT_UNVERIFIED = 1, 2, 3


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The auth token: `--token-file PATH` (its first line), else `--token` (visible in `ps`: a warning), else
    `$MOA_SERVE_TOKEN`; None when none is set. `ValueError` for an unreadable or empty file, or both flags."""
    if token is not None and token_file is not None:
        raise ValueError("give the token once: --token-file or --token, not both")
    if token_file is not None:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"cannot read --token-file {token_file}: {err.strerror or err}") from err
        if not lines or not lines[0].strip():
            raise ValueError(f"--token-file {token_file} is empty: write the token on its first line")
        return lines[0].strip()
    if token is not None:
        logger.warning("--token is visible to every user of this machine (ps): prefer --token-file or $%s", _TOKEN_ENV)
        return token
    return os.environ.get(_TOKEN_ENV) or None


@dataclass
class ServeArguments:
    """`moa serve`'s own options; its limits are the fields of `ServerLimits`, parsed beside these."""

    host: str = field(default="127.0.0.1", metadata={"help": "bind address (default: loopback only)"})
    port: int = 8000
    target: str = field(
        default="default",
        metadata={"help": "a local Hugging Face model folder, or 'default' for SmolLM2-135M-Instruct"},
    )
    dtype: str = field(default="bfloat16", metadata={"choices": list(_DTYPE_CHOICES)})
    drafter: str | None = field(
        default=None,
        metadata={
            "help": "a saved MoA drafter folder, 'default' (the packaged drafter for the default target) or 'random' "
            "(exact output, near-zero acceptance); default: 'default' for the default target, else 'random'"
        },
    )
    allow_other_target: bool = field(
        default=False,
        metadata={
            "help": "serve a drafter trained for other weights (e.g. the base model of a fine-tuned target); exact "
            "output, lower acceptance"
        },
    )
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder (default: the target's)"})
    token_file: str | None = field(
        default=None,
        metadata={
            "help": f"a file whose first line is the auth token clients must send (or ${_TOKEN_ENV}); required off "
            "loopback"
        },
    )
    token: str | None = field(
        default=None, metadata={"help": "the token itself (visible in `ps`: prefer --token-file)"}
    )
    docs: bool = field(
        default=False, metadata={"help": "serve the API docs (/docs, /redoc, /openapi.json), behind the token"}
    )
    memory_budget_gb: float | None = field(
        default=None,
        metadata={
            "help": "the sessions' projected caches, in GB (prompt + max_new_tokens + drafts per session; default: "
            "25%% of the RAM, or of the GPU's memory on CUDA)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the random drafter"})
    log_level: str = "info"


@dataclass
class ClientCommandArguments:
    """`moa client`'s own options; the client's settings (draft length, timeouts, cache, offline, the token, ...) are
    `ClientSettings` fields, parsed beside these (`HfArgumentParser`)."""

    prompt: str = field(metadata={"help": "the prompt (one user turn in the target's chat template unless --raw)"})
    server: str = "http://127.0.0.1:8000"
    max_new_tokens: int = 128
    json: bool = field(
        default=False,
        metadata={"help": "print one JSON object (text, token_ids, server_calls, unverified_tokens, ...)"},
    )
    raw: bool = field(default=False, metadata={"help": "send the prompt as raw text (no chat template)"})
    token_file: str | None = field(
        default=None, metadata={"help": f"a file whose first line is the server's auth token (or ${_TOKEN_ENV})"}
    )
    drafter: str | None = field(
        default=None,
        metadata={
            "help": "a local drafter folder (own embeddings); if it does not exist, the server's drafter and "
            "tokenizer are downloaded and saved there (default: the server's, from the drafter cache)"
        },
    )
    no_cache: bool = field(
        default=False, metadata={"help": "download the server's drafter into memory only (no drafter cache)"}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "a local tokenizer folder (default: the drafter folder's, else the server's)"}
    )
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    best_effort: bool = field(
        default=False,
        metadata={
            "help": "exit 0 even when some text was never verified (drafter-only; still said on stderr; default: exit "
            f"{EXIT_UNVERIFIED})"
        },
    )


@dataclass
class ServeBenchArguments:
    """`moa serve-bench`'s options."""

    target: str = "default"
    dtype: str = field(default="float32", metadata={"choices": list(_DTYPE_CHOICES)})
    drafter: str | None = field(
        default=None,
        metadata={
            "help": "a drafter folder, 'default' or 'random' (as for `moa serve`); the client side gets a copy with "
            "its own embedding and LM head"
        },
    )
    profiles: str = "lan,4g,3g,satellite"
    prompts: int = field(default=3, metadata={"help": "how many of the built-in prompts"})
    max_new_tokens: int = 32
    outage_after: int = field(default=8, metadata={"help": "cut the link after this many verified tokens"})
    outage_tokens: int = field(default=16, metadata={"help": "restore it after this many offline tokens"})
    seed: int = 0
    output: str | None = field(default=None, metadata={"help": "write the JSON report here"})


def register(subparsers) -> None:
    """Add the `serve`, `client`, `serve-bench` and `serve-load` subcommands (their options: the fields of
    `ServeArguments` + `ServerLimits`, `ClientCommandArguments` + `ClientSettings`, `ServeBenchArguments` and
    `LoadTestArguments`)."""
    p = subparsers.add_parser(
        "serve",
        parents=[HfArgumentParser((ServeArguments, ServerLimits), add_help=False)],
        help="host a target for client-server speculative decoding",
        description="Host the target (and the drafter's LSA) behind an HTTP server; clients draft locally and send "
        "one verification request per drafting cycle. Options: the fields of ServeArguments and ServerLimits, each "
        "spelled with hyphens or underscores.",
    )
    p.set_defaults(func=_serve)

    c = subparsers.add_parser(
        "client",
        parents=[HfArgumentParser((ClientCommandArguments, ClientSettings), add_help=False)],
        help="generate with a local drafter and a `moa serve` server",
        description="Draft locally, verify on the server, stream the verified text. Options: the fields of "
        "ClientCommandArguments and of ClientSettings (the client's settings), each spelled with hyphens or "
        "underscores.",
    )
    c.set_defaults(func=_client)

    b = subparsers.add_parser(
        "serve-bench",
        parents=[HfArgumentParser(ServeBenchArguments, add_help=False)],
        help="benchmark client-server drafting over emulated links",
        description="Measure server calls per token, latency per token against plain "
        "token-by-token streaming, and drafter-only quality during an outage, over emulated "
        "LAN / 4G / 3G / satellite links (real sockets on 127.0.0.1).",
    )
    b.set_defaults(func=_bench)

    load = subparsers.add_parser(
        "serve-load",
        parents=[HfArgumentParser(LoadTestArguments, add_help=False)],
        help="load-test a `moa serve` server with concurrent clients",
        description="Start `moa serve` (or attach to --server), run one client alone, then N concurrent clients "
        "(drafting here) per phase; report latency p50/p95, verified tokens/s, exactness against the single-client "
        "output, /v1/health latency, server RSS, HTTP errors and unverified tokens. Bounded by --max-seconds.",
    )
    load.set_defaults(func=_load)


# ---------------------------------------------------------------------------------------------------------------------
def load_server_drafter(spec: str | None, target, seed: int = 0, own_embeddings: bool = False):
    """(drafter, description). `spec`: a saved drafter folder, "default" (the packaged drafter for the default
    target), "random" (seeded, correct output but near-zero acceptance), or None: "default" when serving the default
    target and the packaged drafter exists, else "random"."""

    from .. import default_drafter_path  # looked up when called: `moa_hf.default_drafter_path` may be replaced

    packaged = default_drafter_path()
    if spec is None:  # the packaged drafter serves the default target, recognised by its weights (or its name)
        recorded = None
        if (packaged / "config.json").is_file():
            recorded = json.loads((packaged / "config.json").read_text()).get("target_fingerprint")
        actual = target_fingerprint(target) if recorded else None
        if recorded and actual:
            is_default = actual == recorded
        else:
            is_default = getattr(target.config, "name_or_path", None) == DEFAULT_TARGET_NAME
        spec = "default" if is_default and (packaged / "config.json").is_file() else "random"
    if spec == "random":
        logger.warning("Using a RANDOM drafter (seed %d): output stays exact, acceptance will be near zero.", seed)
        torch.manual_seed(seed)
        return build_drafter(target, own_embeddings=own_embeddings).eval(), f"random (seed {seed})"
    name = "packaged default drafter" if spec == "default" else str(spec)
    return load_drafter(spec, dtype=target.dtype, kind="moa"), name


def _missing_extras() -> str | None:
    """None if the `serving` extras are installed, else a message saying how to install them."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(name) is None]
    if missing:
        return f"error: {', '.join(missing)} not installed; install the serving extras: pip install 'moa-hf[serving]'"
    return None


def _serve(args) -> int:
    if (message := _missing_extras()) is not None:
        print(message, file=sys.stderr)
        return 2
    from .server import ServingState, create_app, is_loopback, run_server

    try:
        token = read_token(args.token, args.token_file)
        _, limits = HfArgumentParser((ServeArguments, ServerLimits)).parse_dict(vars(args), allow_extra_keys=True)
        if args.memory_budget_gb is not None:
            limits = dataclasses.replace(limits, memory_budget_bytes=int(args.memory_budget_gb * 1e9))
        _check_limits(limits)
    except ValueError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    if not is_loopback(args.host) and token is None:
        print(
            f"error: --host {args.host} is not a loopback address: set an auth token with --token-file or "
            f"${_TOKEN_ENV} (clients then pass the same token)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    target, tokenizer = load_target(  # `default` or a local folder, never downloaded; the clients may send token ids
        args.target,
        dtype=args.dtype,
        device="cpu",
        tokenizer=args.tokenizer,
        require_tokenizer=False,
        local_files_only=True,
    )
    drafter, _ = load_server_drafter(args.drafter, target, seed=args.seed)
    state = ServingState(
        target, drafter, tokenizer=tokenizer, limits=limits, token=token, allow_other_target=args.allow_other_target
    )
    print(f"moa serve: {state.info()['target']} ({args.dtype}) on http://{args.host}:{args.port}", file=sys.stderr)
    app = create_app(state, docs=args.docs)
    run_server(state, app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


def _check_limits(limits) -> None:
    """`ValueError` (one line) for limits that cannot work."""
    for name in ("max_sessions", "max_tokens_per_session", "max_batch", "prefill_chunk", "max_request_bytes"):
        if getattr(limits, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(limits, name)}")
    for name in ("max_draft_tokens", "max_queue", "max_context_reply"):
        if getattr(limits, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(limits, name)}")
    for name in ("session_ttl_s", "admission_wait_s", "header_timeout_s", "body_timeout_s"):
        if not getattr(limits, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(limits, name)}")
    if limits.memory_budget_bytes is not None and not limits.memory_budget_bytes > 0:
        raise ValueError("--memory-budget-gb must be > 0")


def _client(args) -> int:
    """`moa client`: every failure is one line on stderr with its exit code (see the module doc)."""
    if (message := _missing_extras()) is not None:
        print(message, file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run_client(args)
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        return 130
    except ValueError as err:  # a usage error: a bad option, a prompt too long for the server, a mismatched drafter
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # the server refused, or is unreachable with nothing to draft with
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return EXIT_SERVER_ERROR


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _check_client_args(args) -> None:
    """Usage errors found before any request (`ValueError`, one line)."""
    from .protocol import check_max_new_tokens, check_sampling

    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text with --prompt")
    check_max_new_tokens(args.max_new_tokens)
    check_sampling(args.temperature, args.top_p, args.top_k, do_sample=args.do_sample)
    for name in ("timeout_s", "reconnect_timeout_s", "admission_timeout_s"):
        if not getattr(args, name) >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("draft_length", "max_draft_length"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.offline and args.no_cache and not args.drafter:
        raise ValueError("--offline with --no-cache leaves nothing to draft with: pass --drafter DIR")


def _run_client(args) -> int:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .client import MoAClient

    _check_client_args(args)
    hf_logging.disable_progress_bar()  # stderr carries the command's own lines only (this process ends after it)
    token = read_token(args.token, args.token_file)
    drafter = tokenizer = None
    folder = Path(args.drafter) if args.drafter else None
    if folder is not None and (folder / "config.json").is_file():
        drafter = load_drafter(folder, dtype=torch.float32, kind="moa")
        if (folder / "tokenizer_config.json").is_file() and args.tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(folder)
    if args.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    _, settings = HfArgumentParser((ClientCommandArguments, ClientSettings)).parse_dict(
        vars(args), allow_extra_keys=True
    )
    settings = dataclasses.replace(settings, token=token, use_cache=settings.use_cache and not args.no_cache)
    client = MoAClient(args.server, drafter=drafter, tokenizer=tokenizer, settings=settings)
    with client:
        try:
            client.prepare()
            client.load_tokenizer()
        except ValueError:  # a drafter that does not fit the server's: a usage error
            raise
        except Exception as err:  # the server unreachable and no drafter to fall back on, a refused token, ...
            raise RuntimeError(_one_line(err)) from err
        if not client.connected:
            source = f"cached drafter (revision {client.revision})" if client.revision else "local drafter"
            why = "offline mode" if args.offline else "server unreachable"
            print(
                f"[{why}: generating with the {source} alone; tokens stay unverified until it answers]",
                file=sys.stderr,
            )
        if folder is not None and drafter is None:
            client.drafter.save_pretrained(folder)
            client.tokenizer.save_pretrained(folder)
            print(f"saved the server's drafter and tokenizer to {folder}", file=sys.stderr)
        result = _stream(client, args)
    if args.json:
        out = result.as_dict()
        out["prompt_tokens"] = len(out.pop("prompt_ids"))
        print(json.dumps(out))
    elif result.unverified_span is not None:
        start = result.unverified_span[0]
        verified = client.tokenizer.decode(result.token_ids[:start], skip_special_tokens=True)
        sys.stdout.write(result.text[len(verified) :])
        print()
    else:
        print()
    if result.verified:
        return 0
    why = "offline mode" if args.offline else "the server was unreachable or did not admit the client in time"
    print(
        f"[unverified: the last {result.unverified_tokens} of {len(result.token_ids)} tokens were drafted without "
        f"the target ({why})]",
        file=sys.stderr,
    )
    return 0 if args.best_effort or args.offline else EXIT_UNVERIFIED


def _stream(client, args):
    """Run the generation, streaming the verified text to stdout (unless --json) and state changes to stderr."""
    quiet_offline = not client.connected  # already said
    events = client.iter_generate(
        args.prompt,
        args.max_new_tokens,
        raw=args.raw,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            return stop.value
        if event.kind == "waiting":
            print(f"[server busy: waiting for admission ({event.text})]", file=sys.stderr)
        if args.json:
            continue
        if event.kind == "verified":
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif event.kind == "offline" and not quiet_offline:
            print("\n[server unreachable: drafting alone, retrying]", file=sys.stderr)
        elif event.kind == "online":
            quiet_offline = False
            print("\n[server back: verifying the drafted tokens]", file=sys.stderr)


def _bench(namespace) -> int:
    if (message := _missing_extras()) is not None:
        print(message, file=sys.stderr)
        return 2
    from .bench import format_report, run_serving_bench

    (args,) = HfArgumentParser(ServeBenchArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    target, tokenizer = load_target(
        args.target, dtype=args.dtype, device="cpu", require_tokenizer=False, local_files_only=True
    )
    if tokenizer is None:
        print("error: the benchmark needs the target's tokenizer (its prompts are text)", file=sys.stderr)
        return 2
    drafter, name = load_server_drafter(args.drafter, target, seed=args.seed, own_embeddings=True)
    drafter = with_own_embeddings(drafter, target)  # the client side runs alone: give it copies of the target's
    drafter = drafter.float().eval()
    report = run_serving_bench(
        target,
        tokenizer,
        drafter,
        profiles=args.profiles.split(","),
        num_prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        outage_after=args.outage_after,
        outage_tokens=args.outage_tokens,
        drafter_name=name,
    )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    return 0


def _load(namespace) -> int:
    if (message := _missing_extras()) is not None:
        print(message, file=sys.stderr)
        return EXIT_USAGE
    from .loadtest import run_from_args

    (args,) = HfArgumentParser(LoadTestArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    return run_from_args(args)
