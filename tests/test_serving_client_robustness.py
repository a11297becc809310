"""The client under a busy, flaky or corrupting server: admission waits (never drafting alone while the server
answers), unverified output only when it is unreachable (reported, CLI exit 3), sessions deleted however a
generation ends, corrupted answers retried, one sampling validator on both sides, one-line CLI errors, and the load
test (`moa serve-load`) on a tiny model."""

import argparse
import copy
import json
import threading

import httpx
import pytest
import torch
from test_serving import char_tokenizer, prompts, reference

import moa_hf
from moa_hf.serving import MoAClient, ServerLimits, ServerThread, ServingState, create_app
from moa_hf.serving.protocol import (
    MAX_TEMPERATURE,
    MIN_SAMPLING_TEMPERATURE,
    check_content_digest,
    check_max_new_tokens,
    check_sampling,
    content_digest,
)

from factory import make_target


@pytest.fixture(autouse=True)
def drafter_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOA_HF_DRAFTER_CACHE", str(tmp_path / "drafters"))
    monkeypatch.delenv("MOA_SERVE_TOKEN", raising=False)


@pytest.fixture(scope="module")
def tiny():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    return target, drafter


@pytest.fixture
def server(tiny):
    target, drafter = tiny
    limits = ServerLimits(max_sessions=4, max_tokens_per_session=256, max_draft_tokens=16, session_ttl_s=60)
    state = ServingState(target, drafter, tokenizer=char_tokenizer(), limits=limits)
    with ServerThread(create_app(state)) as srv:
        yield srv


class Scripted(httpx.HTTPTransport):
    """A transport to the real server that records every request and lets a test answer some of them itself:
    `script(request, n)` (n: how many requests with this method and path kind came before) returns None (pass the
    request on), an `httpx.Response`, a callable that rewrites the real response, or raises a transport error."""

    def __init__(self, script=None):
        super().__init__()
        self.script = script or (lambda request, n: None)
        self.seen: list[tuple[str, str, int]] = []  # (method, path, status or -1 for a raised error)
        self.counts: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    @staticmethod
    def kind(request) -> str:
        path = request.url.path
        return "verify" if path.endswith("/verify") else "create" if path == "/v1/sessions" else path

    def handle_request(self, request):
        key = (request.method, self.kind(request))
        with self.lock:
            n = self.counts.get(key, 0)
            self.counts[key] = n + 1
        try:
            action = self.script(request, n)
        except httpx.TransportError:
            self.seen.append((request.method, request.url.path, -1))
            raise
        if isinstance(action, httpx.Response):
            response = action
        else:
            response = super().handle_request(request)
            if callable(action):
                response.read()
                response = action(response)
        self.seen.append((request.method, request.url.path, response.status_code))
        return response

    def deletes(self) -> list[int]:
        return [status for method, path, status in self.seen if method == "DELETE"]

    def count(self, method: str, kind: str) -> int:
        return self.counts.get((method, kind), 0)


def busy(retry_after: str | None = "0", status: int = 429) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    body = {"detail": "this server is full; retry later", "retry_after_s": 0, "queue_depth": 3}
    return httpx.Response(status, json=body, headers=headers)


def client_for(server, tiny, transport, **kwargs) -> MoAClient:
    kwargs = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "reconnect_timeout_s": 0.2, **kwargs}
    return MoAClient(server.url, drafter=tiny[1], transport=transport, **kwargs)


def run(gen):
    """Drive an `iter_generate` generator: (events, result)."""
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return events, stop.value


# ---------------------------------------------------------------------------------------------------------------------
# Admission: a busy server is waited for, never drafted around
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [429, 503])
def test_busy_server_is_waited_for_not_drafted_around(tiny, server, status):
    target, _ = tiny
    prompt = prompts(11, 1)[0]
    t = Scripted(lambda request, n: busy("0", status) if Scripted.kind(request) == "create" and n < 3 else None)
    events, result = run(client_for(server, tiny, t).iter_generate(prompt, 12))
    kinds = [e.kind for e in events]
    assert kinds.count("waiting") == 1 and "offline" not in kinds and "unverified" not in kinds
    assert result.verified and result.unverified_tokens == 0 and result.token_ids == reference(target, prompt, 12)
    assert result.stats["busy_answers"] == 3 and t.count("POST", "create") == 4


def test_admission_timeout_falls_back_to_unverified_and_says_so(tiny, server):
    t = Scripted(lambda request, n: busy("0") if Scripted.kind(request) == "create" else None)
    events, result = run(client_for(server, tiny, t, admission_timeout_s=0.3).iter_generate([5, 6, 7], 6))
    kinds = [e.kind for e in events]
    assert kinds[0] == "waiting" and "offline" in kinds
    assert "no admission within 0.3 s" in next(e.text for e in events if e.kind == "offline")
    assert not result.verified and result.unverified_tokens == 6 and result.unverified_span == [0, 6]
    assert result.timings["admission_wait_s"] >= 0.25


def test_a_503_without_retry_after_is_an_outage(tiny, server):
    """A proxy's 503 with no upstream (no Retry-After) is not "busy": the client drafts alone at once."""
    t = Scripted(lambda request, n: busy(None, 503) if Scripted.kind(request) == "create" else None)
    events, result = run(client_for(server, tiny, t).iter_generate([5, 6, 7], 4))
    assert "waiting" not in [e.kind for e in events] and not result.verified


def test_timeout_of_a_live_server_is_retried_not_an_outage(tiny, server):
    """A verify that times out while /v1/health still answers: the server is busy, not gone; same call again."""
    target, _ = tiny
    prompt = prompts(12, 1)[0]

    def script(request, n):
        if Scripted.kind(request) == "verify" and n == 1:
            raise httpx.ReadTimeout("timed out", request=request)

    t = Scripted(script)
    events, result = run(client_for(server, tiny, t, draft_length=2).iter_generate(prompt, 12))
    assert "offline" not in [e.kind for e in events] and result.verified
    assert result.token_ids == reference(target, prompt, 12) and t.count("GET", "/v1/health") == 1


def test_retry_delay_honours_retry_after_with_jitter(tiny, server):
    from moa_hf.serving.client import _Busy

    client = client_for(server, tiny, None)
    delays = [client.connection.retry_delay(_Busy("busy", retry_after_s=2.0)) for _ in range(200)]
    assert min(delays) >= 2.0 and max(delays) <= 2.55 and len(set(delays)) > 100


# ---------------------------------------------------------------------------------------------------------------------
# Sessions are deleted however the generation ends
# ---------------------------------------------------------------------------------------------------------------------
def test_session_deleted_after_a_generation(tiny, server):
    t = Scripted()
    run(client_for(server, tiny, t).iter_generate([5, 6, 7], 5))
    assert t.deletes() == [204]


def test_session_deleted_when_the_generation_raises(tiny, server):
    t = Scripted()

    def explode(event):
        if event.kind == "verified" and event.position > 0:
            raise KeyboardInterrupt  # e.g. Ctrl-C while streaming

    with pytest.raises(KeyboardInterrupt):
        client_for(server, tiny, t).generate([5, 6, 7], 20, on_event=explode)
    assert t.deletes() == [204]


def test_session_deleted_when_the_consumer_stops_early(tiny, server):
    t = Scripted()
    gen = client_for(server, tiny, t).iter_generate([5, 6, 7], 20)
    next(gen)
    gen.close()
    assert t.deletes() == [204]


# ---------------------------------------------------------------------------------------------------------------------
# Corrupted answers are transient
# ---------------------------------------------------------------------------------------------------------------------
def flip_byte(response: httpx.Response) -> httpx.Response:
    body = bytearray(response.content)
    body[len(body) // 2] ^= 0x40
    return httpx.Response(response.status_code, headers=response.headers, content=bytes(body))


def with_digest(corrupt):
    """Give the real answer a correct Content-Digest, then corrupt it (`corrupt` of the digested response)."""

    def rewrite(response: httpx.Response) -> httpx.Response:
        headers = {**response.headers, "Content-Digest": content_digest(response.content)}
        return corrupt(httpx.Response(response.status_code, headers=headers, content=response.content))

    return rewrite


CORRUPTIONS = {
    "truncated": lambda r: httpx.Response(200, headers=r.headers, content=r.content[: len(r.content) // 2]),
    "garbage": lambda r: httpx.Response(200, headers=r.headers, content=b"\x00" * 64),
    "content type": lambda r: httpx.Response(200, headers={"content-type": "text/html"}, content=r.content),
    "digest mismatch": with_digest(flip_byte),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupted_answer_is_retried(tiny, server, how):
    target, _ = tiny
    prompt = prompts(13, 1)[0]
    corrupt = CORRUPTIONS[how]
    t = Scripted(lambda request, n: corrupt if Scripted.kind(request) in ("create", "verify") and n == 1 else None)
    events, result = run(client_for(server, tiny, t, draft_length=3).iter_generate(prompt, 12))
    assert result.verified and result.token_ids == reference(target, prompt, 12)
    assert result.stats["corrupted_answers"] == 1 and "offline" not in [e.kind for e in events]


def test_answers_with_a_correct_digest_pass(tiny, server):
    target, _ = tiny
    t = Scripted(lambda request, n: with_digest(lambda r: r) if request.method == "POST" else None)
    result = client_for(server, tiny, t).generate([5, 6, 7], 8)
    assert result.verified and result.stats["corrupted_answers"] == 0
    assert result.token_ids == reference(target, [5, 6, 7], 8)


def test_always_corrupted_counts_as_unreachable(tiny, server):
    corrupt = CORRUPTIONS["garbage"]
    t = Scripted(lambda request, n: corrupt if Scripted.kind(request) == "create" else None)
    result = client_for(server, tiny, t, corrupt_retries=2).generate([5, 6, 7], 4)
    assert not result.verified and result.unverified_tokens == 4 and result.stats["corrupted_answers"] >= 3


def test_content_digest_helpers():
    body = b"hello"
    header = content_digest(body)
    assert header.startswith("sha-256=:") and header.endswith(":")
    check_content_digest(body, header)
    check_content_digest(body, None)
    check_content_digest(body, "sha-512=:abc:")  # nothing this client checks
    with pytest.raises(ValueError, match="Content-Digest"):
        check_content_digest(b"hellp", header)


# ---------------------------------------------------------------------------------------------------------------------
# One sampling validator on both sides
# ---------------------------------------------------------------------------------------------------------------------
def test_check_sampling_ranges():
    assert MIN_SAMPLING_TEMPERATURE == pytest.approx(1e4 / torch.finfo(torch.float32).max)
    logits = torch.tensor([1e4, -1e4, 0.0])
    assert torch.isfinite((logits / MIN_SAMPLING_TEMPERATURE).softmax(-1)).all()  # the bound is the arithmetic's
    for temperature in (MIN_SAMPLING_TEMPERATURE, 1e-2, 1.0, MAX_TEMPERATURE):
        check_sampling(temperature, do_sample=True)
    bad = [
        (dict(temperature=1e-40), "temperature 1e-40 is outside [2.94e-35, 100]"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=100.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p 0.0 is outside (0, 1]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=129, vocab_size=128), "top_k 129 is outside [0, 128]"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            check_sampling(**kwargs, do_sample=True)
    check_sampling(temperature=1e-40, top_p=0.0, do_sample=False)  # greedy ignores them
    check_max_new_tokens(1)
    for n in (0, -3, 1.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            check_max_new_tokens(n)
    with pytest.raises(ValueError, match="more than the server's 255"):
        check_max_new_tokens(5, prompt_tokens=300, max_tokens=256)
    with pytest.raises(ValueError, match=r"outside \[1, 55\]"):
        check_max_new_tokens(100, prompt_tokens=200, max_tokens=256)


@pytest.mark.parametrize("temperature", [1e-2, 100.0])
def test_sampling_at_the_range_ends_runs(tiny, server, temperature):
    """The client's own sampling (and the server's) take both ends of the range (no inf/NaN, no crash)."""
    with MoAClient(server.url, drafter=tiny[1], draft_length=3) as client:
        result = client.generate([5, 6, 7], 10, do_sample=True, temperature=temperature, top_k=50, seed=1)
    assert result.verified and len(result.token_ids) == 10


def test_out_of_range_sampling_rejected_before_any_request(tiny, server):
    t = Scripted()
    client = client_for(server, tiny, t)
    cases = [
        (dict(do_sample=True, temperature=1e-40), "temperature"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(do_sample=True, top_k=10**6), "top_k"),  # beyond the vocabulary: known once the drafter is loaded
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            client.generate([5, 6], 4, **kwargs)
    for n in (0, -1):
        with pytest.raises(ValueError, match="max_new_tokens"):
            client.generate([5, 6], n)
    with pytest.raises(ValueError, match="empty"):
        client.generate([], 4)
    with pytest.raises(ValueError, match="tokens per session"):
        client.generate([5] * 300, 4)
    assert t.count("POST", "create") == 0


def test_server_rejects_out_of_range_sampling_with_422(server):
    cases = [
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": 1e-2, "top_p": 0.0}, "top_p"),
    ]
    for extra, field in cases:
        r = httpx.post(f"{server.url}/v1/sessions", json={"input_ids": [5], "do_sample": True, **extra})
        assert r.status_code == 422 and field in r.json()["detail"], r.text
    greedy = httpx.post(f"{server.url}/v1/sessions", json={"input_ids": [5], "temperature": 1e-40})
    assert greedy.status_code == 200  # greedy ignores the sampling fields


# ---------------------------------------------------------------------------------------------------------------------
# The CLI: one-line errors, exit codes, the token from a file or the environment
# ---------------------------------------------------------------------------------------------------------------------
def cli(argv: list[str]) -> int:
    """`moa <argv>` with only the serving subcommands registered (the other entry points play no part here)."""
    from moa_hf.serving.cli import register

    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "   "], "the prompt is empty"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens 0 must be"),
        (["--prompt", "hi", "--max-new-tokens", "-4"], "max_new_tokens -4 must be"),
        (["--prompt", "hi", "--do-sample", "--temperature", "1e-40"], "temperature 1e-40 is outside"),
        (["--prompt", "x" * 400, "--raw"], "more than the server's 255"),
        (["--prompt", "hi", "--token-file", "/nonexistent/token"], "cannot read --token-file"),
    ],
)
def test_cli_usage_errors_are_one_line_exit_2(server, capsys, extra, message):
    assert cli(["client", "--server", server.url, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


class AlwaysFull:
    """An ASGI app answering every session creation with 429 + Retry-After: 0 (a server that stays full), and
    everything else with `app` (whose `state` it shows, as the app it wraps)."""

    def __init__(self, app):
        self.app, self.state = app, app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/sessions":
            body = json.dumps({"detail": "full", "retry_after_s": 0, "queue_depth": 1}).encode()
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"0")]
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def test_cli_unverified_exit_3_unless_best_effort(tiny, capsys):
    target, drafter = tiny
    with ServerThread(AlwaysFull(create_app(ServingState(target, drafter, tokenizer=char_tokenizer())))) as srv:
        args = ["client", "--server", srv.url, "--prompt", "hi", "--raw", "--max-new-tokens", "5"]
        args += ["--admission-timeout-s", "0.2", "--reconnect-timeout-s", "0.1"]
        assert cli(args) == 3
        err = capsys.readouterr().err
        assert "[server busy: waiting for admission" in err
        assert "[unverified: the last 5 of 5 tokens were drafted without the target" in err
        assert cli(args + ["--best-effort", "--json"]) == 0
        captured = capsys.readouterr()
    err = capsys.readouterr().err
    out = json.loads(captured.out)
    assert out["verified"] is False and out["unverified_tokens"] == 5 and "[unverified:" in captured.err


def test_cli_token_from_file_and_environment(tiny, tmp_path, capsys, monkeypatch):
    target, drafter = tiny
    state = ServingState(target, drafter, tokenizer=char_tokenizer(), token="s3cret")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with ServerThread(create_app(state)) as srv:
        base = ["client", "--server", srv.url, "--prompt", "hi", "--raw", "--max-new-tokens", "3", "--json"]
        assert cli(base + ["--token-file", str(token_file)]) == 0
        assert json.loads(capsys.readouterr().out)["verified"] is True
        monkeypatch.setenv("MOA_SERVE_TOKEN", "s3cret")
        assert cli(base) == 0
        capsys.readouterr()
        monkeypatch.setenv("MOA_SERVE_TOKEN", "wrong")
        assert cli(base) == 1
        err = capsys.readouterr().err
        assert "401" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "empty").write_text("")
    assert cli(base + ["--token-file", str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# The load test on a tiny model
# ---------------------------------------------------------------------------------------------------------------------
def test_load_test_against_a_running_server(tiny, server):
    from moa_hf.serving.loadtest import format_load_report, run_load_test

    report = run_load_test(
        server.url, clients=(1, 3), max_new_tokens=8, num_prompts=3, max_seconds=120, log=lambda line: None
    )
    single, phases = report["single_client"], report["phases"]
    assert single["generations"] == 3 and single["unverified_tokens"] == 0
    assert [p["clients"] for p in phases] == [1, 3]
    for p in phases:
        assert p["finished"] and p["generations"] == p["expected_generations"] == p["clients"]
        assert p["identical_to_single_client"] == p["compared"] == p["clients"]
        assert p["unverified_tokens"] == 0 and p["http_5xx"] == 0 and not p["errors"]
        assert p["verified_tokens_per_s"] > 0 and p["latency_p95_s"] >= p["latency_p50_s"] > 0
    table = format_load_report(report)
    assert table.count("\n| ") == 4 and "1 (alone)" in table


def test_serve_load_starts_its_own_server_on_a_tiny_model(tiny, tmp_path, capsys):
    """`moa serve-load --target FOLDER`: a `moa serve` subprocess on a tiny target, stopped at the end."""
    target, _ = tiny
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    out = tmp_path / "load.json"
    argv = ["serve-load", "--target", str(tmp_path / "target"), "--clients", "2", "--max-new-tokens", "6"]
    assert cli(argv + ["--prompts", "2", "--max-seconds", "120", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "moa_hf.cli serve" in report["server_command"] and report["dtype"] == "float32"
    (phase,) = report["phases"]
    assert phase["generations"] == 2 and phase["identical_to_single_client"] == 2 and phase["unverified_tokens"] == 0
    assert phase["server_rss_peak_bytes"] > 0 and phase["health_samples"] >= 1 and phase["http_5xx"] == 0
    assert "| 2 | 2/2 |" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------------
# A sorted multi-target drafter (issue 20) in client mode
# ---------------------------------------------------------------------------------------------------------------------
def test_multi_target_drafter_drafts_for_the_servers_target(tiny):
    """The client has no target to attach: after loading the server's drafter it selects the target whose recorded
    fingerprint is the one `/v1/info` announces."""
    target, _ = tiny
    other = make_target("llama", seed=1)  # the same signature, other weights: a fine-tune, say
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    drafter.add_target("ft", other, lora_rank=2)
    with torch.no_grad():
        for lora in drafter.target_parts["ft"].lora.values():
            lora.B.normal_(0.0, 0.05)  # parts of its own (zero deltas at first would draft as for "main")
    prompt = prompts(14, 1)[0]
    for served, name in ((other, "ft"), (target, "main")):
        drafter.select_target(name)  # the server's LSA for its target
        with ServerThread(create_app(ServingState(served, drafter, tokenizer=char_tokenizer()))) as srv:
            with MoAClient(srv.url, use_cache=False) as client:
                client.prepare()
                assert client.drafter.target_names == ["main", "ft"] and client.drafter.active_target == name
                result = client.generate(prompt, 12)
            assert result.verified and result.token_ids == reference(served, prompt, 12)
            with MoAClient(srv.url, drafter=copy.deepcopy(drafter).eval()) as given:  # a drafter of the user's own
                given.drafter.select_target("main" if name == "ft" else "ft")
                given.prepare()
                assert given.drafter.active_target == name
