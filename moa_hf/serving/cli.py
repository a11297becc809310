"""`moa serve`, `moa client` and `moa serve-bench`."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

__all__ = ["register", "load_server_drafter"]

logger = logging.getLogger(__name__)

_DTYPE_CHOICES = ("bfloat16", "float32")
_TOKEN_ENV = "MOA_SERVE_TOKEN"


def register(subparsers) -> None:
    """Add the `serve`, `client` and `serve-bench` subcommands."""
    p = subparsers.add_parser(
        "serve",
        help="host a target for client-server speculative decoding",
        description="Host the target (and the drafter's LSA) behind an HTTP server; clients "
        "draft locally and send one verification request per drafting cycle.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--target", default="default", help="a local Hugging Face model folder, or 'default' for SmolLM2-135M-Instruct"
    )
    p.add_argument("--dtype", choices=_DTYPE_CHOICES, default="bfloat16")
    p.add_argument(
        "--drafter",
        default=None,
        help="a saved MoA drafter folder, 'default' (the packaged drafter for the default target) or "
        "'random' (exact output, near-zero acceptance); default: 'default' for the default target, else "
        "'random'",
    )
    p.add_argument(
        "--allow-other-target",
        action="store_true",
        help="serve a drafter trained for other weights (e.g. the base model of a fine-tuned target); exact output, "
        "lower acceptance",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")
    p.add_argument(
        "--token", default=None, help=f"auth token clients must send (default: ${_TOKEN_ENV}); required off loopback"
    )
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--max-tokens-per-session", type=int, default=4096)
    p.add_argument("--max-draft-tokens", type=int, default=64, help="most drafted tokens per verification call")
    p.add_argument("--session-ttl-s", type=float, default=300.0, help="idle sessions expire after this")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0, help="seed of the random drafter")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_serve)

    c = subparsers.add_parser(
        "client",
        help="generate with a local drafter and a `moa serve` server",
        description="Draft locally, verify on the server, stream the verified text.",
    )
    c.add_argument("--server", default="http://127.0.0.1:8000")
    c.add_argument("--prompt", required=True)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, server_calls, unverified_tokens, timings, ...)",
    )
    c.add_argument("--raw", action="store_true", help="send the prompt as raw text (no chat template)")
    c.add_argument("--token", default=None, help=f"the server's auth token (default: ${_TOKEN_ENV})")
    c.add_argument(
        "--drafter",
        default=None,
        help="a local drafter folder (own embeddings); if it does not exist, the server's drafter and "
        "tokenizer are downloaded and saved there (default: the server's, from the drafter cache)",
    )
    c.add_argument(
        "--cache-dir",
        default=None,
        help="the drafter cache: the server's drafter and tokenizer, one folder per revision, used when the server "
        "runs that revision or does not answer (default: $MOA_HF_DRAFTER_CACHE, else ~/.cache/moa_hf/drafters)",
    )
    c.add_argument(
        "--no-cache", action="store_true", help="download the server's drafter into memory only (no drafter cache)"
    )
    c.add_argument(
        "--offline",
        action="store_true",
        help="do not contact the server: generate with --drafter or the newest cached drafter alone (unverified)",
    )
    c.add_argument(
        "--tokenizer", default=None, help="a local tokenizer folder (default: the drafter folder's, else the server's)"
    )
    c.add_argument("--do-sample", action="store_true")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument(
        "--draft-length",
        type=int,
        default=None,
        help="fixed drafted tokens per call (0: plain decoding); default: adaptive",
    )
    c.add_argument("--max-draft-length", type=int, default=16)
    c.add_argument("--context-format", choices=["fp16", "int8", "fp32"], default="fp16")
    c.add_argument("--timeout-s", type=float, default=30.0)
    c.add_argument(
        "--reconnect-timeout-s",
        type=float,
        default=10.0,
        help="after drafting every token offline, how long to wait for the server",
    )
    c.set_defaults(func=_client)

    b = subparsers.add_parser(
        "serve-bench",
        help="benchmark client-server drafting over emulated links",
        description="Measure server calls per token, latency per token against plain "
        "token-by-token streaming, and drafter-only quality during an outage, over emulated "
        "LAN / 4G / 3G / satellite links (real sockets on 127.0.0.1).",
    )
    b.add_argument("--target", default="default")
    b.add_argument("--dtype", choices=_DTYPE_CHOICES, default="float32")
    b.add_argument(
        "--drafter",
        default=None,
        help="a drafter folder, 'default' or 'random' (as for `moa serve`); the client side gets a copy "
        "with its own embedding and LM head",
    )
    b.add_argument("--profiles", default="lan,4g,3g,satellite")
    b.add_argument("--prompts", type=int, default=3, help="how many of the built-in prompts")
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--outage-after", type=int, default=8, help="cut the link after this many verified tokens")
    b.add_argument("--outage-tokens", type=int, default=16, help="restore it after this many offline tokens")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--output", default=None, help="write the JSON report here")
    b.set_defaults(func=_bench)


# ---------------------------------------------------------------------------------------------------------------------
def _load_target(spec: str, dtype: str, tokenizer: str | None = None):
    """(model on the CPU, tokenizer or None): 'default' or a local folder, never downloaded (`moa_hf.loading`)."""
    from ..loading import load_target

    return load_target(
        spec, dtype=dtype, device="cpu", tokenizer=tokenizer, require_tokenizer=False, local_files_only=True
    )


def load_server_drafter(spec: str | None, target, seed: int = 0, own_embeddings: bool = False):
    """(drafter, description). `spec`: a saved drafter folder, "default" (the packaged drafter for the default
    target), "random" (seeded, correct output but near-zero acceptance), or None: "default" when serving the default
    target and the packaged drafter exists, else "random"."""
    from .. import build_drafter, default_drafter_path
    from ..default_target import DEFAULT_TARGET_NAME
    from ..loading import load_drafter
    from ..modeling import target_fingerprint

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
    import uvicorn

    from .server import ServerLimits, ServingState, create_app, is_loopback

    token = args.token or os.environ.get(_TOKEN_ENV) or None
    if not is_loopback(args.host) and token is None:
        print(
            f"error: --host {args.host} is not a loopback address: set an auth token with --token or "
            f"${_TOKEN_ENV} (clients then pass the same token)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    target, tokenizer = _load_target(args.target, args.dtype, args.tokenizer)
    drafter, _ = load_server_drafter(args.drafter, target, seed=args.seed)
    limits = ServerLimits(
        max_sessions=args.max_sessions,
        max_tokens_per_session=args.max_tokens_per_session,
        max_draft_tokens=args.max_draft_tokens,
        session_ttl_s=args.session_ttl_s,
        max_request_bytes=args.max_request_bytes,
    )
    state = ServingState(
        target, drafter, tokenizer=tokenizer, limits=limits, token=token, allow_other_target=args.allow_other_target
    )
    print(f"moa serve: {state.info()['target']} ({args.dtype}) on http://{args.host}:{args.port}", file=sys.stderr)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


def _client(args) -> int:
    if (message := _missing_extras()) is not None:
        print(message, file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from ..loading import load_drafter
    from .client import MoAClient

    token = args.token or os.environ.get(_TOKEN_ENV) or None
    if args.offline and args.no_cache and not args.drafter:
        print("error: --offline with --no-cache leaves nothing to draft with: pass --drafter DIR", file=sys.stderr)
        return 2
    drafter = tokenizer = None
    folder = Path(args.drafter) if args.drafter else None
    if folder is not None and (folder / "config.json").is_file():
        drafter = load_drafter(folder, dtype=torch.float32, kind="moa")
        if (folder / "tokenizer_config.json").is_file() and args.tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(folder)
    if args.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    try:
        client = MoAClient(
            args.server,
            drafter=drafter,
            tokenizer=tokenizer,
            token=token,
            draft_length=args.draft_length,
            max_draft_length=args.max_draft_length,
            context_format=args.context_format,
            timeout_s=args.timeout_s,
            reconnect_timeout_s=args.reconnect_timeout_s,
            cache_dir=args.cache_dir,
            use_cache=not args.no_cache,
            offline=args.offline,
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with client:
        try:
            client.prepare()
            client.load_tokenizer()
        except Exception as err:  # a CLI reports any failure in one line
            print(f"error: {err}", file=sys.stderr)
            return 1
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
        quiet_offline = not client.connected  # already said above
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
                result = stop.value
                break
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
    if args.json:
        out = result.as_dict()
        out["prompt_tokens"] = len(out.pop("prompt_ids"))
        print(json.dumps(out))
        return 0
    if result.unverified_span is not None:
        start = result.unverified_span[0]
        verified = client.tokenizer.decode(result.token_ids[:start], skip_special_tokens=True)
        sys.stdout.write(result.text[len(verified) :])
        print(f"\n[the last {result.unverified_tokens} tokens were never verified by the target]", file=sys.stderr)
    print()
    return 0


def _bench(args) -> int:
    if (message := _missing_extras()) is not None:
        print(message, file=sys.stderr)
        return 2
    from .bench import format_report, run_serving_bench
    from .protocol import decode_drafter, encode_drafter

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    target, tokenizer = _load_target(args.target, args.dtype)
    if tokenizer is None:
        print("error: the benchmark needs the target's tokenizer (its prompts are text)", file=sys.stderr)
        return 2
    drafter, name = load_server_drafter(args.drafter, target, seed=args.seed, own_embeddings=True)
    if not drafter.config.own_embeddings:  # the client side runs alone: give it copies of the target's
        drafter = decode_drafter(encode_drafter(drafter, target))
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
