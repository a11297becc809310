"""The client's drafter cache: offline start, interrupted downloads, corrupted entries, server upgrades, the CLI."""

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_serving import char_tokenizer, reference

import moa_hf
from moa_hf.serving import MoAClient, ServerLimits, ServerThread, ServingState, create_app
from moa_hf.serving import cache as cache_module
from moa_hf.serving.cache import CacheError, DrafterCache, check_entry, server_key
from moa_hf.serving.netem import DelayProxy, LinkProfile
from moa_hf.serving.protocol import DRAFTER_FILE, lsa_fingerprint, tokenizer_file_bytes

from factory import make_target

FAST = LinkProfile("fast", 0.0005, 1e9, 1e9)
SLOW = LinkProfile("slow", 0.001, 1e9, 1e6)  # 1 Mbit/s down: the 0.5 MB tiny drafter takes about 4 s


@pytest.fixture(autouse=True)
def no_user_cache(tmp_path, monkeypatch):
    """A client given no cache_dir must not touch the user's cache either."""
    monkeypatch.setenv("MOA_HF_DRAFTER_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture(scope="module")
def tiny():
    """The tiny target and two different drafters for it (a server "upgrade" swaps one for the other)."""
    target = make_target("llama")
    drafters = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        drafters.append(moa_hf.build_drafter(target, own_embeddings=True).eval())
    return target, drafters


def state(tiny, which: int = 0) -> ServingState:
    target, drafters = tiny
    limits = ServerLimits(max_sessions=4, max_tokens_per_session=256, max_draft_tokens=16, session_ttl_s=60)
    return ServingState(target, drafters[which], tokenizer=char_tokenizer(), limits=limits)


@pytest.fixture(scope="module")
def states(tiny):
    return state(tiny, 0), state(tiny, 1)


@pytest.fixture
def server(states):
    with ServerThread(create_app(states[0])) as srv:
        yield srv


class Counting(httpx.HTTPTransport):
    """An HTTP transport that counts the requests per path."""

    def __init__(self):
        super().__init__()
        self.paths: list[str] = []

    def handle_request(self, request):
        self.paths.append(request.url.path)
        return super().handle_request(request)


def client(url: str, cache_dir: Path, **kwargs) -> MoAClient:
    kwargs = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "reconnect_timeout_s": 0.2, **kwargs}
    return MoAClient(url, cache_dir=cache_dir, **kwargs)


def entries(cache_dir: Path, url: str) -> list[str]:
    return DrafterCache(url, cache_dir).revisions()


def leftovers(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.rglob(".*"))


def run(events, on_event=lambda event: None):
    """Drive `iter_generate`, calling `on_event` on each event; returns (result, events)."""
    seen = []
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            return stop.value, seen
        seen.append(event)
        on_event(event)


# ---------------------------------------------------------------------------------------------------------------------
def test_revision_is_content_addressed(tiny, states):
    """The revision depends on the drafter and tokenizer only: a restarted server announces the same one."""
    a, b = states
    assert a.revision == state(tiny, 0).revision != b.revision
    assert a.info()["drafter"]["revision"] == a.revision and len(a.revision) == 16
    assert a.info()["drafter"]["bytes"] == len(a.drafter_blob())
    target, drafters = tiny
    assert ServingState(target, drafters[0]).revision != a.revision  # no tokenizer: another download
    assert server_key("http://127.0.0.1:8000/") == "127.0.0.1_8000" and server_key("https://[::1]") == "__1_443"
    with pytest.raises(ValueError, match="plain file names"):
        tokenizer_file_bytes({"files": {"../evil.json": "{}"}})


def test_downloaded_once_then_loaded_from_the_cache(tiny, server, states, tmp_path):
    target, _ = tiny
    first, second = Counting(), Counting()
    with client(server.url, tmp_path, transport=first) as c:
        assert c.generate([5, 6, 7], 8).token_ids == reference(target, [5, 6, 7], 8)
    assert first.paths.count("/v1/drafter") == 1 and first.paths.count("/v1/tokenizer") == 1
    revision = states[0].revision
    assert entries(tmp_path, server.url) == [revision] and leftovers(tmp_path) == []
    folder = tmp_path / server_key(server.url) / revision
    manifest = check_entry(folder)
    assert manifest["server_info"]["drafter"]["revision"] == revision
    assert (folder / DRAFTER_FILE).read_bytes() == states[0].drafter_blob()  # exactly what the server sent
    with client(server.url, tmp_path, transport=second) as c:
        result = c.generate([5, 6, 7], 8)
        assert c.revision == revision and c.tokenizer is not None  # the tokenizer came from the cache too
    assert "/v1/drafter" not in second.paths and "/v1/tokenizer" not in second.paths
    assert result.token_ids == reference(target, [5, 6, 7], 8) and result.stats["drafter_revision"] == revision
    assert (folder.stat().st_mode & 0o777) == 0o755


@pytest.mark.parametrize("older_entry", [False, True])
def test_download_cut_leaves_nothing(tiny, states, tmp_path, older_entry):
    """The link is cut while the drafter downloads: nothing half-written remains; the client falls back to an older
    valid entry (or says clearly that it has none); with the link back it downloads cleanly (or switches)."""
    target, drafters = tiny
    with ServerThread(create_app(states[0 if older_entry else 1])) as srv, DelayProxy(srv.port, FAST) as proxy:
        if older_entry:  # revision A cached, then the server is upgraded to B
            client(proxy.url, tmp_path).load_drafter()
            srv.stop()
            srv.start(create_app(states[1]))
        proxy.profile = SLOW  # for the connections opened from now on
        folder = tmp_path / server_key(proxy.url)

        def cut_when_half_written():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                partial = list(folder.glob(f".tmp-*/{DRAFTER_FILE}"))
                if partial and partial[0].stat().st_size > 20_000:
                    proxy.set_down(True)
                    return
                time.sleep(0.002)

        cutter = threading.Thread(target=cut_when_half_written)
        cutter.start()
        c = client(proxy.url, tmp_path)
        if older_entry:
            c.load_drafter()
        else:
            with pytest.raises(ConnectionError, match="holds no valid cached drafter") as err:
                c.load_drafter()
            assert "moa serve" in str(err.value) and "--drafter" in str(err.value)
        cutter.join()
        assert proxy._down, "the download finished before the link was cut"
        assert leftovers(tmp_path) == []  # no temporary folder, no partial entry
        assert entries(tmp_path, proxy.url) == ([states[0].revision] if older_entry else [])
        proxy.profile = FAST
        if older_entry:  # drafts with the older drafter (link still down), all unverified
            assert c.revision == states[0].revision and not c.connected
            assert lsa_fingerprint(c.drafter) == lsa_fingerprint(drafters[0])
            offline = c.generate([5, 6, 7], 5)
            assert offline.unverified_span == [0, 5] and offline.server_calls == 0
            proxy.set_down(False)  # the server runs B: the client notices on reconnection and switches
            result = c.generate([5, 6, 7], 10)
        else:
            proxy.set_down(False)
            c = client(proxy.url, tmp_path)
            result = c.generate([5, 6, 7], 10)
        assert result.token_ids == reference(target, [5, 6, 7], 10) and result.unverified_tokens == 0
        assert c.revision == states[1].revision == result.stats["drafter_revision"]
        assert lsa_fingerprint(c.drafter) == lsa_fingerprint(drafters[1])
        assert entries(tmp_path, proxy.url)[0] == states[1].revision and leftovers(tmp_path) == []
        check_entry(folder / states[1].revision)


def test_offline_start_then_server_comes_back(tiny, server, states, tmp_path):
    """The server is down when the client starts: it generates from the first token with its cached drafter, every
    token unverified; the server comes back mid-generation: the drafted tokens are verified, output exact."""
    target, _ = tiny
    client(server.url, tmp_path).load_drafter()
    server.stop()
    prompt = [9, 8, 7, 6]
    ref = reference(target, prompt, 24)
    c = client(server.url, tmp_path, reconnect_timeout_s=10)
    t0 = time.perf_counter()
    events = c.iter_generate(prompt, 24)
    first = next(events)
    assert first.kind == "offline" and first.position == 0 and not c.connected
    unverified = 0

    def on_event(event):
        nonlocal unverified
        if event.kind == "unverified":
            unverified += len(event.token_ids)
            if unverified == 8:
                server.start(create_app(states[0]))

    result, seen = run(events, on_event)
    kinds = [e.kind for e in seen]
    online = kinds.index("online")
    assert "verified" not in kinds[:online] and kinds[:online].count("unverified") >= 8  # nothing verified before
    assert [e.position for e in seen[:8]] == list(range(8))  # offline from the first token, one by one
    assert result.token_ids == ref and result.unverified_tokens == 0 and result.unverified_span is None
    assert result.offline_spans[0]["start"] == 0 and result.offline_spans[0]["drafted"] >= 8
    assert result.offline_spans[0]["reconnected_after_s"] > 0
    assert 0 < result.timings["first_unverified_token_s"] < result.timings["first_token_s"]
    assert result.timings["first_unverified_token_s"] < 5.0 and time.perf_counter() - t0 < 20
    assert c.connected and c.revision == states[0].revision


def test_offline_start_switches_to_an_upgraded_server(tiny, server, states, tmp_path):
    """Started offline with revision A cached; the server comes back running B: the client switches drafters
    mid-generation (downloading B, restarting its drafter cache) and the output is still the target's."""
    target, drafters = tiny
    client(server.url, tmp_path).load_drafter()
    server.stop()
    c = client(server.url, tmp_path, reconnect_timeout_s=10)
    assert c.load_drafter() is not None and c.revision == states[0].revision
    unverified = 0

    def on_event(event):
        nonlocal unverified
        if event.kind == "unverified":
            unverified += len(event.token_ids)
            if unverified == 4:
                server.start(create_app(state(tiny, 1)))

    result, seen = run(c.iter_generate([9, 8, 7], 16), on_event)
    assert [e.kind for e in seen][:2] == ["offline", "unverified"] and "online" in [e.kind for e in seen]
    assert result.token_ids == reference(target, [9, 8, 7], 16) and result.unverified_tokens == 0
    assert c.revision == states[1].revision == result.stats["drafter_revision"]
    assert lsa_fingerprint(c.drafter) == lsa_fingerprint(drafters[1])
    assert entries(tmp_path, server.url) == [states[1].revision, states[0].revision]


def test_server_never_returns_after_an_offline_start(tiny, server, tmp_path):
    target, _ = tiny
    client(server.url, tmp_path).load_drafter()
    server.stop()
    result = client(server.url, tmp_path).generate([5, 6, 7], 6)
    assert result.unverified_span == [0, 6] and result.server_calls == 0 and len(result.token_ids) == 6
    offline = client(server.url, tmp_path, offline=True).generate([5, 6, 7], 6)
    assert offline.token_ids == result.token_ids and offline.timings["total_s"] < 5  # no waiting for the server


def test_server_killed_mid_generation_with_a_cached_drafter(tiny, server, states, tmp_path):
    target, _ = tiny
    client(server.url, tmp_path).load_drafter()
    prompt = [11, 12, 13]
    ref = reference(target, prompt, 20)
    c = client(server.url, tmp_path, reconnect_timeout_s=10)
    offline = 0

    def on_event(event):
        nonlocal offline
        if event.kind == "verified" and event.position + len(event.token_ids) >= 4 and server._server is not None:
            if offline == 0:
                server.stop()
        elif event.kind == "unverified":
            offline += len(event.token_ids)
            if offline >= 5 and server._server is None:
                server.start(create_app(state(tiny, 0)))  # a new process: its sessions are gone

    result, seen = run(c.iter_generate(prompt, 20), on_event)
    kinds = [e.kind for e in seen]
    assert kinds.count("offline") == 1 and "online" in kinds
    assert result.token_ids == ref and result.unverified_tokens == 0
    assert result.stats["session_recreations"] >= 1


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte": lambda e: _flip(e / DRAFTER_FILE),
    "truncated": lambda e: (e / DRAFTER_FILE).write_bytes((e / DRAFTER_FILE).read_bytes()[:1000]),
    "no manifest": lambda e: (e / "manifest.json").unlink(),
    "missing tokenizer file": lambda e: (e / "tokenizer" / "tokenizer.json").unlink(),
    "extra file": lambda e: (e / "tokenizer" / "added.json").write_text("{}"),
    "bad manifest": lambda e: (e / "manifest.json").write_text("{not json"),
    "leftover temp folder": lambda e: e.rename(e.with_name(f".tmp-{e.name}-999999999-abc")),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_entry_is_never_loaded_and_replaced(tiny, server, states, tmp_path, monkeypatch, corruption):
    target, _ = tiny
    client(server.url, tmp_path).load_drafter()
    folder = tmp_path / server_key(server.url) / states[0].revision
    CORRUPTIONS[corruption](folder)
    decoded = []
    decode = cache_module.decode_drafter
    monkeypatch.setattr(
        cache_module, "decode_drafter", lambda blob, dtype: decoded.append(blob) or decode(blob, dtype)
    )
    counting = Counting()
    c = client(server.url, tmp_path, transport=counting)
    assert c.generate([5, 6, 7], 8).token_ids == reference(target, [5, 6, 7], 8)
    assert counting.paths.count("/v1/drafter") == 1  # detected, downloaded again
    assert decoded == [states[0].drafter_blob()]  # only the fresh, valid copy was ever decoded
    check_entry(folder)
    assert entries(tmp_path, server.url) == [states[0].revision] and leftovers(tmp_path) == []


@pytest.mark.parametrize("corruption", ["flipped byte", "truncated", "no manifest"])
def test_corrupt_entry_skipped_for_an_older_one_offline(tiny, server, states, tmp_path, corruption):
    """Server down: a corrupt newest entry is skipped (and removed) in favour of an older valid one; with none
    left, a clear error."""
    client(server.url, tmp_path).load_drafter()  # revision A
    server.stop()
    server.start(create_app(states[1]))
    client(server.url, tmp_path).load_drafter()  # revision B, newer
    server.stop()
    a, b = states[0].revision, states[1].revision
    assert entries(tmp_path, server.url) == [b, a]
    CORRUPTIONS[corruption](tmp_path / server_key(server.url) / b)
    c = client(server.url, tmp_path)
    c.load_drafter()
    assert c.revision == a and not c.connected and entries(tmp_path, server.url) == [a]
    CORRUPTIONS[corruption](tmp_path / server_key(server.url) / a)
    with pytest.raises(ConnectionError, match="cannot reach .* holds no valid cached drafter"):
        client(server.url, tmp_path).load_drafter()


def test_server_upgrade_refreshes_the_cache(tiny, server, states, tmp_path):
    """The server restarts with another drafter: a new client (and a long-lived one, at its next generation)
    notices the revision change and downloads it; going back to a cached revision downloads nothing."""
    target, drafters = tiny
    a, b = states[0].revision, states[1].revision
    long_lived = client(server.url, tmp_path, info_max_age_s=0.0)
    assert long_lived.generate([5, 6], 6).stats["drafter_revision"] == a
    server.stop()
    server.start(create_app(states[1]))
    counting = Counting()
    c = client(server.url, tmp_path, transport=counting)
    result = c.generate([5, 6], 6)
    assert counting.paths.count("/v1/drafter") == 1 and c.revision == b == result.stats["drafter_revision"]
    assert lsa_fingerprint(c.drafter) == lsa_fingerprint(drafters[1])
    assert result.token_ids == reference(target, [5, 6], 6)
    again = long_lived.generate([5, 6], 6)
    assert again.stats["drafter_revision"] == b and again.token_ids == result.token_ids
    assert entries(tmp_path, server.url) == [b, a]
    server.stop()
    server.start(create_app(states[0]))
    back = Counting()
    assert client(server.url, tmp_path, transport=back).generate([5, 6], 6).stats["drafter_revision"] == a
    assert "/v1/drafter" not in back.paths
    keep_one = DrafterCache(server.url, tmp_path, keep=1)
    keep_one._prune()
    assert len(keep_one.revisions()) == 1


def test_download_of_a_changed_drafter_is_refused(tiny, server, states, tmp_path):
    """The server changes drafters between /v1/info and /v1/drafter: the files do not have the announced revision;
    nothing is stored."""
    c = client(server.url, tmp_path)
    info = c.info()
    server.stop()
    server.start(create_app(states[1]))
    with pytest.raises(CacheError, match=f"the server announced {states[0].revision}"):
        c._download(states[0].revision, info)
    assert entries(tmp_path, server.url) == [] and leftovers(tmp_path) == []
    with pytest.raises(CacheError, match="not 16 hex digits"):
        with DrafterCache(server.url, tmp_path).writing("../x", info):
            pass
    with pytest.raises(CacheError, match="not 16 hex digits"):
        DrafterCache(server.url, tmp_path).load("../../etc")


def test_disk_error_while_caching_leaves_nothing(server, tmp_path, monkeypatch):
    def full(self, tmp, revision, info):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DrafterCache, "_commit", full)
    with pytest.raises(OSError, match="No space left on device.*--cache-dir"):
        client(server.url, tmp_path).load_drafter()
    assert entries(tmp_path, server.url) == [] and leftovers(tmp_path) == []


def test_bad_cache_dir(tmp_path, server):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(NotADirectoryError, match="--cache-dir"):
        MoAClient(server.url, cache_dir=not_a_folder)
    with pytest.raises(ValueError, match="at least one"):
        DrafterCache(server.url, tmp_path, keep=0)


def test_default_cache_dir_follows_the_environment(server, tmp_path):
    MoAClient(server.url).load_drafter()
    assert len(DrafterCache(server.url, tmp_path / "default-cache").revisions()) == 1
    assert DrafterCache(server.url).root == tmp_path / "default-cache"
    assert MoAClient(server.url, use_cache=False).cache is None


def test_cli_client_cache_and_offline(tiny, server, tmp_path, capsys):
    from moa_hf.cli import main

    target, _ = tiny
    cache = str(tmp_path / "cli-cache")
    args = ["client", "--server", server.url, "--cache-dir", cache, "--raw", "--prompt", "hi", "--json"]
    args += ["--max-new-tokens", "6", "--reconnect-timeout-s", "0.1"]
    assert main(args) == 0
    online = json.loads(capsys.readouterr().out)
    assert online["unverified_tokens"] == 0 and online["stats"]["drafter_revision"]
    server.stop()
    assert main(args) == 3  # unverified text: exit code 3 (EXIT_UNVERIFIED) unless --best-effort
    captured = capsys.readouterr()
    offline = json.loads(captured.out)
    assert offline["unverified_span"] == [0, 6] and offline["server_calls"] == 0
    assert "server unreachable: generating with the cached drafter" in captured.err
    assert main(args + ["--best-effort"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == offline["token_ids"]
    assert main(args + ["--offline"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == offline["token_ids"]
    empty = ["--cache-dir", str(tmp_path / "empty")]
    assert main(args[:3] + empty + args[5:]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and "no valid cached drafter" in err and "--drafter" in err
    assert main(args + ["--offline", "--no-cache"]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "cli-cache")) == [server_key(server.url)]
