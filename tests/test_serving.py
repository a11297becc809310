"""Client-server speculative decoding: loopback equality, disconnection, emulated links, bad input, CLI."""

import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import moa_hf
from moa_hf.modeling import TargetStates, gather_target_kv
from moa_hf.serving import MoAClient, ServerLimits, ServerThread, ServingState, create_app
from moa_hf.serving.netem import DelayProxy, LinkProfile
from moa_hf.serving.protocol import decode_drafter, decode_result, encode_drafter, lsa_fingerprint
from moa_hf.serving.state import accept_drafts

from factory import OracleDrafter, make_target
from policy_sim import World, drive_client
from tolerance import assert_close

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer for the tiny 128-token targets: ids 0-2 are <pad>, <s>, </s>; id i is chr(i)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(i): i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def oracle(drafter, reference: list[int], p_right: float, seed: int = 0) -> OracleDrafter:
    o = OracleDrafter(drafter.config).eval()
    o.load_state_dict(drafter.state_dict())
    o.reference, o.p_right, o.rng = reference, p_right, random.Random(seed)
    return o


@pytest.fixture(autouse=True)
def drafter_cache(tmp_path, monkeypatch):
    """Clients that download the server's drafter cache it in a folder of the test's own, never the user's."""
    monkeypatch.setenv("MOA_HF_DRAFTER_CACHE", str(tmp_path / "drafters"))


@pytest.fixture(scope="module")
def tiny():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    return target, drafter


@pytest.fixture
def server(tiny):
    target, drafter = tiny
    limits = ServerLimits(
        max_sessions=4, max_tokens_per_session=256, max_draft_tokens=16, session_ttl_s=60, max_request_bytes=20_000
    )
    state = ServingState(target, drafter, tokenizer=char_tokenizer(), limits=limits)
    with ServerThread(create_app(state)) as srv:
        yield srv


def reference(target, prompt: list[int], n: int) -> list[int]:
    return target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randrange(1, 20))] for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context_format", ["fp16", "int8", "fp32"])
def test_loopback_greedy_equality(tiny, server, context_format):
    target, drafter = tiny
    with MoAClient(server.url, drafter=drafter, context_format=context_format) as client:
        for i, prompt in enumerate(prompts(1, 3)):
            n = 8 + 9 * i
            result = client.generate(prompt, max_new_tokens=n)
            assert result.token_ids == reference(target, prompt, n)
            assert result.unverified_tokens == 0 and result.unverified_span is None
            assert sum(result.stats["accepted_lengths"]) == n == len(result.token_ids)
            assert result.server_calls == len(result.stats["accepted_lengths"])


def test_oracle_drafter_accepts_and_stays_exact(tiny, server):
    """With a partly right drafter, acceptance is > 1 token per call and the output is still the target's."""
    target, drafter = tiny
    prompt = prompts(2, 1)[0]
    ref = reference(target, prompt, 40)
    with MoAClient(server.url, drafter=oracle(drafter, prompt + ref, 0.8), draft_length=4) as client:
        result = client.generate(prompt, max_new_tokens=40)
    assert result.token_ids == ref
    assert result.server_calls < 40 / 2 and max(result.stats["accepted_lengths"]) == 5
    lengths = result.stats["draft_lengths"]
    assert lengths[0] == 0 and lengths[1] == 4 and max(lengths) == 4  # the first call sends the prompt alone


def test_context_matches_local_lsa(tiny, server):
    """The context vectors the server sends are the drafter's LSA over the target's cache of the verified tokens."""
    target, drafter = tiny
    prompt = [5, 17, 33, 9]
    body = {"input_ids": prompt, "draft_ids": [7, 8], "context_format": "fp32"}
    result = decode_result(httpx.post(f"{server.url}/v1/sessions", json=body).content)
    verified = prompt + [7, 8][: result.accepted] + [result.next_token]
    with torch.no_grad():
        out = target(torch.tensor([verified[:-1]]), use_cache=True)
        states = TargetStates(gather_target_kv(out.past_key_values, 0, len(verified) - 1))
        expected = drafter.compute_context(states)[0]
    assert result.context_start == 0 and result.num_verified == len(verified)
    assert_close(result.context, expected)


def test_sampling_is_seeded_and_exact_distribution():
    """Speculative sampling: whatever q the drafter used, the first emitted token follows the target's p."""
    p_logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 0.5, 0.5]])  # [2, V=4]
    p = p_logits.softmax(-1)[0]
    q = torch.tensor([0.1, 0.2, 0.6, 0.1])
    from moa_hf.serving.protocol import CreateSessionRequest, SparseDistribution
    from moa_hf.serving.state import Session

    session = Session(
        id="s",
        verified=[1],
        cache=None,
        generator=torch.Generator().manual_seed(0),
        request=CreateSessionRequest(input_ids=[1], do_sample=True),
    )
    rng = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    dist = SparseDistribution(ids=[0, 1, 2, 3], probs=q.tolist())
    trials = 4000
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=rng))
        accepted, token = accept_drafts(p_logits, [d], [dist], session)
        counts[d if accepted == 1 else token] += 1
    assert (counts / trials - p).abs().max() < 0.03, (counts / trials, p)


def test_sampling_end_to_end(tiny, server):
    target, drafter = tiny
    with MoAClient(server.url, drafter=drafter, draft_length=3) as client:
        a, b, c = (
            client.generate([5, 6, 7], 20, do_sample=True, temperature=0.7, top_k=20, seed=s) for s in (3, 3, 4)
        )
    assert len(a.token_ids) == 20 and a.unverified_tokens == 0
    assert a.token_ids == b.token_ids != c.token_ids  # seeded on both sides: repeatable with a fixed draft length
    assert all(0 <= t < 128 for t in a.token_ids)


def test_tiny_temperature_samples_greedily(tiny, server):
    """Below moa_hf.speculative.MIN_TEMPERATURE sampling is greedy on both sides (1/T would overflow to NaN); 1e-30
    is inside the accepted range (`protocol.check_sampling`: 1e-40 is refused)."""
    target, drafter = tiny
    with MoAClient(server.url, drafter=drafter, draft_length=3) as client:
        result = client.generate([5, 6, 7], 12, do_sample=True, temperature=1e-30, top_p=0.5, seed=0)
    assert result.token_ids == reference(target, [5, 6, 7], 12) and result.unverified_tokens == 0


def test_two_sessions_do_not_interfere(tiny, server):
    target, drafter = tiny
    p1, p2 = prompts(3, 2)
    r1, r2 = reference(target, p1, 15), reference(target, p2, 15)
    c1 = MoAClient(server.url, drafter=drafter)
    c2 = MoAClient(server.url, drafter=drafter)
    g1, g2 = c1.iter_generate(p1, 15), c2.iter_generate(p2, 15)
    results = {}
    while len(results) < 2:  # interleave the two generations call by call
        for name, gen in (("a", g1), ("b", g2)):
            if name in results:
                continue
            try:
                next(gen)
            except StopIteration as stop:
                results[name] = stop.value
    assert results["a"].token_ids == r1 and results["b"].token_ids == r2


# ---------------------------------------------------------------------------------------------------------------------
def test_disconnection_kill_and_restart(tiny, server):
    """The server stops mid-run (its sessions are lost) and comes back: the client drafts alone meanwhile, then
    re-creates its session from the verified prefix; the output is the target's, and nothing verified is lost."""
    target, drafter = tiny
    prompt = prompts(4, 1)[0]
    ref = reference(target, prompt, 30)
    client = MoAClient(
        server.url, drafter=oracle(drafter, prompt + ref, 0.6), backoff_initial_s=0.01, backoff_max_s=0.05
    )
    events = client.iter_generate(prompt, 30)
    kinds, verified_before, offline = [], None, 0
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            result = stop.value
            break
        kinds.append(event.kind)
        if event.kind == "verified" and verified_before is None and event.position + len(event.token_ids) >= 5:
            verified_before = event.position + len(event.token_ids)
            server.stop()
        elif event.kind == "unverified":
            offline += len(event.token_ids)
            if offline >= 8 and server._server is None:
                target_, drafter_ = tiny
                server.start(create_app(ServingState(target_, drafter_)))  # a new process would lose sessions too
        elif event.kind == "verified" and "online" in kinds:
            assert event.position >= verified_before  # verified tokens are never taken back
    assert result.token_ids == ref
    assert result.unverified_tokens == 0 and result.unverified_span is None
    assert kinds.count("offline") == 1 and "online" in kinds
    assert result.stats["session_recreations"] >= 1 and result.stats["failed_calls"] >= 1
    span = result.offline_spans[0]
    assert span["start"] == verified_before and span["drafted"] >= 8 and 0 <= span["accepted"] <= span["drafted"]


def test_server_never_returns_leaves_unverified_tail(tiny, server):
    target, drafter = tiny
    prompt = prompts(5, 1)[0]
    ref = reference(target, prompt, 20)
    client = MoAClient(
        server.url, drafter=drafter, backoff_initial_s=0.01, backoff_max_s=0.05, reconnect_timeout_s=0.2
    )
    events = client.iter_generate(prompt, 20)
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            result = stop.value
            break
        if event.kind == "verified" and event.position + len(event.token_ids) >= 6:
            server.stop()
    start, end = result.unverified_span
    assert end == len(result.token_ids) == 20 and result.unverified_tokens == end - start > 0
    assert result.token_ids[:start] == ref[:start]  # the verified part is the target's


def test_server_down_from_the_start(tiny):
    target, drafter = tiny
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    client = MoAClient(f"http://127.0.0.1:{port}", drafter=drafter, reconnect_timeout_s=0.1, backoff_initial_s=0.01)
    result = client.generate([5, 6, 7], 6)
    assert result.unverified_span == [0, 6] and result.server_calls == 0
    with pytest.raises(ConnectionError, match="cannot reach"):
        MoAClient(f"http://127.0.0.1:{port}").generate([5, 6], 3)  # no local drafter: nothing to draft with


def test_lost_answer_rolls_back(tiny, server):
    """A verify whose answer was lost: the client repeats it from its own (shorter) state; the session rolls back."""
    url = server.url
    first = decode_result(httpx.post(f"{url}/v1/sessions", json={"input_ids": [5, 6, 7]}).content)
    sid, n, last = first.session_id, first.num_verified, first.next_token
    body = {"num_verified": n, "last_token": last, "draft_ids": [9, 10, 11]}
    a = decode_result(httpx.post(f"{url}/v1/sessions/{sid}/verify", json=body).content)  # answer "lost"
    b = decode_result(httpx.post(f"{url}/v1/sessions/{sid}/verify", json=body).content)
    assert (a.accepted, a.next_token, a.num_verified) == (b.accepted, b.next_token, b.num_verified)
    torch.testing.assert_close(a.context, b.context)


# ---------------------------------------------------------------------------------------------------------------------
def test_slow_link_uses_fewer_calls(tiny, server):
    """Over an emulated 300 ms-RTT link the adaptive client drafts longer and calls the server less than on
    loopback, far fewer times than it generates tokens; the output is the target's either way."""
    target, drafter = tiny
    prompt = prompts(6, 1)[0]
    ref = reference(target, prompt, 48)
    fast = MoAClient(server.url, drafter=oracle(drafter, prompt + ref, 0.8, seed=1)).generate(prompt, 48)
    slow_link = LinkProfile("slow", 0.15, 2e6, 8e6, 0.0)
    with DelayProxy(server.port, slow_link) as proxy:
        slow = MoAClient(proxy.url, drafter=oracle(drafter, prompt + ref, 0.8, seed=1)).generate(prompt, 48)
        assert proxy.connections >= 1 and proxy.bytes["down"] > 0
    assert fast.token_ids == ref and slow.token_ids == ref
    assert slow.server_calls < 48 / 2
    assert slow.server_calls < fast.server_calls
    assert slow.stats["mean_accepted_length"] > 1.5
    mean = lambda xs: sum(xs) / len(xs)
    assert mean(slow.stats["draft_lengths"]) > mean(fast.stats["draft_lengths"])
    assert slow.timings["network_s"] > 0.3 * slow.server_calls * 0.9  # the delay really was applied


def test_proxy_delay_bandwidth_and_outage(server):
    link = LinkProfile("x", 0.05, 80e3, 80e3, 0.0)  # 100 ms RTT, 10 kB/s
    with DelayProxy(server.port, link) as proxy, httpx.Client(base_url=proxy.url) as http:
        t0 = time.perf_counter()
        assert http.get("/v1/health").status_code == 200
        assert time.perf_counter() - t0 >= 0.1  # one round trip at least
        t0 = time.perf_counter()
        http.post("/v1/sessions", content=b"x" * 5000, headers={"Content-Type": "application/json"})
        assert time.perf_counter() - t0 >= 0.5  # 5 kB at 10 kB/s
        proxy.set_down(True)
        with pytest.raises(httpx.TransportError):
            http.get("/v1/health")
        proxy.set_down(False)
        assert http.get("/v1/health").status_code == 200


# ---------------------------------------------------------------------------------------------------------------------
def test_bad_input(tiny, server):
    url = server.url
    post = lambda path, **kw: httpx.post(url + path, **kw)
    ok = decode_result(post("/v1/sessions", json={"input_ids": [5, 6]}).content)
    sid = ok.session_id
    verify = f"/v1/sessions/{sid}/verify"
    cases = [
        (post("/v1/sessions", content=b"{not json", headers={"Content-Type": "application/json"}), 400, "malformed"),
        (post("/v1/sessions", json={"input_ids": "abc"}), 422, "input_ids"),
        (post("/v1/sessions", json={"input_ids": [1.5]}), 422, "input_ids"),
        (post("/v1/sessions", json={"input_ids": ["5"]}), 422, "input_ids.0"),
        (post("/v1/sessions", json={"input_ids": [5], "do_sample": "yes"}), 422, "do_sample"),
        (post("/v1/sessions", json={"input_ids": []}), 422, "input_ids"),
        (post("/v1/sessions", json={"input_ids": [5], "bogus": 1}), 422, "bogus"),
        (post("/v1/sessions", json={"input_ids": [5, 128]}), 422, "input_ids.1: Input should be less than 128"),
        (post("/v1/sessions", json={"input_ids": [-1]}), 422, "input_ids"),
        (post("/v1/sessions", json={"input_ids": [5], "temperature": 0}), 422, "temperature"),
        (post("/v1/sessions", json={"input_ids": [5], "draft_ids": [1] * 17}), 422, "--max-draft-tokens"),
        (post("/v1/sessions", json={"input_ids": [5] * 250, "draft_ids": [1] * 10}), 422, "--max-tokens-per-session"),
        (
            post(
                "/v1/sessions", json={"input_ids": [5], "draft_ids": [6], "draft_probs": [{"ids": [6], "probs": [1]}]}
            ),
            422,
            "do_sample",
        ),
        (post("/v1/sessions", json={"input_ids": [5], "do_sample": True, "draft_ids": [6]}), 422, "draft_probs"),
        (
            post(
                "/v1/sessions",
                json={
                    "input_ids": [5],
                    "do_sample": True,
                    "draft_ids": [6],
                    "draft_probs": [{"ids": [7], "probs": [1.0]}],
                },
            ),
            422,
            "no probability",
        ),
        (
            post("/v1/sessions", content=b"[" + b"1," * 20_000 + b"1]", headers={"Content-Type": "application/json"}),
            413,
            "--max-request-bytes",
        ),
        (post(verify, json={"num_verified": 3, "last_token": ok.next_token, "draft_ids": [300]}), 422, "than 128"),
        (post(verify, json={"num_verified": 9, "last_token": ok.next_token}), 409, "new session"),
        (post(verify, json={"num_verified": 3, "last_token": (ok.next_token + 1) % 128}), 409, "new session"),
        (post(verify, json={"num_verified": 3}), 422, "last_token"),
        (post("/v1/sessions/nope/verify", json={"num_verified": 1, "last_token": 5}), 404, "unknown session"),
        (httpx.delete(url + "/v1/sessions/nope"), 404, "unknown session"),
        (httpx.get(url + "/v1/nothing"), 404, ""),
    ]
    for response, status, text in cases:
        assert response.status_code == status, (response.status_code, response.text)
        assert text in response.json()["detail"], response.text

    def chunks():  # no Content-Length: counted while reading
        for _ in range(30):
            yield b"1" * 1000

    r = httpx.post(url + "/v1/sessions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    # the session is untouched by the rejected calls, and the server keeps serving
    good = decode_result(post(verify, json={"num_verified": 3, "last_token": ok.next_token}).content)
    assert good.num_verified == 4
    target, drafter = tiny
    with MoAClient(url, drafter=drafter) as client:
        assert client.generate([5, 6], 10).token_ids == reference(target, [5, 6], 10)


def test_limits_sessions_and_expiry(tiny):
    target, drafter = tiny
    # full: 429 at once; idle sessions are reaped in the background (a TTL the three creates fit in on a loaded CPU)
    limits = ServerLimits(max_sessions=2, session_ttl_s=1.0, admission_wait_s=0)
    with ServerThread(create_app(ServingState(target, drafter, limits=limits))) as srv:
        made = [httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5]}) for _ in range(3)]
        assert [r.status_code for r in made] == [200, 200, 429]
        assert "--max-sessions" in made[2].json()["detail"]
        assert int(made[2].headers["Retry-After"]) >= 1 and made[2].json()["retry_after_s"] >= 1
        sid = decode_result(made[0].content).session_id
        assert httpx.delete(f"{srv.url}/v1/sessions/{sid}").status_code == 204
        assert httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5]}).status_code == 200
        time.sleep(1.2)
        other = decode_result(made[1].content)
        r = httpx.post(
            f"{srv.url}/v1/sessions/{other.session_id}/verify",
            json={"num_verified": other.num_verified, "last_token": other.next_token},
        )
        assert r.status_code == 410 and "expired" in r.json()["detail"]
        # a client whose session expired between calls re-creates it and stays exact
        slow_client = MoAClient(srv.url, drafter=drafter)
        gen = slow_client.iter_generate([9, 8, 7], 12)
        next(gen)
        time.sleep(1.2)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                result = stop.value
                break
        assert result.token_ids == reference(target, [9, 8, 7], 12)
        assert result.stats["session_recreations"] >= 1


def test_token_auth(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter, token="s3cret")
    with ServerThread(create_app(state)) as srv:
        assert httpx.get(f"{srv.url}/v1/health").status_code == 200  # liveness needs no token
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5]}, headers=headers)
            assert r.status_code == 401 and "token" in r.json()["detail"]
        with pytest.raises(moa_hf.serving.ServingError, match="401"):
            MoAClient(srv.url, drafter=drafter, token="wrong").generate([5], 2)
        result = MoAClient(srv.url, drafter=drafter, token="s3cret").generate([5, 6], 5)
        assert result.token_ids == reference(target, [5, 6], 5)


def test_serve_refuses_public_bind_without_token(capsys, monkeypatch):
    monkeypatch.delenv("MOA_SERVE_TOKEN", raising=False)
    from moa_hf.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "--token" in capsys.readouterr().err


def test_drafter_download_and_fingerprint(tiny, server):
    target, drafter = tiny
    borrowed = moa_hf.build_drafter(target).eval()  # borrows the target's embedding and LM head
    copy = decode_drafter(encode_drafter(borrowed, target))
    assert copy.config.own_embeddings and lsa_fingerprint(copy) == lsa_fingerprint(borrowed)
    torch.testing.assert_close(copy.lm_head.weight, target.lm_head.weight)
    client = MoAClient(server.url)
    client.load_drafter()
    assert lsa_fingerprint(client.drafter) == lsa_fingerprint(drafter)
    assert client.generate([5, 6, 7], 9).token_ids == reference(target, [5, 6, 7], 9)
    torch.manual_seed(123)
    other = moa_hf.build_drafter(target, own_embeddings=True)
    with pytest.raises(ValueError, match="differs from the server"):
        MoAClient(server.url, drafter=other).generate([5], 2)


def test_cli_client(tiny, server, capsys):
    from moa_hf.cli import main

    target, drafter = tiny
    tokenizer = char_tokenizer()
    ids = tokenizer(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    ).input_ids
    ref = reference(target, ids, 12)
    assert main(["client", "--server", server.url, "--prompt", "hello", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == ref and out["prompt_tokens"] == len(ids)
    assert out["text"] == tokenizer.decode(ref, skip_special_tokens=True)
    assert out["unverified_tokens"] == 0 and out["server_calls"] >= 1 and out["timings"]["total_s"] > 0
    assert main(["client", "--server", server.url, "--prompt", "hello", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == out["text"].rstrip("\n")  # streamed text = the same text
    raw_ids = tokenizer("hello").input_ids
    assert (
        main(["client", "--server", server.url, "--prompt", "hello", "--raw", "--max-new-tokens", "5", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference(target, raw_ids, 5)


def test_bench_runs_on_a_tiny_target(tiny):
    from moa_hf.serving.bench import format_report, run_serving_bench

    target, drafter = tiny
    report = run_serving_bench(
        target,
        char_tokenizer(),
        drafter,
        profiles=("lan",),
        num_prompts=1,
        max_new_tokens=10,
        outage_after=2,
        outage_tokens=4,
        log=lambda *a: None,
    )
    lan = report["profiles"]["lan"]["methods"]
    assert lan["plain"]["calls_per_token"] == 1.0  # plain decoding: one round trip per token
    assert lan["plain"]["identical_to_target"] and lan["moa"]["identical_to_target"]
    assert report["outage"]["drafted_offline"] >= 4 and report["outage"]["identical_to_target_after_reconnection"]
    assert "| lan |" in format_report(report)


# ---------------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`moa serve` exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/v1/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError(f"`moa serve` did not come up on {url}")


@pytest.mark.slow
def test_cli_serve_killed_and_restarted(tiny, tmp_path):
    """`moa serve` in a subprocess is SIGKILLed mid-generation and started again on the same port."""
    target, drafter = tiny
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "moa_hf.cli",
        "serve",
        "--port",
        str(port),
        "--target",
        str(tmp_path / "target"),
        "--dtype",
        "float32",
        "--drafter",
        str(tmp_path / "drafter"),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)]
    try:
        _wait_healthy(url, procs[0])
        prompt = prompts(7, 1)[0]
        ref = reference(target, prompt, 30)
        client = MoAClient(url, drafter=drafter, backoff_initial_s=0.05, backoff_max_s=0.5, reconnect_timeout_s=120)
        events = client.iter_generate(prompt, 30)
        killed = False
        while True:
            try:
                event = next(events)
            except StopIteration as stop:
                result = stop.value
                break
            if event.kind == "verified" and not killed and event.position >= 4:
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait(10)
                killed = True
            elif event.kind == "offline":
                procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env))
        assert killed and len(procs) == 2
        assert result.token_ids == ref and result.unverified_tokens == 0
        assert result.stats["session_recreations"] >= 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_client_draft_policy():
    """The client's policy (driven by tests/policy_sim.py, the simulator of every route's policy) drafts more on a
    slow link, nothing with a useless drafter on a fast one (but still probes, less and less often), and learns the
    server's cost per verified token."""
    from moa_hf.serving import ClientDraftPolicy

    def trained(round_trip: float, accept: float) -> ClientDraftPolicy:
        policy = ClientDraftPolicy(max_length=16)
        world = World(verify=lambda n: 0.04 + 0.02 * n, draft_s=0.005, accept=accept, round_trip=round_trip)
        drive_client(policy, world, 60)
        return policy

    good_fast, good_slow = trained(0.001, 0.8), trained(0.6, 0.8)
    assert good_fast.acceptance == pytest.approx(0.8, abs=0.1)
    assert good_fast.server.seconds_of(5) == pytest.approx(0.04 + 0.02 * 5, rel=0.1)  # fitted to the calls
    assert 0 < good_fast.choose(100) < good_slow.choose(100) <= 16
    assert good_slow.choose(3) == 3  # never more than the budget
    useless = trained(0.001, 0.0)
    choices = [useless.choose(100) for _ in range(40)]
    assert set(choices) == {0, 1} and choices.count(1) <= 5  # plain decoding, with rare probes
    choices = drive_client(useless, World(verify=lambda n: 0.04 + 0.02 * n, accept=0.0, round_trip=0.001), 400)
    probes = [i for i, k in enumerate(choices) if k]
    assert [b - a for a, b in zip(probes, probes[1:])][-2:] == [useless.max_probe_every] * 2  # rejected: spaced
    assert ClientDraftPolicy(fixed=3).choose(100) == 3 and ClientDraftPolicy(fixed=3).choose(2) == 2


def test_drafter_blob_with_draft_vocabulary_keeps_float_embeddings(tiny):
    """An integer buffer (`draft_ids`) in the state dict must not set the dtype of the copied embedding/head."""
    from moa_hf.serving.protocol import decode_drafter, encode_drafter

    target, _ = tiny
    drafter = moa_hf.build_drafter(target, draft_vocab_size=16)
    drafter.init_draft_vocab(torch.arange(20, 36), target.get_output_embeddings().weight)
    copy = decode_drafter(encode_drafter(drafter, target))
    torch.testing.assert_close(copy.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(copy.draft_ids, drafter.draft_ids)
    drafter.attach(target)
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        torch.testing.assert_close(copy.embed(ids), drafter.embed(ids))
    finally:
        drafter.detach()


def test_client_prompt_lookup_is_exact_and_saves_calls(tiny, server):
    """A drafter with prompt lookup on drafts copies for free on the client; the server still verifies all."""
    target, drafter = tiny
    looking = copy.deepcopy(drafter)
    looking.config.lookup_num_tokens, looking.config.lookup_min_ngram = 6, 1
    prompt = [5, 6, 7, 8, 9, 10, 11] * 3
    ref = reference(target, prompt, 30)
    with MoAClient(server.url, drafter=looking, draft_length=6) as client:
        result = client.generate(prompt, max_new_tokens=30)
        sampled = client.generate(prompt, 20, do_sample=True, temperature=0.7, top_k=20, seed=3)
    with MoAClient(server.url, drafter=drafter, draft_length=6) as client:
        plain = client.generate(prompt, max_new_tokens=30)
    assert result.token_ids == ref == plain.token_ids and result.unverified_tokens == 0
    assert result.stats["lookup_drafted_tokens"] > 0 and plain.stats["lookup_drafted_tokens"] == 0
    assert result.server_calls < plain.server_calls
    assert len(sampled.token_ids) == 20 and sampled.unverified_tokens == 0 and sampled.stats["lookup_drafted_tokens"]


# ---------------------------------------------------------------------------------------------------------------------
def test_sliding_window_target_context_beyond_the_window_is_marked_and_kept_out(monkeypatch):
    """A prompt longer than a sliding window: a rejected draft crops the server's cache (which must keep the states
    the rollback needs), the server says which positions have no context (zeros: the window had dropped them), and a
    client generating against it stays exact; whatever it marks as without context is the oldest positions."""
    target = make_target("mistral-sliding")  # window 8: a sliding layer holds the newest 7 positions
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    prompt = prompts(5, 1)[0] + list(range(3, 23))  # > 20 tokens
    wrong = (reference(target, prompt, 1)[0] + 1) % 128  # rejected: the server crops the draft away
    state = ServingState(target, drafter, limits=ServerLimits(max_sessions=2, max_tokens_per_session=256))
    seen = []
    original = type(drafter).extend_context

    def extend_context(self, cache, context, valid=None):
        seen.append(None if valid is None else valid.tolist())
        return original(self, cache, context, valid=valid)

    with ServerThread(create_app(state)) as srv:
        body = {"input_ids": prompt, "draft_ids": [wrong, 5, 6], "context_format": "fp32"}
        first = decode_result(httpx.post(f"{srv.url}/v1/sessions", json=body).content)
        assert first.accepted == 0 and first.context_valid_from == len(prompt) - 7  # the newest 7 are held
        assert first.context[: first.context_valid_from].abs().max() == 0  # zeros, announced as such
        assert first.context[first.context_valid_from :].abs().amax(dim=-1).min() > 0
        client_drafter = copy.deepcopy(drafter)
        monkeypatch.setattr(type(client_drafter), "extend_context", extend_context)
        with MoAClient(srv.url, drafter=client_drafter, draft_length=4) as client:
            result = client.generate(prompt, max_new_tokens=24)
    assert result.token_ids == reference(target, prompt, 24) and result.unverified_tokens == 0
    for valid in seen:  # where a read had positions without context, they are the oldest ones (a prefix)
        assert valid is None or valid == sorted(valid)


class _Recording(httpx.HTTPTransport):
    """A transport that keeps the JSON body of every POST the client sends (then sends it)."""

    def __init__(self):
        super().__init__()
        self.posts: list[tuple[str, dict]] = []

    def handle_request(self, request):
        if request.method == "POST":
            self.posts.append((request.url.path, json.loads(request.read())))
        return super().handle_request(request)


def test_the_servers_request_models_are_the_protocols_with_ids_below_the_vocabulary():
    """One declaration of each request field (`protocol`): the server's models are the protocol's, field for field and
    constraint for constraint, but for the vocabulary bound on every token id (and only there)."""
    from moa_hf.serving.protocol import CreateSessionRequest, VerifyRequest, bounded_request_models

    vocab = 12345

    def bound_paths(schema, path=()):
        """The paths where `schema` bounds a value below `vocab`, and `schema` without those bounds."""
        if isinstance(schema, list):
            found = [bound_paths(item, (*path, i)) for i, item in enumerate(schema)]
            return [p for paths, _ in found for p in paths], [rest for _, rest in found]
        if not isinstance(schema, dict):
            return [], schema
        paths = [path] if schema.get("exclusiveMaximum") == vocab else []
        rest = {}
        for key, value in schema.items():
            if key == "exclusiveMaximum" and value == vocab:
                continue
            inner, rest[key] = bound_paths(value, (*path, key))
            paths += inner
        return paths, rest

    ids = ("items",)
    expected = {
        "CreateSessionRequest": {("properties", "input_ids", *ids), ("properties", "draft_ids", *ids)},
        "VerifyRequest": {("properties", "draft_ids", *ids), ("properties", "last_token")},
    }
    for protocol_model, server_model in zip((CreateSessionRequest, VerifyRequest), bounded_request_models(vocab)):
        paths, rest = bound_paths(server_model.model_json_schema())
        assert rest == protocol_model.model_json_schema()
        sparse = ("$defs", "SparseDistribution", "properties", "ids", *ids)  # the drafted tokens' distributions
        assert set(paths) == expected[protocol_model.__name__] | {sparse}


@pytest.mark.parametrize("do_sample", [False, True])
def test_client_requests_are_the_protocol_models(tiny, server, do_sample):
    """The client builds its create / verify bodies as the protocol's models (a misspelt or out-of-range field
    fails at the client, not as the server's 422): each body is one model's fields as the client set them."""
    from pydantic import ValidationError

    from moa_hf.serving.protocol import CreateSessionRequest, VerifyRequest

    _, drafter = tiny
    transport = _Recording()
    with MoAClient(server.url, drafter=drafter, transport=transport) as client:
        client.generate(prompts(3, 1)[0], max_new_tokens=12, do_sample=do_sample, seed=0 if do_sample else None)
    models = {"create": CreateSessionRequest, "verify": VerifyRequest}
    kinds = ["verify" if path.endswith("/verify") else "create" for path, _ in transport.posts]
    assert kinds[0] == "create" and "verify" in kinds
    for kind, (_, body) in zip(kinds, transport.posts):
        assert models[kind].model_validate(body).model_dump(exclude_unset=True) == body
    assert any(body.get("draft_ids") for _, body in transport.posts)  # something was drafted and sent
    assert all(("draft_probs" in body) == (do_sample and bool(body["draft_ids"])) for _, body in transport.posts)
    for model, body in ((VerifyRequest, {"num_verified": 1, "last_token": 2}), (CreateSessionRequest, {})):
        with pytest.raises(ValidationError, match="draft_idz"):
            model(**body, input_ids=[1], draft_idz=[3]) if model is CreateSessionRequest else model(
                **body, draft_idz=[3]
            )
