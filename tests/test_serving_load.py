"""The server under load: batched verification across sessions (exact per session), chunked prefills, admission with
Retry-After, health that never waits, memory accounting, reaping, bounded context replies, and hardening (auth
before the body, API docs, slow clients, no 5xx for any input)."""

import asyncio
import json
import random
import socket
import threading
import time

import httpx
import pytest
import torch

import moa_hf
from moa_hf.serving import MoAClient, ServerLimits, ServerThread, ServingState, create_app
from moa_hf.serving.batching import Admission, AdmissionRefused, plan_forwards
from moa_hf.serving.protocol import check_content_digest, decode_result

from factory import make_target
from tolerance import assert_close

TOKEN = "load-token"


@pytest.fixture(autouse=True)
def drafter_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOA_HF_DRAFTER_CACHE", str(tmp_path / "drafters"))


@pytest.fixture(scope="module")
def tiny():
    target = make_target("llama")
    return target, moa_hf.build_drafter(target, own_embeddings=True).eval()


def reference(target, prompt: list[int], n: int) -> list[int]:
    return target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


class Gate:
    """Wraps a scheduler's forward: a batch holding the `blocker` cache waits inside the forward until `opened`, so
    that the calls submitted meanwhile all run in the next tick."""

    def __init__(self, scheduler, delay_s: float = 0.0):
        self.inner, self.delay_s, self.blocker = scheduler.forward, delay_s, None
        self.entered, self.opened = threading.Event(), threading.Event()
        scheduler.forward = self

    def __call__(self, target, caches, inputs, keep, layout):
        if self.blocker is not None and any(c is self.blocker for c in caches):
            self.entered.set()
            self.opened.wait(30)
        time.sleep(self.delay_s)
        return self.inner(target, caches, inputs, keep, layout)


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


# ---------------------------------------------------------------------------------------------------------------------
# Batched verification is exact per session
# ---------------------------------------------------------------------------------------------------------------------
class _Run:
    """Drives N sessions through the protocol: a create, then verify rounds whose drafts follow each session's greedy
    reference with some tokens wrong (so acceptance lengths vary), with draft_probs when sampling."""

    def __init__(self, target, prompts, do_sample: bool, rounds: int = 4, k: int = 3):
        self.prompts, self.do_sample, self.rounds, self.k = prompts, do_sample, rounds, k
        self.refs = [reference(target, p, rounds * (k + 1) + 2) for p in prompts]

    def create_body(self, i: int) -> dict:
        body = {"input_ids": self.prompts[i], "draft_ids": self.refs[i][:2], "context_format": "fp32"}
        if self.do_sample:
            body.update(do_sample=True, temperature=0.8, top_k=20, seed=100 + i, draft_probs=self.probs(body))
        return body

    def verify_body(self, i: int, state: dict) -> dict:
        generated = state["n"] - len(self.prompts[i])
        drafts = list(self.refs[i][generated : generated + self.k])
        drafts += [5] * (self.k - len(drafts))
        rng = random.Random(1000 * i + state["n"])  # the same drafts in whichever order the calls are made
        if rng.random() < 0.5:
            drafts[rng.randrange(self.k)] = (drafts[0] + 7) % 128  # a wrong token somewhere
        body = {"num_verified": state["n"], "last_token": state["last"], "draft_ids": drafts, "context_format": "fp32"}
        if self.do_sample:
            body["draft_probs"] = self.probs(body)
        return body

    @staticmethod
    def probs(body: dict) -> list[dict]:
        return [{"ids": [d, (d + 1) % 128], "probs": [0.75, 0.25]} for d in body["draft_ids"]]


def _answer(r: httpx.Response):
    assert r.status_code == 200, r.text
    check_content_digest(r.content, r.headers.get("Content-Digest"))
    assert r.headers.get("Content-Digest")
    return decode_result(r.content)


async def _alone(app, run: _Run) -> list[list]:
    """Each session on its own, one call after the other."""
    out = []
    async with asgi(app) as http:
        for i in range(len(run.prompts)):
            res = [_answer(await http.post("/v1/sessions", json=run.create_body(i)))]
            for _ in range(run.rounds):
                s = {"n": res[-1].num_verified, "last": res[-1].next_token}
                path = f"/v1/sessions/{res[0].session_id}/verify"
                res.append(_answer(await http.post(path, json=run.verify_body(i, s))))
            out.append(res)
    return out


async def _together(app, state: ServingState, run: _Run) -> list[list]:
    """Every round's calls of all sessions in flight at once, held back until they all wait: one tick each."""
    gate = Gate(state.scheduler)
    state.scheduler.overhead_tokens = 1e9  # one forward per tick whatever the lengths (ragged prompts included)
    N = len(run.prompts)
    async with asgi(app) as http:
        blocker = _answer(await http.post("/v1/sessions", json={"input_ids": [9, 9]}))
        b_state = {"n": blocker.num_verified, "last": blocker.next_token}

        async def round_(calls):
            gate.entered.clear(), gate.opened.clear()
            gate.blocker = state.sessions[blocker.session_id].cache
            body = {"num_verified": b_state["n"], "last_token": b_state["last"]}
            held = asyncio.ensure_future(http.post(f"/v1/sessions/{blocker.session_id}/verify", json=body))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            tasks = [asyncio.ensure_future(http.post(path, json=body)) for path, body in calls]
            while state.scheduler.pending < N + 1:
                await asyncio.sleep(0.005)
            gate.opened.set()
            b = _answer(await held)
            b_state.update(n=b.num_verified, last=b.next_token)
            return [_answer(await t) for t in tasks]

        res = [[r] for r in await round_([("/v1/sessions", run.create_body(i)) for i in range(N)])]
        for _ in range(run.rounds):
            calls = []
            for i, r in enumerate(res):
                s = {"n": r[-1].num_verified, "last": r[-1].next_token}
                calls.append((f"/v1/sessions/{r[0].session_id}/verify", run.verify_body(i, s)))
            for r, answer in zip(res, await round_(calls)):
                r.append(answer)
    ids = {r[0].session_id for r in res}
    together = [rec for rec in state.scheduler.history if ids <= {row[0] for row in rec.rows}]
    assert len(together) == run.rounds + 1  # the creates, then every round: all sessions in one forward
    return res


@pytest.mark.parametrize("family", ["llama", "mistral-sliding", "qwen2-sliding"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_batched_verification_is_exact_per_session(family, do_sample):
    """N sessions verified together (one forward per round, ragged prompt lengths, prompts longer than a sliding
    window) get exactly what each gets alone: accepted counts, tokens (greedy and seeded sampling), contexts."""
    target = make_target(family)
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (3, 11, 24, 17)]
    run = _Run(target, prompts, do_sample)
    alone_state, batched_state = ServingState(target, drafter), ServingState(target, drafter)
    alone = asyncio.run(_alone(create_app(alone_state), run))
    batched = asyncio.run(_together(create_app(batched_state), batched_state, run))
    accepted = 0
    for a_calls, b_calls in zip(alone, batched):
        for a, b in zip(a_calls, b_calls):
            assert (a.accepted, a.next_token, a.num_verified, a.context_start) == (
                b.accepted,
                b.next_token,
                b.num_verified,
                b.context_start,
            )
            assert a.context_valid_from == b.context_valid_from
            assert_close(a.context, b.context)
            accepted += a.accepted
    assert accepted > 0  # the drafts were (partly) right: acceptance was exercised
    for state in (alone_state, batched_state):
        state.close()


def test_concurrent_clients_are_exact(tiny):
    """Several `MoAClient`s generating at once (threads, real sockets): each output is the target's."""
    target, drafter = tiny
    state = ServingState(target, drafter)
    Gate(state.scheduler, delay_s=0.01)  # a slower forward: the clients' calls overlap
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(2, 20))] for _ in range(5)]
    results = {}
    with ServerThread(create_app(state)) as srv:

        def one(i):
            with MoAClient(srv.url, drafter=drafter, draft_length=3) as client:
                results[i] = client.generate(prompts[i], 16)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == reference(target, prompt, 16) and results[i].unverified_tokens == 0
    assert max(len(rec.rows) for rec in state.scheduler.history) >= 2  # some calls were verified together
    state.close()


def test_long_prefill_is_chunked_and_other_verifies_run_between(tiny):
    """A 100-token prompt is fed in 16-token chunks; another session's verify calls are answered between its chunks,
    before the long create is."""
    target, drafter = tiny
    state = ServingState(target, drafter, limits=ServerLimits(prefill_chunk=16))
    Gate(state.scheduler, delay_s=0.05)
    long_prompt = [random.Random(3).randrange(3, 128) for _ in range(100)]

    async def scenario():
        async with asgi(create_app(state)) as http:
            a = _answer(await http.post("/v1/sessions", json={"input_ids": [5, 6, 7]}))
            long_create = asyncio.ensure_future(http.post("/v1/sessions", json={"input_ids": long_prompt}))
            answered_a = 0
            while not long_create.done():
                body = {"num_verified": a.num_verified, "last_token": a.next_token, "draft_ids": [8]}
                a = _answer(await http.post(f"/v1/sessions/{a.session_id}/verify", json=body))
                answered_a += 1 if not long_create.done() else 0
            b = _answer(await long_create)
            return a, b, answered_a

    a, b, answered_a = asyncio.run(scenario())
    assert answered_a >= 2  # verify calls were answered while the long prompt was being fed
    chunks = [row for rec in state.scheduler.history for row in rec.rows if row[0] == b.session_id]
    assert [n for _, n, _ in chunks] == [16] * 6 + [4] and [f for _, _, f in chunks] == [False] * 6 + [True]
    firsts = [i for i, rec in enumerate(state.scheduler.history) if any(r[0] == b.session_id for r in rec.rows)]
    between = [
        rec
        for rec in list(state.scheduler.history)[firsts[0] : firsts[-1]]
        if any(r[0] == a.session_id for r in rec.rows)
    ]
    assert len(between) >= 2
    assert b.next_token == reference(target, long_prompt, 1)[0]
    state.close()


@pytest.mark.parametrize("family", ["llama", "llama-eager", "mistral-sliding", "qwen2-sliding", "gemma3-sliding"])
def test_batched_forward_matches_rows_alone(family):
    """`batched_forward` of a new session (empty cache), sessions past a sliding window (their sliding layers hold
    the newest positions only, after a crop) and a long row, against each row alone: logits and caches."""
    from transformers import DynamicCache

    from moa_hf.serving.batching import batched_forward

    target = make_target(family.removesuffix("-eager"))
    if family.endswith("-eager"):
        target.set_attn_implementation("eager")  # an additive mask instead of a boolean one
    rng = random.Random(4)

    def session(n):  # a cache as the server keeps it: past recording, cropped after the last forward
        cache = DynamicCache(config=target.config)
        cache.activate_past_recording()
        if n:
            tokens = [random.Random(n).randrange(3, 128) for _ in range(n)]
            with torch.no_grad():
                target(torch.tensor([tokens]), past_key_values=cache)
            cache.crop(-1)  # (the last token is not kept: as after a rejected draft)
        return cache

    lengths, inputs = [0, 5, 30, 12], [[7, 8, 9], [10], [11, 12, 13, 14], [rng.randrange(3, 128) for _ in range(20)]]
    alone, together = [session(n) for n in lengths], [session(n) for n in lengths]
    keep = [3, 1, 2, 1]
    with torch.no_grad():
        expected = [batched_forward(target, [c], [x], [k])[0] for c, x, k in zip(alone, inputs, keep)]
        got = batched_forward(target, together, inputs, keep)
    for e, g in zip(expected, got):
        assert_close(g, e)
    for a, t in zip(alone, together):
        assert a.get_seq_length() == t.get_seq_length()
        for la, lt in zip(a.layers, t.layers):
            assert_close(lt.keys, la.keys)
            assert_close(lt.values, la.values)


def test_plan_forwards_groups_by_length():
    assert plan_forwards([5, 256, 5, 6, 256, 1], overhead_tokens=8) == [[5, 0, 2, 3], [1, 4]]
    assert plan_forwards([5, 256], overhead_tokens=1e9) == [[0, 1]]
    assert plan_forwards([], overhead_tokens=8) == []


# ---------------------------------------------------------------------------------------------------------------------
# Admission, health, memory, reaping
# ---------------------------------------------------------------------------------------------------------------------
def test_admission_waits_then_429_with_retry_after(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter, limits=ServerLimits(max_sessions=1, admission_wait_s=0.5, max_queue=1))

    async def scenario():
        async with asgi(create_app(state)) as http:
            first = _answer(await http.post("/v1/sessions", json={"input_ids": [5]}))
            t0 = time.perf_counter()
            waiting = asyncio.ensure_future(http.post("/v1/sessions", json={"input_ids": [6]}))
            await asyncio.sleep(0.1)
            health = (await http.get("/v1/health")).json()
            over = await http.post("/v1/sessions", json={"input_ids": [7]})  # the queue (1) is full: 429 at once
            refused = await waiting
            waited = time.perf_counter() - t0
            # a create waiting while a session ends is admitted
            waiting = asyncio.ensure_future(http.post("/v1/sessions", json={"input_ids": [6]}))
            await asyncio.sleep(0.1)
            assert (await http.delete(f"/v1/sessions/{first.session_id}")).status_code == 204
            admitted = await waiting
            return health, over, refused, waited, admitted

    health, over, refused, waited, admitted = asyncio.run(scenario())
    assert health["queue_depth"] == 1 and health["sessions"] == 1 and health["max_sessions"] == 1
    for r in (over, refused):
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["retry_after_s"] == int(r.headers["Retry-After"]) and "queue_depth" in r.json()
    assert "--max-queue" in over.json()["detail"] and "--max-sessions" in refused.json()["detail"]
    assert 0.5 <= waited < 5
    assert admitted.status_code == 200
    state.close()


def test_shutting_down_answers_503_with_retry_after(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter, limits=ServerLimits(max_sessions=1, admission_wait_s=5))

    async def scenario():
        async with asgi(create_app(state)) as http:
            first = _answer(await http.post("/v1/sessions", json={"input_ids": [5]}))
            waiting = asyncio.ensure_future(http.post("/v1/sessions", json={"input_ids": [6]}))
            await asyncio.sleep(0.1)
            state.set_draining(True)  # what uvicorn's shutdown does first (`run_server`)
            out = [await waiting, await http.post("/v1/sessions", json={"input_ids": [7]})]
            health = (await http.get("/v1/health")).json()
            state.close()
            body = {"num_verified": first.num_verified, "last_token": first.next_token}
            out.append(await http.post(f"/v1/sessions/{first.session_id}/verify", json=body))
            return out, health

    answers, health = asyncio.run(scenario())
    assert health["status"] == "draining"
    for r in answers:
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text


def test_health_answers_while_the_model_is_busy(tiny):
    """A forward that takes 3 s: /v1/health still answers at once, and shows the work in progress."""
    target, drafter = tiny
    state = ServingState(target, drafter)
    gate = Gate(state.scheduler)
    with ServerThread(create_app(state)) as srv:
        gate.blocker = state.scheduler  # never a cache: set below once the session exists
        first = decode_result(httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5, 6]}).content)
        gate.blocker = state.sessions[first.session_id].cache
        body = {"num_verified": first.num_verified, "last_token": first.next_token, "draft_ids": [1, 2]}
        call = threading.Thread(
            target=httpx.post,
            args=(f"{srv.url}/v1/sessions/{first.session_id}/verify",),
            kwargs={"json": body, "timeout": 60},
        )
        call.start()
        assert gate.entered.wait(30)
        threading.Timer(3.0, gate.opened.set).start()
        latencies, samples = [], []
        while not gate.opened.is_set():
            t0 = time.perf_counter()
            samples.append(httpx.get(f"{srv.url}/v1/health", timeout=5).json())
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.2)
        call.join(30)
    assert len(latencies) >= 5 and max(latencies) < 1.0
    busy = samples[0]
    assert busy["status"] == "ok" and busy["active_batch"] == 1 and busy["sessions"] == 1
    assert busy["memory_used_bytes"] > 0 and busy["memory_budget_bytes"] >= busy["memory_used_bytes"]
    state.close()


def test_memory_budget_and_accounting(tiny):
    target, drafter = tiny
    probe = ServingState(target, drafter)
    per_token = probe.bytes_per_token
    assert per_token == 3 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32
    limits = ServerLimits(max_draft_tokens=8, admission_wait_s=0, memory_budget_bytes=300 * per_token)
    state = ServingState(target, drafter, limits=limits)
    with ServerThread(create_app(state)) as srv:
        body = {"input_ids": [5] * 10, "max_new_tokens": 150}
        first = httpx.post(f"{srv.url}/v1/sessions", json=body)
        assert first.status_code == 200
        health = httpx.get(f"{srv.url}/v1/health").json()
        assert health["memory_used_bytes"] == (10 + 150 + 8) * per_token
        assert health["memory_budget_bytes"] == 300 * per_token
        second = httpx.post(f"{srv.url}/v1/sessions", json=body)  # 2 x 168 tokens > 300
        assert second.status_code == 429 and "--memory-budget-gb" in second.json()["detail"]
        assert httpx.post(f"{srv.url}/v1/sessions", json={**body, "max_new_tokens": 100}).status_code == 200
        huge = httpx.post(f"{srv.url}/v1/sessions", json={**body, "max_new_tokens": 400})
        assert huge.status_code == 422 and "memory budget" in huge.json()["detail"]
        # a session may not grow past what it reserved
        sid = decode_result(first.content)
        n = sid.num_verified
        r = httpx.post(
            f"{srv.url}/v1/sessions/{sid.session_id}/verify",
            json={"num_verified": n, "last_token": sid.next_token, "draft_ids": [5] * 8},
        )
        assert r.status_code == 200
    state.close()
    probe.close()


def test_idle_sessions_are_reaped_and_free_their_slot(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter, limits=ServerLimits(session_ttl_s=0.3, max_sessions=1, admission_wait_s=5))
    with ServerThread(create_app(state)) as srv:
        first = decode_result(httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5]}).content)
        t0 = time.perf_counter()
        second = httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [6]}, timeout=30)  # waits for the reaping
        assert second.status_code == 200 and time.perf_counter() - t0 < 3
        r = httpx.post(
            f"{srv.url}/v1/sessions/{first.session_id}/verify",
            json={"num_verified": first.num_verified, "last_token": first.next_token},
        )
        assert r.status_code == 410
        deadline = time.monotonic() + 5
        while httpx.get(f"{srv.url}/v1/health").json()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{srv.url}/v1/health").json()["sessions"] == 0 and not state.sessions
    state.close()


def test_create_of_a_client_that_went_away_is_deleted(tiny):
    """A client sends a create and closes the connection before the answer: the session is not kept."""
    target, drafter = tiny
    state = ServingState(target, drafter)
    gate = Gate(state.scheduler, delay_s=0.5)
    with ServerThread(create_app(state)) as srv:
        body = json.dumps({"input_ids": [5, 6, 7]}).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(
                b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 10
            while state.scheduler.pending == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        # closed before the answer
        deadline = time.monotonic() + 10
        while (state.scheduler.pending or httpx.get(f"{srv.url}/v1/health").json()["sessions"]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not state.sessions and httpx.get(f"{srv.url}/v1/health").json()["sessions"] == 0
        assert len(state.scheduler.history) <= 1  # dropped at once, or after the forward it was in
    gate.delay_s = 0
    state.close()


def test_repeated_verify_gets_the_same_answer(tiny):
    """A verify repeated with the same fields (its answer was lost, or the client timed out while it ran) gets the
    same answer, also when sampling (where running it again would draw other random numbers); another call while
    one runs is refused (409)."""
    target, drafter = tiny
    state = ServingState(target, drafter)
    gate = Gate(state.scheduler)

    async def scenario():
        async with asgi(create_app(state)) as http:
            body = {"input_ids": [5, 6, 7], "do_sample": True, "temperature": 1.5, "seed": 3}
            first = _answer(await http.post("/v1/sessions", json=body))
            path = f"/v1/sessions/{first.session_id}/verify"
            drafts = [9, 10, 11]
            call = {
                "num_verified": first.num_verified,
                "last_token": first.next_token,
                "draft_ids": drafts,
                "draft_probs": [{"ids": [d], "probs": [1.0]} for d in drafts],
            }
            gate.blocker = state.sessions[first.session_id].cache
            running = asyncio.ensure_future(http.post(path, json=call))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            joined = asyncio.ensure_future(http.post(path, json=call))  # the same call while it runs
            other = await http.post(
                path, json={**call, "draft_ids": drafts[:2], "draft_probs": call["draft_probs"][:2]}
            )
            gate.opened.set()
            a, b = _answer(await running), _answer(await joined)
            again = _answer(await http.post(path, json=call))  # after it ran
            return a, b, again, other

    a, b, again, other = asyncio.run(scenario())
    assert other.status_code == 409 and "verifying another call" in other.json()["detail"]
    for x in (b, again):
        assert (x.accepted, x.next_token, x.num_verified) == (a.accepted, a.next_token, a.num_verified)
        torch.testing.assert_close(x.context, a.context)
    state.close()


def test_context_replies_are_bounded(tiny):
    target, drafter = tiny
    limits = ServerLimits(max_context_reply=16, context_reread_factor=2.0)
    state = ServingState(target, drafter, limits=limits)
    with ServerThread(create_app(state)) as srv:
        first = decode_result(httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": list(range(3, 43))}).content)
        assert first.context.shape[0] == 40  # a create sends the whole prompt's context
        path = f"{srv.url}/v1/sessions/{first.session_id}/verify"
        n, last = first.num_verified, first.next_token
        far = httpx.post(path, json={"num_verified": n, "last_token": last, "context_from": 0})
        assert far.status_code == 422 and "--max-context-reply" in far.json()["detail"]
        total = 0
        while True:  # 16 tokens back per call, up to 2 x the session's length in all
            r = httpx.post(path, json={"num_verified": n, "last_token": last, "context_from": n - 1 - 16})
            if r.status_code != 200:
                break
            res = decode_result(r.content)
            assert res.context.shape[0] == 17 and res.context_start == n - 1 - 16
            n, last, total = res.num_verified, res.next_token, total + 16
        assert r.status_code == 422 and "re-read" in r.json()["detail"]
        assert total <= 2 * n and total > 2 * n - 3 * 16
    state.close()


def test_model_failure_drops_the_session_and_keeps_serving(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter)
    inner = state.scheduler.forward

    def failing(target, caches, inputs, keep, layout):
        if any(len(x) == 4 for x in inputs):
            raise RuntimeError("simulated failure")
        return inner(target, caches, inputs, keep, layout)

    state.scheduler.forward = failing
    with ServerThread(create_app(state)) as srv:
        first = decode_result(httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5, 6]}).content)
        path = f"{srv.url}/v1/sessions/{first.session_id}/verify"
        body = {"num_verified": first.num_verified, "last_token": first.next_token, "draft_ids": [7, 8, 9]}
        r = httpx.post(path, json=body)
        assert r.status_code == 500 and "simulated failure" in r.json()["detail"]
        assert httpx.post(path, json=body).status_code == 404  # dropped: its cache may be half-updated
        assert httpx.get(f"{srv.url}/v1/health").json()["sessions"] == 0
        assert httpx.post(f"{srv.url}/v1/sessions", json={"input_ids": [5, 6]}).status_code == 200
    state.close()


def test_admission_is_first_come_first_served():
    admission = Admission(max_sessions=1, budget_bytes=100, max_queue=8, wait_s=5)
    order = []

    async def scenario():
        await admission.acquire(10)

        async def waiter(i):
            await admission.acquire(10)
            order.append(i)

        tasks = [asyncio.ensure_future(waiter(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert admission.queue_depth == 3
        for _ in range(3):
            admission.settle(10)
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        admission.drain()
        with pytest.raises(AdmissionRefused) as refused:
            await admission.acquire(10)
        assert refused.value.status == 503

    asyncio.run(scenario())
    assert order == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# Hardening
# ---------------------------------------------------------------------------------------------------------------------
def test_auth_before_body_and_docs_behind_the_token(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter, token=TOKEN, limits=ServerLimits(max_request_bytes=1000))
    with ServerThread(create_app(state)) as srv:
        url = srv.url
        json_type = {"Content-Type": "application/json"}
        unauthenticated = [
            httpx.post(f"{url}/v1/sessions", content=b"x" * 5_000_000, headers=json_type),  # over the size limit
            httpx.post(f"{url}/v1/sessions", content=b"{not json", headers=json_type),
            httpx.post(f"{url}/v1/sessions", content=iter([b"[1,"] * 1000), headers=json_type),  # chunked
            httpx.post(f"{url}/v1/sessions", json={"input_ids": [5]}, headers={"Authorization": "Bearer nope"}),
            httpx.get(f"{url}/v1/info"),
            httpx.get(f"{url}/openapi.json"),
        ]
        for r in unauthenticated:
            assert r.status_code == 401 and "token" in r.json()["detail"], (r.status_code, r.text)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/v1/health").status_code == 200  # liveness needs no token
        big = httpx.post(f"{url}/v1/sessions", content=b"x" * 5000, headers={**json_type, **auth})
        assert big.status_code == 413
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path, headers=auth).status_code == 404  # off by default
    with ServerThread(create_app(state, docs=True)) as srv:
        assert httpx.get(f"{srv.url}/openapi.json").status_code == 401
        assert httpx.get(f"{srv.url}/docs").status_code == 401
        schema = httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
        assert schema.status_code == 200 and "/v1/sessions" in schema.json()["paths"]
    state.close()


def _closed_within(port: int, first: bytes, seconds: float) -> tuple[float, bytes]:
    """Send `first` and nothing more: (seconds until the server closed the connection, what it answered)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(first)
        sock.settimeout(seconds)
        t0, data = time.perf_counter(), b""
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return time.perf_counter() - t0, data
            data += chunk


def test_slow_clients_are_cut_off(tiny):
    target, drafter = tiny
    state = ServingState(target, drafter, limits=ServerLimits(header_timeout_s=0.5, body_timeout_s=0.8))
    with ServerThread(create_app(state)) as srv:
        elapsed, data = _closed_within(srv.port, b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Le", 10)
        assert 0.4 < elapsed < 3 and data.startswith(b"HTTP/1.1 408")
        head = (
            b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        elapsed, data = _closed_within(srv.port, head + b'{"input_ids"', 10)
        assert 0.6 < elapsed < 3 and data.startswith(b"HTTP/1.1 408")
        elapsed, data = _closed_within(srv.port, b"", 10)  # a connection that never sends anything
        assert elapsed < 3
        # a normal client on a keep-alive connection is unaffected
        with httpx.Client(base_url=srv.url) as http:
            for _ in range(3):
                assert http.get("/v1/health").status_code == 200
                time.sleep(0.3)
            assert http.post("/v1/sessions", json={"input_ids": [5, 6]}).status_code == 200
    state.close()


BAD_BODIES = [
    ('{"input_ids": [5], "do_sample": true, "temperature": 1e-40}', "temperature"),
    ('{"input_ids": [5], "do_sample": true, "temperature": NaN}', "temperature"),
    ('{"input_ids": [5], "do_sample": true, "temperature": Infinity}', "temperature"),
    ('{"input_ids": [5], "do_sample": true, "temperature": 1e999}', "temperature"),
    ('{"input_ids": [5], "do_sample": true, "temperature": "hot"}', "temperature"),
    ('{"input_ids": [5], "do_sample": true, "top_p": 0}', "top_p"),
    ('{"input_ids": [5], "do_sample": true, "top_k": 200}', "top_k"),
    ('{"input_ids": [5], "do_sample": true, "top_k": 1000000000000000000000000000000}', "top_k"),
    ('{"input_ids": [5], "do_sample": true, "seed": 1000000000000000000000000000000}', "seed"),
    ('{"input_ids": [5], "max_new_tokens": 1000000000000000000000000000000}', "max_new_tokens"),
    ('{"input_ids": [5], "max_new_tokens": 0}', "max_new_tokens"),
    ('{"input_ids": [5], "max_new_tokens": 5000}', "max_new_tokens"),
    ('{"input_ids": [5], "context_from": 1000000000000000000000000000000}', "context_from"),
    ('{"input_ids": [1000000000000000000000000000000]}', "input_ids"),
    ('{"input_ids": [1e300]}', "input_ids"),
    ('{"input_ids": {"a": 1}}', "input_ids"),
    (
        '{"input_ids": [5], "draft_ids": [6], "do_sample": true, "draft_probs": [{"ids": [6], "probs": [NaN]}]}',
        "probs",
    ),
]


def test_no_server_error_for_any_input(tiny):
    """Values the arithmetic cannot take, huge integers, NaN/inf and wrong types: 422 (never a 5xx)."""
    target, drafter = tiny
    state = ServingState(target, drafter)

    async def scenario():
        async with asgi(create_app(state)) as http:
            out = []
            for body, field in BAD_BODIES:
                r = await http.post("/v1/sessions", content=body, headers={"Content-Type": "application/json"})
                out.append((body, field, r))
            ok = _answer(await http.post("/v1/sessions", json={"input_ids": [5]}))
            path = f"/v1/sessions/{ok.session_id}/verify"
            for body in (
                {"num_verified": 10**30, "last_token": ok.next_token},
                {"num_verified": 2, "last_token": 10**30},
                {"num_verified": 2, "last_token": ok.next_token, "context_from": 10**30},
                {"num_verified": 2.5, "last_token": ok.next_token},
            ):
                out.append((body, "", await http.post(path, json=body)))
            return out

    for body, field, r in asyncio.run(scenario()):
        assert r.status_code == 422, (body, r.status_code, r.text)
        assert field in r.json()["detail"], (body, r.text)
    state.close()


def test_serve_cli_defaults_are_the_server_limits():
    """`moa serve`'s defaults are `ServerLimits`' (one set of numbers, documented in docs/serving.md)."""
    import argparse

    from moa_hf.serving.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = vars(parser.parse_args(["serve"]))
    limits = vars(ServerLimits())
    shared = {k: v for k, v in limits.items() if k in args}
    assert shared == {k: args[k] for k in shared} and len(shared) >= 12
    assert args["memory_budget_gb"] is None and limits["memory_budget_bytes"] is None
    assert args["docs"] is False and args["token_file"] is None
