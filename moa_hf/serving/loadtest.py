"""Load test of `moa serve` (`moa serve-load`): concurrent clients on loopback, bounded, stops by itself.

Starts its own server in a subprocess (`moa serve`, the default target in float32 unless told otherwise; killed in a
`finally`) or attaches to `--server URL`. First one client alone generates every prompt: its outputs are the
references and its rate the single-client tokens/s. Then, for each client count N, N threads each run a real
`MoAClient` (drafting on the client's side, as on a user's device) and generate `max_new_tokens` greedily for the
prompts (client i starts at prompt i), all starting together. Measured per phase: latency of each generation
(p50/p95), aggregate verified tokens/s, exactness of every generation against the single-client output, the
latency of `GET /v1/health` sampled every 0.5 s (max, p95), the server's peak RSS, HTTP 4xx/5xx answers and
unverified tokens. Asserts nothing; the report is a markdown table and JSON (`--output`).

Everything runs on one machine: the clients' drafting competes with the server for the CPU (a real deployment
drafts on the users' devices), so on a small CPU the numbers are a lower bound of what the server sustains.

This module imports only the standard library at the top (`moa --help` loads it to list the subcommand); it also runs
as `python -m moa_hf.serving.loadtest` (e.g. from an older checkout, to measure a "before").
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..chat import chat_ids
from ..hardware import hardware_info

__all__ = ["LoadTestArguments", "format_load_report", "main", "run_from_args", "run_load_test"]

_TOKEN_ENV = "MOA_SERVE_TOKEN"
HEALTH_INTERVAL_S = 0.5


def _percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values`, linearly interpolated (None when empty)."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _rss_bytes(pid: int | None) -> int | None:
    """Resident memory of process `pid` (psutil when installed, else /proc/<pid>/status); None when unknown."""
    if pid is None:
        return None
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The server: a `moa serve` subprocess, or one that already runs
# ---------------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerProcess:
    """`moa serve` in a subprocess on a free loopback port; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, target: str, dtype: str, drafter: str | None, serve_args: list[str], token: str | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moa_hf.cli", "serve", "--port", str(self.port), "--target", target]
        cmd += ["--dtype", dtype, "--log-level", "warning", *(["--drafter", drafter] if drafter else []), *serve_args]
        self.command = cmd
        env = dict(os.environ)
        if token is not None:
            env[_TOKEN_ENV] = token
        self._log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a chatty server never blocks on it
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read()[-chars:]

    def wait_ready(self, deadline: float) -> None:
        """Until /v1/health answers "ok"; `RuntimeError` when the server exits or the deadline passes."""
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`moa serve` exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/v1/health", timeout=5.0)
                if r.status_code == 200 and r.json().get("status", "ok") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"`moa serve` was not ready before the deadline:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# ---------------------------------------------------------------------------------------------------------------------
# Clients
# ---------------------------------------------------------------------------------------------------------------------
def _counting_transport(statuses: Counter, lock: threading.Lock):
    """An httpx transport (TCP_NODELAY, as the client's own) that counts every HTTP status it receives."""
    import httpx

    class CountingTransport(httpx.HTTPTransport):
        def handle_request(self, request):
            response = super().handle_request(request)
            with lock:
                statuses[response.status_code] += 1
            return response

    return CountingTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])


@dataclass
class _Setup:
    """What every client of the run shares: the server, the downloaded drafter and tokenizer, the prompts."""

    url: str
    pid: int | None  # the server's process (its RSS), None when unknown
    token: str | None
    drafter: object = None  # shared by the client threads: drafting keeps its state in each generation's cache
    tokenizer: object = None
    prompts: list[list[int]] = field(default_factory=list)
    max_new_tokens: int = 64
    rounds: int = 1
    deadline: float = 0.0  # time.monotonic() at which the run stops


@dataclass
class _Generation:
    client: int
    prompt: int
    tokens: list[int]
    unverified: int
    seconds: float
    drafted_alone: bool = False  # the client drafted alone at some point (the server unreachable or refusing)
    error: str | None = None


@dataclass
class _Phase:
    """What the threads of one phase share: the results, HTTP statuses and health samples."""

    clients: int
    generations: list[_Generation] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    health_ms: list[float] = field(default_factory=list)
    health_failures: int = 0
    health_peaks: dict = field(default_factory=dict)
    rss: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    finished: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)


def _make_client(setup: _Setup, phase: _Phase):
    from .client import MoAClient

    kwargs = dict(drafter=setup.drafter, tokenizer=setup.tokenizer, token=setup.token, timeout_s=120.0)
    kwargs["transport"] = _counting_transport(phase.statuses, phase.lock)
    settings = getattr(MoAClient, "settings_class", None)  # an older client takes its settings as keywords
    known = {f.name for f in dataclasses.fields(settings)} if settings else inspect.signature(MoAClient).parameters
    if "admission_timeout_s" in known:  # an older client has no admission wait
        kwargs["admission_timeout_s"] = max(1.0, setup.deadline - time.monotonic())
    return MoAClient(setup.url, use_cache=False, **kwargs)


def _generate(client, setup: _Setup, index: int, p: int, phase: _Phase) -> None:
    t0 = time.perf_counter()
    try:
        result = client.generate(setup.prompts[p], setup.max_new_tokens)
        seconds, alone = time.perf_counter() - t0, bool(result.offline_spans)
        gen = _Generation(index, p, result.token_ids, result.unverified_tokens, seconds, alone)
    except Exception as err:  # reported, not raised: the other clients go on
        gen = _Generation(index, p, [], 0, time.perf_counter() - t0, error=f"{type(err).__name__}: {err}")
    with phase.lock:
        phase.generations.append(gen)


def _client_thread(setup: _Setup, index: int, phase: _Phase, start: threading.Barrier) -> None:
    client = _make_client(setup, phase)
    start.wait()
    with client:
        for r in range(setup.rounds):
            if time.monotonic() > setup.deadline:
                return
            _generate(client, setup, index, (index + r) % len(setup.prompts), phase)


def _health_sampler(setup: _Setup, phase: _Phase, stop: threading.Event) -> None:
    """Every HEALTH_INTERVAL_S: the latency of GET /v1/health (no token needed), its numeric fields' peaks, and
    the server's RSS."""
    import httpx

    with httpx.Client(timeout=60.0) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = http.get(f"{setup.url}/v1/health")
                ms = 1000 * (time.perf_counter() - t0)
                body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            except (httpx.HTTPError, ValueError):
                ms, body = None, {}
            rss = _rss_bytes(setup.pid)
            with phase.lock:
                if ms is None:
                    phase.health_failures += 1
                else:
                    phase.health_ms.append(ms)
                for key, value in body.items() if isinstance(body, dict) else ():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        phase.health_peaks[key] = max(phase.health_peaks.get(key, value), value)
                if rss is not None:
                    phase.rss.append(rss)
            stop.wait(max(0.0, HEALTH_INTERVAL_S - (time.perf_counter() - t0)))


class _Sampling:
    """Context manager: `_health_sampler` in a thread for the duration of a phase."""

    def __init__(self, setup: _Setup, phase: _Phase):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_health_sampler, args=(setup, phase, self.stop), daemon=True)

    def __enter__(self):
        self.thread.start()

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5.0)


def _run_phase(setup: _Setup, n: int) -> _Phase:
    """N client threads, started together, each generating `rounds` times; bounded by the run's deadline."""
    phase = _Phase(clients=n)
    start = threading.Barrier(n + 1)
    threads = [
        threading.Thread(
            target=_client_thread,
            args=(setup, i, phase, start),
            daemon=True,  # a client stuck past the deadline does not keep the process alive
            name=f"load-client-{i}",
        )
        for i in range(n)
    ]
    for t in threads:
        t.start()
    with _Sampling(setup, phase):
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(max(0.0, setup.deadline - time.monotonic()))
        phase.wall_s = time.perf_counter() - t0
    phase.finished = not any(t.is_alive() for t in threads)
    return phase


def _single_client(setup: _Setup) -> _Phase:
    """One client alone generates every prompt once, after a short warm-up (first-call costs stay out)."""
    phase = _Phase(clients=1)
    with _make_client(setup, phase) as client:
        client.generate(setup.prompts[0], 4)
        phase.statuses.clear()
        with _Sampling(setup, phase):
            t0 = time.perf_counter()
            for p in range(len(setup.prompts)):
                _generate(client, setup, 0, p, phase)
            phase.wall_s = time.perf_counter() - t0
    return phase


def _summarise(phase: _Phase, references: dict[int, list[int]], single_rate: float | None, expected: int) -> dict:
    with phase.lock:
        gens, statuses, health = list(phase.generations), Counter(phase.statuses), list(phase.health_ms)
        rss, peaks = list(phase.rss), dict(phase.health_peaks)
    verified = sum(len(g.tokens) - g.unverified for g in gens)
    latencies = [g.seconds for g in gens if g.error is None]
    rate = verified / phase.wall_s if phase.wall_s > 0 else 0.0
    compared = [g for g in gens if g.prompt in references]
    return {
        "clients": phase.clients,
        "generations": len(gens),
        "expected_generations": expected,
        "finished": phase.finished,
        "errors": [g.error for g in gens if g.error],
        "wall_s": round(phase.wall_s, 3),
        "verified_tokens": verified,
        "unverified_tokens": sum(g.unverified for g in gens),
        "drafted_alone": sum(g.drafted_alone for g in gens),
        "verified_tokens_per_s": rate,
        "x_single_client": rate / single_rate if single_rate else None,
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p95_s": _percentile(latencies, 0.95),
        "latency_max_s": max(latencies) if latencies else None,
        "identical_to_single_client": sum(1 for g in compared if g.tokens == references[g.prompt]),
        "compared": len(compared),
        "health_samples": len(health),
        "health_failures": phase.health_failures,
        "health_p95_ms": _percentile(health, 0.95),
        "health_max_ms": max(health) if health else None,
        "health_peaks": peaks,
        "server_rss_peak_bytes": max(rss) if rss else None,
        "http_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "http_4xx": sum(v for k, v in statuses.items() if 400 <= k < 500),
        "http_429": statuses.get(429, 0),
        "http_5xx": sum(v for k, v in statuses.items() if k >= 500),
    }


# ---------------------------------------------------------------------------------------------------------------------
def _client_drafter(setup: _Setup) -> None:
    """The server's drafter and tokenizer, downloaded once (in memory) for every client thread to share."""
    from .client import MoAClient

    with MoAClient(setup.url, token=setup.token, use_cache=False) as client:
        setup.drafter = client.load_drafter()
        if client.info().get("has_tokenizer"):
            setup.tokenizer = client.load_tokenizer()


def _prompts(tokenizer, vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """`count` prompts as token ids: the benchmark's chat prompts with a tokenizer, else random ids (tiny models)."""
    from .bench import DEFAULT_PROMPTS

    if tokenizer is None:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 24))] for _ in range(count)]
    out = []
    for i in range(count):
        text = DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]
        if i >= len(DEFAULT_PROMPTS):
            text = f"{text} (Variant {i // len(DEFAULT_PROMPTS)}.)"
        out.append(chat_ids(tokenizer, text, raw_without_template=True))
    return out


def run_load_test(
    server: str | None = None,
    *,
    target: str = "default",
    dtype: str = "float32",
    drafter: str | None = None,
    serve_args: list[str] | tuple[str, ...] = (),
    server_pid: int | None = None,
    token: str | None = None,
    clients: list[int] | tuple[int, ...] = (1, 8, 24),
    max_new_tokens: int = 64,
    num_prompts: int = 6,
    rounds: int = 1,
    max_seconds: float = 1800.0,
    seed: int = 0,
    log=print,
) -> dict:
    """Run the load test (see the module doc) and return its JSON-able report. `server`: a running server's URL
    (its RSS is read when `server_pid` is given); None: start `moa serve --target target --dtype dtype` (with
    `drafter` and `serve_args`) in a subprocess, stopped before returning. Bounded by `max_seconds` in all: a phase
    that does not finish in time is reported as cut off, and the phases after it are skipped."""
    setup = _Setup(server, server_pid, token, max_new_tokens=max_new_tokens, rounds=rounds)
    setup.deadline = time.monotonic() + max_seconds
    report = {
        "date": datetime.date.today().isoformat(),
        "hardware": hardware_info(),
        "max_new_tokens": max_new_tokens,
        "prompts": num_prompts,
        "rounds": rounds,
        "clients": list(clients),
        "max_seconds": max_seconds,
        "phases": [],
    }
    proc = None
    try:
        if server is None:
            proc = _ServerProcess(target, dtype, drafter, list(serve_args), token)
            report["server_command"] = shlex.join(proc.command)
            log(f"starting {report['server_command']}")
            proc.wait_ready(setup.deadline)
            setup.url, setup.pid = proc.url, proc.pid
        _client_drafter(setup)
        report.update(_server_info(setup))
        setup.prompts = _prompts(setup.tokenizer, int(setup.drafter.config.vocab_size), num_prompts, seed)
        alone = _single_client(setup)
        references = {g.prompt: g.tokens for g in alone.generations if g.unverified == 0 and g.error is None}
        single = _summarise(alone, references, None, len(setup.prompts))
        single.update(x_single_client=1.0, sequential=True)
        report["single_client"] = single
        log(_phase_line(single))
        for n in clients:
            if time.monotonic() > setup.deadline:
                log(f"{n} clients: skipped (the {max_seconds:g} s budget is spent)")
                report["phases"].append({"clients": n, "skipped": True})
                continue
            summary = _summarise(_run_phase(setup, n), references, single["verified_tokens_per_s"], n * rounds)
            report["phases"].append(summary)
            log(_phase_line(summary))
    finally:
        if proc is not None:
            report["server_log_tail"] = proc.log_tail(4000)
            proc.stop()
    return report


def _server_info(setup: _Setup) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {setup.token}"} if setup.token else {}
    info = httpx.get(f"{setup.url}/v1/info", headers=headers, timeout=30.0).json()
    return {
        "server": setup.url,
        "target": info.get("target"),
        "dtype": info.get("dtype"),
        "limits": info.get("limits"),
    }


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _phase_line(s: dict) -> str:
    return (
        f"{s['clients']:>3} clients: {s['generations']}/{s['expected_generations']} generations, "
        f"{s['verified_tokens_per_s']:.1f} verified tok/s ({_fmt(s['x_single_client'], '.2f')}x single), latency "
        f"p50 {_fmt(s['latency_p50_s'], '.1f')} s p95 {_fmt(s['latency_p95_s'], '.1f')} s, health max "
        f"{_fmt(s['health_max_ms'], '.0f')} ms, {s['unverified_tokens']} unverified tokens "
        f"({s['drafted_alone']} generations drafted alone), "
        f"{s['identical_to_single_client']}/{s['compared']} identical, 4xx {s['http_4xx']} (429: {s['http_429']}), "
        f"5xx {s['http_5xx']}"
    )


def format_load_report(report: dict) -> str:
    """A markdown table of a `run_load_test` report."""
    lines = [
        f"{report.get('target')} ({report.get('dtype')}) on {report.get('server')}; {report['prompts']} prompts, "
        f"{report['max_new_tokens']} new tokens, greedy; {report['hardware']['cpu']} ({report['hardware']['cores']} "
        f"cores), clients and server on the same machine; {report['date']}.",
        "",
        "| clients | generations | verified tok/s | x single | latency p50 / p95 (s) | health p95 / max (ms) | "
        "server RSS peak | identical | unverified tokens (drafted alone) | 4xx (429) | 5xx |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    phases = [report["single_client"]] if "single_client" in report else []
    for s in phases + report["phases"]:
        if s.get("skipped"):
            lines.append(f"| {s['clients']} | skipped (time budget) | | | | | | | | | |")
            continue
        rss = s["server_rss_peak_bytes"]
        rss_text = "-" if rss is None else f"{rss / 2**30:.2f} GiB"
        label = "1 (alone)" if s.get("sequential") else str(s["clients"])
        done = f"{s['generations']}/{s['expected_generations']}" + ("" if s["finished"] else " (cut off)")
        lines.append(
            f"| {label} | {done} | {s['verified_tokens_per_s']:.1f} | {_fmt(s['x_single_client'], '.2f')} | "
            f"{_fmt(s['latency_p50_s'], '.1f')} / {_fmt(s['latency_p95_s'], '.1f')} | "
            f"{_fmt(s['health_p95_ms'], '.0f')} / {_fmt(s['health_max_ms'], '.0f')} | "
            f"{rss_text} | {s['identical_to_single_client']}/{s['compared']} | "
            f"{s['unverified_tokens']} ({s['drafted_alone']}) | {s['http_4xx']} ({s['http_429']}) | {s['http_5xx']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class LoadTestArguments:
    """The options of `moa serve-load` (also `python -m moa_hf.serving.loadtest`), parsed by
    `transformers.HfArgumentParser` (this module stays standard library only at import)."""

    server: str | None = field(
        default=None, metadata={"help": "attach to a running server (default: start `moa serve` here)"}
    )
    server_pid: int | None = field(default=None, metadata={"help": "with --server: its process id, to read its RSS"})
    target: str = field(
        default="default", metadata={"help": "the started server's --target (a folder: a tiny test model)"}
    )
    dtype: str = field(default="float32", metadata={"choices": ["float32", "bfloat16"]})
    drafter: str | None = field(
        default=None, metadata={"help": "the started server's --drafter (default: its own default)"}
    )
    serve_args: str = field(
        default="", metadata={"help": "more options for the started `moa serve`, as one string (e.g. '--max-batch 8')"}
    )
    clients: str = field(default="1,8,24", metadata={"help": "comma-separated client counts, one phase each"})
    max_new_tokens: int = 64
    prompts: int = field(default=6, metadata={"help": "how many prompts (client i starts at prompt i)"})
    rounds: int = field(default=1, metadata={"help": "generations per client per phase"})
    max_seconds: float = field(default=1800.0, metadata={"help": "the whole run's budget; it stops by itself"})
    client_threads: int = field(default=1, metadata={"help": "torch threads of the client side (this process)"})
    seed: int = 0
    output: str | None = field(default=None, metadata={"help": "write the JSON report here"})


def run_from_args(args: LoadTestArguments) -> int:
    import torch

    token = os.environ.get(_TOKEN_ENV) or None  # an attached server's token (a started one runs on loopback)
    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        print(f"error: --clients {args.clients!r} is not a comma-separated list of integers", file=sys.stderr)
        return 2
    if not clients or min(clients) < 1 or args.max_new_tokens < 1 or args.prompts < 1 or args.rounds < 1:
        print("error: --clients, --max-new-tokens, --prompts and --rounds must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, args.client_threads))  # this process is the clients' side only
    report = run_load_test(
        args.server,
        target=args.target,
        dtype=args.dtype,
        drafter=args.drafter,
        serve_args=shlex.split(args.serve_args),
        server_pid=args.server_pid,
        token=token,
        clients=clients,
        max_new_tokens=args.max_new_tokens,
        num_prompts=args.prompts,
        rounds=args.rounds,
        max_seconds=args.max_seconds,
        seed=args.seed,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    report["command"] = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    report["client_threads"] = args.client_threads
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(format_load_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        LoadTestArguments, prog="python -m moa_hf.serving.loadtest", description=__doc__.split("\n\n")[0]
    )
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
