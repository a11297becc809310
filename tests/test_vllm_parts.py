"""The parts of `moa_hf.vllm` that run without vLLM: the paged KV cache readers (`kv_cache`), the draft length policy
(`policy`), the engine/serve argument helpers (`moa_hf.vllm`), and the re-laying of drafter tree states that the
proposer's continuous batching needs (`TreeState.compact` / `pad_left` / `concat_rows`, `MoATreeState`'s overrides,
`tree_catch_up` with a reader function in place of a transformers cache)."""

import ast
import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import moa_hf
import moa_hf.vllm
from moa_hf.modeling.drafting import CACHE_NAME
from moa_hf.modeling.modeling_moa import MoATreeState, gather_target_kv_at
from moa_hf.vllm.kv_cache import (
    LAYOUTS,
    PagedKVReader,
    PagedLayout,
    UnsupportedCacheError,
    layout_for,
    slots_of,
)
from moa_hf.vllm.policy import VllmDraftPolicy
from moa_hf.vllm.pricing import CatchUpPrice, OutputLengths, batch_bucket

from factory import make_independent, make_target, sorted_drafter
from policy_sim import World, drive_vllm
from tolerance import assert_close

# ---------------------------------------------------------------------------------------------------------------------
# Synthetic paged caches: [num_blocks, Hkv, block_size, 2*hd], written as each backend writes them
# ---------------------------------------------------------------------------------------------------------------------
NB, H, BS, HD = 7, 3, 4, 5  # all different, so that a transposed or swapped axis shows


def _write_cpu(cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor, key_at, value_at) -> None:
    """Write the key/value of `slot` element by element into the flat memory of a vLLM CPU cache: per (block, head) a
    region of bs*hd key numbers then bs*hd value numbers, element (o, d) at `key_at(o, d, bs, hd)` /
    `bs*hd + value_at(o, d, bs, hd)` within it."""
    nb, h, bs, hd2 = cache.shape
    hd = hd2 // 2
    flat = cache.view(-1)
    block, o = divmod(slot, bs)
    for head in range(h):
        base = (block * h + head) * 2 * bs * hd
        for d in range(hd):
            flat[base + key_at(o, d, bs, hd)] = k[head, d]
            flat[base + bs * hd + value_at(o, d, bs, hd)] = v[head, d]


def _write_cpu_vec(cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """vLLM's CPU layout: the key's element d of offset o at d*bs + o (keys transposed, [hd, bs]), the value's at
    o*hd + d ([bs, hd])."""
    _write_cpu(cache, slot, k, v, lambda o, d, bs, hd: d * bs + o, lambda o, d, bs, hd: o * hd + d)


def _write_head_major(cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """FlashAttention/Triton: cache[block, head, offset] = [key, value] (through the logical view)."""
    hd = cache.shape[-1] // 2
    block, o = divmod(slot, cache.shape[2])
    cache[block, :, o, :hd] = k
    cache[block, :, o, hd:] = v


WRITERS = {"cpu_vec": _write_cpu_vec, "head_major": _write_head_major}


def _tokens(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, HD, generator=g), torch.randn(n, H, HD, generator=g)  # keys, values [n, H, hd]


def _filled(layout: str, n: int = 12, seed: int = 0, cache: torch.Tensor | None = None):
    """A cache (random garbage elsewhere) with n tokens' keys/values written at random distinct slots."""
    g = torch.Generator().manual_seed(seed + 100)
    if cache is None:
        cache = torch.randn(NB, H, BS, 2 * HD, generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:n]
    keys, values = _tokens(n, seed)
    for i, slot in enumerate(slots.tolist()):
        WRITERS[layout](cache, slot, keys[i], values[i])
    expected = torch.cat([keys, values], dim=-1).reshape(n, H * 2 * HD)  # per head: key then value
    return cache, slots, expected


@pytest.mark.parametrize("layout", ["cpu_vec", "head_major"])
def test_layout_reads_what_was_written(layout):
    cache, slots, expected = _filled(layout)
    got = LAYOUTS[layout].read(cache, slots // BS, slots % BS)
    assert got.shape == (len(slots), H * 2 * HD)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert LAYOUTS[layout].block_size(cache) == BS and LAYOUTS[layout].name == layout


def test_head_major_through_a_permuted_view():
    """A cache allocated [num_blocks, block_size, Hkv, 2*hd] and used through its logical permuted view."""
    storage = torch.randn(NB, BS, H, 2 * HD)
    cache = storage.permute(0, 2, 1, 3)  # logical [NB, H, BS, 2*hd], not contiguous
    assert not cache.is_contiguous()
    cache, slots, expected = _filled("head_major", cache=cache, seed=3)
    block, offset = int(slots[0]) // BS, int(slots[0]) % BS
    torch.testing.assert_close(storage[block, offset].reshape(-1), expected[0], rtol=0, atol=0)  # it is in storage
    got = LAYOUTS["head_major"].read(cache, slots // BS, slots % BS)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("written, read", [("cpu_vec", "head_major"), ("head_major", "cpu_vec")])
def test_wrong_layout_reads_other_numbers(written, read):
    cache, slots, expected = _filled(written, seed=5)
    got = LAYOUTS[read].read(cache, slots // BS, slots % BS)
    assert got.shape == expected.shape
    wrong_rows = (got != expected).any(-1)
    assert wrong_rows.all(), "a wrong layout must not read any token's keys/values right"


AMX = dict(nb=3, h=2, bs=32, hd=32)  # the "amx" ISA tiles 16 tokens (keys) and 16 dimensions (values)


def _write_cpu_amx(cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """vLLM's CPU "amx" layout, as its `cpu_attn_reshape_and_cache(..., "amx")` lays it out
    (`tests/test_vllm_engine.py` checks the reader against that op): key (o, d) at
    (o // 16) * 16 * hd + (d // 2) * 32 + (o % 16) * 2 + d % 2, value (o, d) at
    (d // 16) * bs * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2."""
    _write_cpu(
        cache,
        slot,
        k,
        v,
        lambda o, d, bs, hd: (o // 16) * 16 * hd + (d // 2) * 32 + (o % 16) * 2 + d % 2,
        lambda o, d, bs, hd: (d // 16) * bs * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2,
    )


@pytest.mark.parametrize("read", ["cpu_amx", "cpu_vec", "head_major"])
def test_amx_layout_reads_what_was_written(read):
    g = torch.Generator().manual_seed(9)
    nb, h, bs, hd = AMX.values()
    cache = torch.randn(nb, h, bs, 2 * hd, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:20]
    keys, values = torch.randn(20, h, hd, generator=g), torch.randn(20, h, hd, generator=g)
    for i, slot in enumerate(slots.tolist()):
        _write_cpu_amx(cache, slot, keys[i], values[i])
    expected = torch.cat([keys, values], dim=-1).reshape(20, h * 2 * hd)
    got = LAYOUTS[read].read(cache, slots // bs, slots % bs)
    if read == "cpu_amx":
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:  # another layout reads other numbers for every token
        assert (got != expected).any(-1).all()


def test_layout_keys_transposed_flags():
    assert LAYOUTS["cpu_vec"].keys_transposed and not LAYOUTS["head_major"].keys_transposed
    assert isinstance(LAYOUTS["cpu_vec"], PagedLayout)


def test_slots_of():
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)  # vLLM's block tables are int32
    positions = torch.tensor([[0, 5, 11, -1], [3, 4, 9, -2]])
    expected = torch.tensor([[12, 1, 23, -1], [7, 16, 9, -1]])
    got = slots_of(table, positions, 4)
    assert got.dtype == torch.long
    assert torch.equal(got, expected)
    assert torch.equal(slots_of(table, positions, 4), slots_of(table.long(), positions, 4))


def test_slots_of_random_against_definition():
    g = torch.Generator().manual_seed(0)
    bs, B, nblk = 3, 4, 5
    table = torch.randint(0, 50, (B, nblk), generator=g)
    positions = torch.randint(-3, nblk * bs, (B, 9), generator=g)
    got = slots_of(table, positions, bs)
    for b in range(B):
        for j, p in enumerate(positions[b].tolist()):
            assert int(got[b, j]) == (-1 if p < 0 else int(table[b, p // bs]) * bs + p % bs)


def test_layout_for():
    assert layout_for("CPU_ATTN", "vec") is LAYOUTS["cpu_vec"]
    assert layout_for("CPU_ATTN", "vec16") is LAYOUTS["cpu_vec"]
    assert layout_for("FLASH_ATTN") is LAYOUTS["head_major"]
    assert layout_for("TRITON_ATTN", None, "auto") is LAYOUTS["head_major"]
    assert layout_for("CPU_ATTN", "amx") is LAYOUTS["cpu_amx"]
    with pytest.raises(UnsupportedCacheError, match="'neon'"):
        layout_for("CPU_ATTN", "neon")
    with pytest.raises(UnsupportedCacheError, match="None"):
        layout_for("CPU_ATTN", None)
    with pytest.raises(UnsupportedCacheError, match="FLASHINFER"):
        layout_for("FLASHINFER")
    with pytest.raises(UnsupportedCacheError, match="quantised.*fp8"):
        layout_for("FLASH_ATTN", kv_cache_dtype="fp8")
    with pytest.raises(UnsupportedCacheError, match="fp8"):
        layout_for("CPU_ATTN", "vec", kv_cache_dtype="fp8")
    assert issubclass(UnsupportedCacheError, ValueError)


# ---------------------------------------------------------------------------------------------------------------------
# PagedKVReader against gather_target_kv_at on a transformers cache holding the same keys/values
# ---------------------------------------------------------------------------------------------------------------------
def _paged_copy(layers_kv, layout: str, bs: int, nb: int, g):
    """Paged caches (one per layer) holding `layers_kv` [(keys, values) [B, Hkv, T, hd]] at a random block table;
    returns (caches, block table [B, max_blocks])."""
    B, h, T, hd = layers_kv[0][0].shape
    per_row = -(-T // bs)
    table = torch.randperm(nb, generator=g)[: B * per_row].view(B, per_row).to(torch.int32)
    caches = [torch.randn(nb, h, bs, 2 * hd, generator=g) for _ in layers_kv]
    for cache, (k, v) in zip(caches, layers_kv):
        for b in range(B):
            for t in range(T):
                WRITERS[layout](cache, int(table[b, t // bs]) * bs + t % bs, k[b, :, t], v[b, :, t])
    return caches, table


@pytest.mark.parametrize("layout", ["cpu_vec", "head_major"])
def test_reader_equals_gather_target_kv_at(layout):
    g = torch.Generator().manual_seed(7)
    B, T, L, bs = 2, 9, 3, 4
    layers_kv = [(torch.randn(B, H, T, HD, generator=g), torch.randn(B, H, T, HD, generator=g)) for _ in range(L)]
    dyn = DynamicCache()
    for i, (k, v) in enumerate(layers_kv):
        dyn.update(k, v, i)
    caches, table = _paged_copy(layers_kv, layout, bs, nb=16, g=g)
    reader = PagedKVReader(caches, LAYOUTS[layout])
    assert reader.block_size == bs

    positions = torch.tensor([[0, 8, 3, 4, -1], [-1, 7, 1, 0, 5]])  # [B, n]
    got = reader(slots_of(table, positions, bs))
    assert got.shape == (B, 5, L, H * 2 * HD)
    want = gather_target_kv_at(dyn, positions)
    ok = positions >= 0
    torch.testing.assert_close(got[ok], want[ok], rtol=0, atol=0)
    # the joined vector of token t per layer, written out: cat(keys, values).transpose(1, 2).flatten(2)[b, t]
    b, t, layer = 1, 7, 2
    k, v = layers_kv[layer]
    torch.testing.assert_close(got[b, 1, layer], torch.cat([k, v], -1).transpose(1, 2).flatten(2)[b, t])
    # per layer, the layout's own read of the same slots
    flat = slots_of(table, positions, bs).reshape(-1).clamp(min=0)
    for i, cache in enumerate(caches):
        per_layer = LAYOUTS[layout].read(cache, flat // bs, flat % bs).view(B, 5, -1)
        torch.testing.assert_close(got[:, :, i], per_layer, rtol=0, atol=0)
    # slots < 0 read slot 0 (no error)
    slot0 = reader(torch.zeros(1, 1, dtype=torch.long))[0, 0]
    torch.testing.assert_close(got[0, 4], slot0, rtol=0, atol=0)
    torch.testing.assert_close(got[1, 0], slot0, rtol=0, atol=0)
    # dtype: the drafter's
    as64 = PagedKVReader(caches, LAYOUTS[layout], dtype=torch.float64)(slots_of(table, positions, bs))
    assert as64.dtype == torch.float64
    torch.testing.assert_close(as64, got.double())


def test_reader_needs_a_layer():
    with pytest.raises(UnsupportedCacheError, match="no attention layer"):
        PagedKVReader([], LAYOUTS["head_major"])


# ---------------------------------------------------------------------------------------------------------------------
# VllmDraftPolicy (driven by tests/policy_sim.py, the simulator of every route's policy)
# ---------------------------------------------------------------------------------------------------------------------
def test_batch_bucket():
    assert [batch_bucket(b) for b in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_acceptance_accounting_and_expected_tokens():
    p = VllmDraftPolicy(max_tokens=3)
    rates = p.network_rates  # reached and accepted counts after a prior of 1 in 2
    assert rates.rates(3) == [0.5, 0.5, 0.5]  # the prior
    assert rates.expected_tokens(0) == 1.0 and rates.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    p.record_acceptance(3, 1)  # position 1 accepted, position 2 rejected, position 3 never reached
    assert rates.tried == [[3, 3, 2]] and rates.right == [[2, 1, 1]]
    p.record_acceptance(3, 3)  # all accepted
    p.record_acceptance(2, 0)  # rejected at position 1
    p.record_acceptance(0, 0)  # no draft: nothing
    assert rates.tried == [[5, 4, 3]] and rates.right == [[3, 2, 2]]
    assert rates.rates(3) == pytest.approx([3 / 5, 2 / 4, 2 / 3])
    assert rates.expected_tokens(1) == pytest.approx(1 + 3 / 5)
    assert rates.expected_tokens(3) == pytest.approx(1 + 3 / 5 + 3 / 10 + 1 / 5)
    assert p.lookup_rates.rates(3) == [0.5, 0.5, 0.5]  # lookup's drafts kept apart


def _engine_cost(per_token: float, fixed: float = 0.010):
    """A target whose step verifying N tokens costs fixed + per_token * N seconds."""
    return lambda tokens: fixed + per_token * tokens


def _lengths(policy, batch_size, engine_cost, steps, accept=0.8, draft_per_token=0.0005) -> list[int]:
    """The draft lengths `policy` chooses when the simulator drives it without lookup (see `drive_vllm`)."""
    world = World(verify=engine_cost, accept=accept, draft_s=draft_per_token)
    return [k for k, _ in drive_vllm(policy, world, steps, batch_size)]


def test_measures_max_then_zero_first():
    p = VllmDraftPolicy(max_tokens=3, samples=2, explore_every=10**6)
    chosen = _lengths(p, 1, _engine_cost(0.0001), 4)
    assert chosen == [3, 3, 0, 0]
    assert p.draft_seconds(1, 3) == pytest.approx(0.0015)
    assert p.draft_seconds(1, 1) == pytest.approx(0.0015 * 2 / 4)  # from k = max's: catch-up + k drafting steps
    assert p.draft_seconds(1, 0) == 0.0


def test_engine_seconds_interpolates_by_tokens():
    p = VllmDraftPolicy(max_tokens=3)
    assert p.engine.at(4) is None
    p.record_step(1, 0, 1, 0.010, 0.0)
    p.record_step(1, 3, 4, 0.016, 0.002)
    assert p.engine.at(1) == pytest.approx(0.010)
    assert p.engine.at(2) == pytest.approx(0.012)  # linear between measured token counts
    assert p.engine.at(8) == pytest.approx(0.032)  # beyond: proportional (pessimistic for drafting)
    # a measurement at batch 4 without drafting (4 tokens) is the same engine cost as batch 1 with k = 3
    p.record_step(4, 0, 4, 0.018, 0.0)
    assert p.engine.at(4) == pytest.approx(0.017)  # the median of both


def test_policy_drafts_at_batch_1_and_not_where_verifying_costs_more_than_it_brings():
    p = VllmDraftPolicy(max_tokens=4, explore_every=10**6)
    warmup = 2 * p.samples
    cheap = _engine_cost(0.0005)  # verifying a token more costs 5% of a step: drafting pays
    chosen = _lengths(p, 1, cheap, warmup + 30)
    assert chosen[-20:] == [4] * 20  # once the acceptance rates have settled
    assert p.network_rates.rates(4) == pytest.approx([0.8] * 4, abs=0.08)
    costly = _engine_cost(0.010, fixed=0.0)  # compute-bound: a step costs as much per token as a decode step
    chosen = _lengths(p, 16, costly, warmup + 30)
    # verifying 5x the tokens costs 5x (extrapolated from batch 1): even free drafting loses, so it is not tried
    assert chosen == [0] * (warmup + 30)
    assert p.throughput(16, 4, optimistic=True) < p.throughput(16, 0)
    d = p.as_dict()
    assert len(d["acceptance_by_position"]) == 4 and d["engine_s_by_tokens"] and d["draft_s"]


def test_policy_chooses_an_intermediate_k_where_it_pays():
    """Acceptance falls after position 1: draft length 1 maximises tokens per second."""
    p = VllmDraftPolicy(max_tokens=3, explore_every=10**6)
    for _ in range(200):
        p.record_acceptance(3, 1)  # position 1 always accepted, position 2 never
    chosen = _lengths(p, 1, _engine_cost(0.002), 2 * p.samples + 5, accept=0.0)
    assert chosen[2 * p.samples :] == [1] * 5


def test_reexploration_after_explore_every_steps_backs_off():
    """Verifying is cheap (drafting could pay) but drafting itself is slow: the policy measures, decodes plainly,
    and measures k = max again after explore_every steps, then after twice that, and so on."""
    every = 8
    p = VllmDraftPolicy(max_tokens=2, explore_every=every)
    chosen = _lengths(p, 4, _engine_cost(0.0001), 4 + 12 * every, draft_per_token=0.02)
    assert chosen[:4] == [2, 2, 0, 0]
    again = [i for i, c in enumerate(chosen) if c == 2 and i >= 4]
    assert chosen[4:].count(0) > len(chosen[4:]) * 0.9
    gaps = [b - a for a, b in zip([1, *again], again)]
    assert len(again) >= 2 and all(b >= 2 * a - 1 for a, b in zip(gaps, gaps[1:])), gaps  # doubling intervals
    assert gaps[0] > every


def test_fixed_draft_length():
    p = VllmDraftPolicy(max_tokens=3, fixed=2)
    for batch in (1, 16, 64):
        p.record_step(batch, 0, batch, 0.001, 0.0)
        p.record_step(batch, 2, 3 * batch, 10.0, 1.0)  # measured costs do not matter
        assert [p.choose(batch) for _ in range(20)] == [2] * 20
    assert VllmDraftPolicy(max_tokens=3, fixed=0).choose(1) == 0
    assert VllmDraftPolicy(max_tokens=3, fixed=3).choose(1) == 3
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="draft_length"):
            VllmDraftPolicy(max_tokens=3, fixed=bad)


# ---------------------------------------------------------------------------------------------------------------------
# Engine and serve arguments
# ---------------------------------------------------------------------------------------------------------------------
def test_proposer_path_names_the_proposer_class():
    module, _, name = moa_hf.vllm.PROPOSER.rpartition(".")
    assert module == "moa_hf.vllm.proposer"
    source = Path(moa_hf.vllm.__file__).with_name("proposer.py").read_text()
    classes = {n.name for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    assert name in classes


def test_speculative_and_additional_config(tmp_path, monkeypatch):
    assert moa_hf.vllm.speculative_config(5) == {
        "method": "custom_class",
        "model": "moa_hf.vllm.proposer.MoAProposer",
        "num_speculative_tokens": 5,
    }
    assert moa_hf.vllm.speculative_config()["num_speculative_tokens"] == 3
    for bad in (0, -2):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            moa_hf.vllm.speculative_config(bad)
    assert moa_hf.vllm.additional_config() == {
        "moa_hf": {
            "drafter": "default",
            "draft_length": None,
            "lookup": True,
            "allow_other_target": False,
            "allow_untested_vllm": False,
            "catch_up_window": 256,
        }
    }
    assert moa_hf.vllm.additional_config(catch_up_window=None)["moa_hf"]["catch_up_window"] is None
    with pytest.raises(ValueError, match="catch_up_window"):
        moa_hf.vllm.additional_config(catch_up_window=0)
    (tmp_path / "my_drafter").mkdir()
    monkeypatch.chdir(tmp_path)
    entry = moa_hf.vllm.additional_config("my_drafter", draft_length=2, lookup=False)[moa_hf.vllm.CONFIG_KEY]
    assert entry["drafter"] == str(tmp_path / "my_drafter") and Path(entry["drafter"]).is_absolute()
    assert entry["draft_length"] == 2 and entry["lookup"] is False
    assert moa_hf.vllm.additional_config(tmp_path / "my_drafter")["moa_hf"]["drafter"] == str(tmp_path / "my_drafter")
    assert moa_hf.vllm.additional_config("org/not-a-folder")["moa_hf"]["drafter"] == "org/not-a-folder"  # a Hub id
    # one dataclass: what `additional_config` writes is what the proposer reads back, unknown options refused
    config = type("VllmConfig", (), {"additional_config": moa_hf.vllm.additional_config("org/x", catch_up_window=8)})
    assert moa_hf.vllm.MoAVllmOptions.from_vllm(config) == moa_hf.vllm.MoAVllmOptions("org/x", catch_up_window=8)
    with pytest.raises(ValueError, match=r"Unknown moa_hf option\(s\) \['draft_lenght'\]"):
        moa_hf.vllm.additional_config(draft_lenght=2)


def test_engine_and_serve_args(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    args = moa_hf.vllm.engine_args(folder, 4, draft_length=1, allow_other_target=True)
    assert set(args) == {"speculative_config", "additional_config"}
    assert args["speculative_config"] == moa_hf.vllm.speculative_config(4)
    assert args["additional_config"] == moa_hf.vllm.additional_config(folder, draft_length=1, allow_other_target=True)
    assert args["additional_config"]["moa_hf"]["allow_other_target"] is True
    with pytest.raises(ValueError):
        moa_hf.vllm.engine_args("default", 0)

    flags = moa_hf.vllm.serve_args(folder, 4, draft_length=1, allow_other_target=True)
    assert len(flags) == 4 and all(isinstance(f, str) for f in flags)
    assert flags[0] == "--speculative-config" and flags[2] == "--additional-config"
    assert not any(c.isspace() for f in flags for c in f)  # `$(python -m moa_hf.vllm ...)` splits on spaces
    assert json.loads(flags[1]) == args["speculative_config"]
    assert json.loads(flags[3]) == args["additional_config"]
    with pytest.raises(ValueError):
        moa_hf.vllm.serve_args("default", 0)


def test_module_prints_serve_flags():
    out = subprocess.run(
        [sys.executable, "-m", "moa_hf.vllm", "default", "3"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # `vllm serve TARGET $(python -m moa_hf.vllm default 3)`: the shell splits the output on whitespace, no quotes
    assert out.stdout.split() == moa_hf.vllm.serve_args("default", 3)


def test_module_usage(capsys):
    from moa_hf.vllm.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2 and "usage" in capsys.readouterr().out
    main(["default", "5"])
    assert capsys.readouterr().out.split() == moa_hf.vllm.serve_args("default", 5)


# ---------------------------------------------------------------------------------------------------------------------
# Drafter tree states re-laid for continuous batching (MoA drafter, float32)
# ---------------------------------------------------------------------------------------------------------------------
TREE = [[-1, -1], [0, 0, 1]]  # parents per depth: root -> a, b; a -> c, d; b -> e
V = 128


SORTED = {"num_blocks": 3, "exit_thresholds": [0.08, 0.08]}  # tokens leave at each of the 3 exits


@pytest.fixture(scope="module", params=["plain", "tli", "sorted"])
def moa(request):
    """A tiny Llama target and an attached random MoA drafter whose weights are large enough that any masked-out
    slot (padding, another row's) would change the logits: the plain MoA drafter (one block), one with Target Layer
    Inference (its TLI memory is re-laid with the slots), a sorted one drafting at adaptive exits (its deeper blocks
    settle first: `tree_settle`)."""
    target = make_target("llama")
    options = {"plain": {"num_blocks": 1}, "tli": {"num_blocks": 1, "target_layer_inference": 1}, "sorted": SORTED}
    drafter = sorted_drafter(target, seed=0, scale=0.2, **options[request.param])
    with drafter.attached(target):
        yield target, drafter


def _seqs(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, V) for _ in range(n)] for n in lengths]


def _target_cache(target, seqs):
    """The target run over the left-padded `seqs` into a DynamicCache; row b's position p is at slot offsets[b] + p."""
    T = max(map(len, seqs))
    offsets = [T - len(s) for s in seqs]
    ids = torch.tensor([[0] * o + s for o, s in zip(offsets, seqs)])
    mask = (torch.arange(T)[None] >= torch.tensor(offsets)[:, None]).long()
    cache = DynamicCache()
    with torch.no_grad():
        target(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), **{CACHE_NAME: cache})
    return cache, offsets


def _feed(drafter, state, read, seqs, spans, slot_of, g, pad=0, hidden_of=None):
    """`tree_catch_up` with tokens seqs[b][a:e] for spans[b] = (a, e), right-aligned and left-padded (`pad` extra
    columns; garbage tokens/positions in the padding, prev_slots -1); slot_of(b, positions) gives the slots of the
    target's state at those positions, hidden_of(prev_slots) its final hidden states there (for drafters that read
    them)."""
    B = len(seqs)
    n = max(e - a for a, e in spans) + pad
    tokens = torch.randint(3, V, (B, n), generator=g)
    positions = torch.randint(0, 50, (B, n), generator=g)
    valid = torch.zeros(B, n, dtype=torch.bool)
    prev_slots = torch.full((B, n), -1)
    for b, (seq, (a, e)) in enumerate(zip(seqs, spans)):
        m, pos = e - a, torch.arange(a, e)
        tokens[b, n - m :], positions[b, n - m :], valid[b, n - m :] = torch.tensor(seq[a:e]), pos, True
        prev_slots[b, n - m :] = torch.where(pos > 0, slot_of(b, (pos - 1).clamp(min=0)), -1)
    hidden = None if hidden_of is None else hidden_of(prev_slots)  # [B, n, D] the target's final hidden states
    return drafter.tree_catch_up(state, tokens, positions, valid, prev_slots, read, hidden)


def _tree(drafter, state, root_pos, node_tokens):
    """TREE fed depth by depth with tokens node_tokens[depth] [B, k] after roots at root_pos [B]: logits [B, K, V]."""
    out = []
    for depth, (parents, tokens) in enumerate(zip(TREE, node_tokens), start=1):
        B = tokens.shape[0]
        positions = (root_pos[:, None] + depth).expand_as(tokens)
        out.append(drafter.tree_step(state, tokens, positions, torch.tensor(parents).expand(B, -1)))
    return torch.cat(out, dim=1)


def _node_tokens(B, g):
    return [torch.randint(3, V, (B, len(parents)), generator=g) for parents in TREE]


def test_concat_rows_equals_each_row_alone(moa):
    """A row with a previous cycle behind it (kept) and a new row (fresh), caught up in two 1-row states of different
    widths, joined: the tree nodes' logits of each row equal those of its state alone."""
    target, drafter = moa
    g = torch.Generator().manual_seed(0)
    seqs = _seqs((7, 11), seed=0)
    caches = [_target_cache(target, [s])[0] for s in seqs]
    at = lambda b, pos: pos  # noqa: E731 (one row per cache: slot = position)

    kept = drafter.tree_start(1)
    _feed(drafter, kept, caches[0], seqs[:1], [(0, 4)], at, g, pad=2)
    _tree(drafter, kept, torch.tensor([3]), _node_tokens(1, g))  # the previous cycle's tree
    _feed(drafter, kept, caches[0], seqs[:1], [(4, 7)], at, g)
    fresh = drafter.tree_start(1)
    _feed(drafter, fresh, caches[1], seqs[1:], [(0, 11)], at, g)
    assert kept.num_verified == 9 and fresh.num_verified == 11
    assert kept.node_exits.shape[1] > 0  # the previous tree step's exits: concat_rows must drop them

    nodes = _node_tokens(2, g)
    root_pos = torch.tensor([6, 10])
    alone = [
        _tree(drafter, copy.deepcopy(s), root_pos[b : b + 1], [t[b : b + 1] for t in nodes])
        for b, s in enumerate((kept, fresh))
    ]
    kept_valid = kept.valid[0].tolist()
    joined = drafter.tree_concat_rows([kept, fresh])
    assert isinstance(joined, MoATreeState) and joined.num_verified == 11
    assert joined.valid[0].tolist() == [False, False] + kept_valid  # padded on the left
    assert joined.valid[1].all() and joined.ca_keys.shape[:3] == (2, drafter.config.num_key_value_heads, 11)
    logits = _tree(drafter, joined, root_pos, nodes)
    assert logits.shape == (2, 5, V)
    for b in range(2):
        assert_close(logits[b], alone[b][0], msg=f"row {b}")
    # the same rows in the other order
    other = drafter.tree_concat_rows([copy.deepcopy(fresh), copy.deepcopy(kept)])
    swapped = _tree(drafter, other, root_pos.flip(0), [t.flip(0) for t in nodes])
    assert_close(swapped.flip(0), logits)


def test_pad_left_keeps_the_logits(moa):
    target, drafter = moa
    g = torch.Generator().manual_seed(1)
    seqs = _seqs((6,), seed=1)
    cache, _ = _target_cache(target, seqs)
    state = drafter.tree_start(1)
    _feed(drafter, state, cache, seqs, [(0, 6)], lambda b, pos: pos, g)
    nodes = _node_tokens(1, g)
    want = _tree(drafter, copy.deepcopy(state), torch.tensor([5]), nodes)
    drafter.tree_settle(state)  # a sorted drafter's deeper blocks run the slots they skipped
    state.pad_left(3)  # already wider: nothing
    assert state.num_verified == 6 and state.valid.all()
    state.pad_left(10)
    assert state.num_verified == 10 and state.ca_valid.shape == (1, 10) and state.layers[0].keys.shape[2] == 10
    assert state.valid[0].tolist() == [False] * 4 + [True] * 6 and not state.ca_valid[0, :4].any()
    assert_close(_tree(drafter, state, torch.tensor([5]), nodes), want)
    with pytest.raises(RuntimeError, match="end_tree"):
        state.pad_left(12)  # tree nodes in the state: slots cannot be re-laid


def test_compact_keeps_the_logits(moa):
    """Catch-ups of rows with different numbers of new tokens, left-padded: compact() drops the slots no row needs
    and keeps every row's valid ones in order, so the next tree's logits, and later cycles, are unchanged."""
    target, drafter = moa
    g = torch.Generator().manual_seed(2)
    seqs = _seqs((11, 13), seed=2)
    cache, offsets = _target_cache(target, seqs)
    at = lambda b, pos: offsets[b] + pos  # noqa: E731
    state = drafter.tree_start(2)
    _feed(drafter, state, cache, seqs, [(0, 3), (0, 8)], at, g, pad=2)
    _tree(drafter, state, torch.tensor([2, 7]), _node_tokens(2, g))
    _feed(drafter, state, cache, seqs, [(3, 9), (8, 10)], at, g, pad=2)
    assert state.num_verified == 10 + 8
    counts = state.valid.sum(1).tolist()
    assert counts == [9, 10]

    reference = copy.deepcopy(state)
    nodes = _node_tokens(2, g)
    root_pos = torch.tensor([8, 9])
    want = _tree(drafter, reference, root_pos, nodes)
    drafter.tree_compact(state)
    assert state.num_verified == 10
    assert state.valid.tolist() == [[False] + [True] * 9, [True] * 10]
    assert state.ca_valid.shape == (2, 10) and state.ca_keys.shape[2] == 10 and state.layers[0].keys.shape[2] == 10
    # CA memory moved along: position 0 has no context (row 0: slot 1 after its padding slot 0; row 1: slot 0)
    assert state.ca_valid.tolist() == [[False, False] + [True] * 8, [False] + [True] * 9]
    got = _tree(drafter, state, root_pos, nodes)
    assert_close(got, want)

    # the next cycle on the compacted state and on the uncompacted one
    spans = [(9, 11), (10, 13)]
    want = _feed(drafter, reference, cache, seqs, spans, at, torch.Generator().manual_seed(3))
    got = _feed(drafter, state, cache, seqs, spans, at, torch.Generator().manual_seed(3))
    assert_close(got, want)
    nodes = _node_tokens(2, g)
    torch.testing.assert_close(
        _tree(drafter, state, torch.tensor([10, 12]), nodes),
        _tree(drafter, reference, torch.tensor([10, 12]), nodes),
        atol=1e-5,
        rtol=1e-5,
    )
    assert state.num_verified < reference.num_verified


def test_sorted_states_settle_before_their_slots_are_re_laid():
    """A sorted drafter's deeper blocks skip the slots that left at an earlier exit (they run them when a later slot
    goes deeper); re-laying slots needs every block to hold every slot: refused before `tree_settle`, not after."""
    target = make_target("llama")
    drafter = sorted_drafter(target, seed=0, scale=0.2, **SORTED)
    seqs = _seqs((9,), seed=8)
    cache, _ = _target_cache(target, seqs)
    with drafter.attached(target):
        state = drafter.tree_start(1)
        _feed(drafter, state, cache, seqs, [(0, 9)], lambda b, pos: pos, torch.Generator().manual_seed(8))
        exits = _tree(drafter, copy.deepcopy(state), torch.tensor([8]), _node_tokens(1, torch.Generator()))
        assert any(block.pending for block in state.deep)
        with pytest.raises(ValueError, match="tree_settle"):
            state.compact()
        with pytest.raises(ValueError, match="tree_concat_rows"):
            MoATreeState.concat_rows([copy.deepcopy(state), copy.deepcopy(state)])
        drafter.tree_settle(state)
        assert not any(block.pending for block in state.deep)
        assert [block.length for block in state.deep] == [9, 9] == [state.num_verified] * 2
        state.compact()
        assert_close(_tree(drafter, state, torch.tensor([8]), _node_tokens(1, torch.Generator())), exits)


def test_catch_up_with_a_reader_function(moa):
    """`tree_catch_up` reads the target's keys/values through a function (slots -> [B, m, L, W]) as through the
    transformers cache: a lambda over `gather_target_kv_at`, and a PagedKVReader over a paged copy of the cache
    (slots through a block table), give identical logits; a reader of other slots gives other logits."""
    target, drafter = moa
    seqs = _seqs((9, 5), seed=4)
    cache, offsets = _target_cache(target, seqs)
    at = lambda b, pos: offsets[b] + pos  # noqa: E731

    # the same keys/values paged (head_major) at a random block table; slot of row b position p via slots_of
    bs, g = 4, torch.Generator().manual_seed(5)
    layers_kv = [(layer.keys, layer.values) for layer in cache.layers]
    paged, table = _paged_copy(layers_kv, "head_major", bs, nb=12, g=g)
    reader = PagedKVReader(paged, LAYOUTS["head_major"], dtype=torch.float32)
    paged_at = lambda b, pos: slots_of(table[b : b + 1], (offsets[b] + pos)[None], bs)[0]  # noqa: E731

    calls = []

    def spy(slots):
        calls.append(slots.shape)
        return gather_target_kv_at(cache, slots)

    runs = {}
    for name, read, slot_of in [
        ("cache", cache, at),
        ("lambda", lambda slots: gather_target_kv_at(cache, slots), at),
        ("spy", spy, at),
        ("paged", reader, paged_at),
        ("shifted", lambda slots: gather_target_kv_at(cache, (slots + 1).clamp(max=8)), at),
    ]:
        state = drafter.tree_start(2)
        g = torch.Generator().manual_seed(6)
        first = _feed(drafter, state, read, seqs, [(0, 6), (0, 2)], slot_of, g, pad=1)
        second = _feed(drafter, state, read, seqs, [(6, 9), (2, 5)], slot_of, g)
        tree = _tree(drafter, state, torch.tensor([8, 4]), _node_tokens(2, torch.Generator().manual_seed(7)))
        runs[name] = (first, second, tree, state.ca_keys.transpose(1, 2)[state.ca_valid])  # CA keys of valid slots
    assert calls and all(shape[0] == 2 for shape in calls)
    for name in ("lambda", "spy", "paged"):
        for got, want in zip(runs[name], runs["cache"]):
            assert_close(got, want, msg=name)
    assert not torch.allclose(runs["shifted"][1], runs["cache"][1], atol=1e-3)


def test_step_tap_records_final_hidden_states_by_slot():
    """The tap stores each step's final hidden states at the step's slots (padding after the step's tokens and slots
    -1 ignored), keeps what earlier steps wrote when it grows, lets a later step rewrite a slot (a rejected draft),
    and reads zeros where no state is (-1)."""
    from types import SimpleNamespace

    from moa_hf.vllm.target import StepTap

    g = torch.Generator().manual_seed(0)
    tap = StepTap(record_hidden=True)
    with pytest.raises(RuntimeError, match="No final hidden state"):
        tap.hidden_at(torch.tensor([[0]]))
    first = torch.randn(5, 8, generator=g)  # 4 tokens + 1 padding row
    tap.record(SimpleNamespace(num_actual_tokens=4, slot_mapping=torch.tensor([3, 1, -1, 2, 0])), first)
    second = torch.randn(2, 8, generator=g)
    tap.record(SimpleNamespace(num_actual_tokens=2, slot_mapping=torch.tensor([40, 1])), second)  # grows; rewrites 1
    got = tap.hidden_at(torch.tensor([[3, 2, 1], [40, -1, 7]]))  # [2, 3, 8]
    assert_close(got[0], torch.stack([first[0], first[3], second[1]]))
    assert_close(got[1, 0], second[0])
    assert torch.equal(got[1, 1:], torch.zeros(2, 8))  # -1, and a slot never written
    assert tap.hidden_at(torch.tensor([[1]]), torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="context_final_hidden=False"):
        tap.record(SimpleNamespace(num_actual_tokens=1, slot_mapping=torch.tensor([0])), (first,))


def test_catch_up_with_hidden_states_recorded_by_slot():
    """A drafter reading the target's final hidden states (and the newest context) fed through the vLLM route: keys/
    values from a paged copy of the cache and hidden states recorded by the tap at the same slots give the logits of
    the transformers route (the cache and `hidden_states[-1]` at the same positions); the tap's states of other slots
    give other logits."""
    from types import SimpleNamespace

    from moa_hf.vllm.target import StepTap

    target = make_target("llama")
    drafter = sorted_drafter(target, num_blocks=1, seed=1, context_final_hidden=True, ca_latest_context=True)
    seqs = _seqs((9, 5), seed=4)
    cache, offsets = _target_cache(target, seqs)
    T = max(map(len, seqs))
    ids = torch.tensor([[0] * o + s for o, s in zip(offsets, seqs)])
    mask = (torch.arange(T)[None] >= torch.tensor(offsets)[:, None]).long()
    with torch.no_grad():
        out = target(
            ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), output_hidden_states=True
        )
    final = out.hidden_states[-1]  # [B, T, D]
    bs, g = 4, torch.Generator().manual_seed(5)
    paged, table = _paged_copy([(layer.keys, layer.values) for layer in cache.layers], "head_major", bs, nb=12, g=g)
    reader = PagedKVReader(paged, LAYOUTS["head_major"], dtype=torch.float32)
    tap = StepTap(record_hidden=True)
    for b in range(len(seqs)):  # one "step" per row: its states written at the slots of its keys/values
        slots = slots_of(table[b : b + 1], torch.arange(T)[None], bs)[0]
        tap.record(SimpleNamespace(num_actual_tokens=T, slot_mapping=slots), final[b])

    def feed(read, hidden_of, slot_of, spans, pad=0, seed=6):
        state, g = drafter.tree_start(2), torch.Generator().manual_seed(seed)
        logits = _feed(drafter, state, read, seqs, spans, slot_of, g, pad=pad, hidden_of=hidden_of)
        last = torch.tensor([[seqs[b][e - 1]] for b, (_, e) in enumerate(spans)])  # [B, 1] each row's last token
        positions = torch.tensor([[e] for _, e in spans])  # [B, 1] the position after it
        return logits, drafter.tree_step(state, last, positions, torch.tensor([[-1], [-1]]))

    def cache_hidden(prev):  # [B, n] slots of the left-padded transformers cache -> [B, n, D]
        return final.gather(1, prev.clamp(min=0)[..., None].expand(-1, -1, final.shape[-1]))

    at = lambda b, pos: offsets[b] + pos  # noqa: E731
    paged_at = lambda b, pos: slots_of(table[b : b + 1], (offsets[b] + pos)[None], bs)[0]  # noqa: E731
    spans = [(0, 9), (0, 5)]
    with drafter.attached(target):
        want = feed(cache, cache_hidden, at, spans)
        got = feed(reader, tap.hidden_at, paged_at, spans, pad=2)
        shifted = feed(reader, lambda prev: tap.hidden_at(torch.where(prev >= 0, prev + 1, prev)), paged_at, spans)
    for w, o in zip(want, got):
        assert_close(o, w)
    assert not torch.allclose(shifted[0], want[0], atol=1e-3)


def test_no_drafting_tried_where_free_drafting_gains_less_than_the_margin():
    p = VllmDraftPolicy(max_tokens=1, explore_every=4)
    for _ in range(50):
        p.record_acceptance(1, 1)  # position 1 almost always accepted: E(1) ~ 1.98
    # verifying 2 tokens per row costs 1.85x one: free drafting would give 1.98 / 1.85 = 1.07x < the 1.1 margin
    p.record_step(4, 0, 4, 0.020, 0.0)
    p.record_step(4, 0, 8, 0.037, 0.0)
    assert p.throughput(4, 1, optimistic=True) > p.throughput(4, 0)
    assert [p.choose(4) for _ in range(20)] == [0] * 20
    p.explore_margin = 1.0
    assert p.choose(4) == 1  # without the margin it would try


# -- matching vLLM's rows to the drafter's state rows -----------------------------------------------------------------
def test_match_rows_follows_rows_that_move_join_and_leave():
    from moa_hf.vllm.proposer import match_rows

    a, b, c = np.arange(10), np.arange(100, 110), np.arange(200, 205)
    fed = [a[:8], b[:9], c[:4]]
    # vLLM's rows: b moved to the front, a kept going, c left, a new request d joined
    d = np.arange(300, 320)
    assert match_rows(fed, [b, a, d]) == [1, 0, None]
    assert match_rows(fed, [a[:8]]) == [None]  # nothing new since the state's last token: start afresh
    assert match_rows(fed, [np.r_[a[:7], 99, 98]]) == [None]  # a rewritten history (recomputed otherwise)


def test_match_rows_two_rows_with_one_history_get_one_state_each():
    from moa_hf.vllm.proposer import match_rows

    a = np.arange(12)
    assert match_rows([a[:8]], [a, a]) == [0, None]
    assert match_rows([a[:8], a[:8]], [a, a]) == [0, 1]


def test_match_rows_window_starts_rows_too_far_behind_afresh():
    from moa_hf.vllm.proposer import match_rows

    a, b = np.arange(400), np.arange(1000, 1400)
    fed = [a[:100], b[:390]]
    assert match_rows(fed, [a, b], window=None) == [0, 1]
    assert match_rows(fed, [a, b], window=256) == [None, 1]  # 300 tokens behind: read anew from the last 256
    assert match_rows(fed, [a, b], window=10) == [None, 1]
    assert match_rows(fed, [a, b], window=9) == [None, None]


def _sources(policy, steps, network_s, accept_network):
    """The plans of `policy` with prompt lookup on, at batch 1, when half the rows have a lookup proposal (accepted
    as 0.7**i) and the network costs `network_s` per step of 3 tokens (accepted as accept_network**i)."""
    world = World(verify=_engine_cost(0.0005), draft_s=network_s / 3, accept=accept_network, lookup_share=0.5)
    return drive_vllm(policy, world, steps)


def test_policy_drafts_by_lookup_only_where_the_network_does_not_pay():
    p = VllmDraftPolicy(max_tokens=3, lookup=True, explore_every=10**6)
    # a weak network (accepted 15%) that costs half a target step: lookup alone is faster
    chosen = _sources(p, 60, 0.006, 0.15)
    assert chosen[: 3 * p.samples] == [(3, True)] * p.samples + [(3, False)] * p.samples + [(0, True)] * p.samples
    assert chosen[-20:] == [(3, False)] * 20
    assert p.lookup_share() == pytest.approx(0.5, abs=0.1)
    assert p.lookup_rates.rates(3)[0] == pytest.approx(0.7, abs=0.15)  # proposals of 3 tokens
    assert p.network_rates.rates(1)[0] < 0.5  # few network drafts: the prior still weighs
    assert "batch<=1,k=3,lookup only" in p.as_dict()["draft_s"]


def test_policy_runs_the_network_where_it_pays():
    p = VllmDraftPolicy(max_tokens=3, lookup=True, explore_every=10**6)
    chosen = _sources(p, 60, 0.001, 0.8)  # a strong, cheap network
    assert chosen[-20:] == [(3, True)] * 20


def test_policy_without_lookup_never_plans_lookup_only():
    p = VllmDraftPolicy(max_tokens=3, explore_every=10**6)
    assert p.lookup_share() == 0.0
    chosen = _lengths(p, 1, _engine_cost(0.0005), 20)
    assert all(p.plan(1)[1] for _ in range(10)) and chosen[-5:] == [3] * 5


def test_only_kinds_registered_for_vllm_draft_there():
    from moa_hf.drafter_types import drafter_type
    from moa_hf.vllm.proposer import unsupported_drafter_reason

    target = make_target()
    moa = sorted_drafter(target, num_blocks=1)
    assert drafter_type(moa).vllm_support and unsupported_drafter_reason(moa) is None
    reason = unsupported_drafter_reason(make_independent())
    assert "'independent'" in reason and "moa" in reason and "transformers" in reason
    tli = sorted_drafter(target, num_blocks=1, target_layer_inference=1)
    assert unsupported_drafter_reason(tli) is None  # it runs the target's last layer on a copy of its weights
    hidden = sorted_drafter(target, num_blocks=1, context_final_hidden=True, ca_latest_context=True)
    assert unsupported_drafter_reason(hidden) is None  # its final hidden states come from the step tap


# -- a row's one-off catch-up against the tokens it has left ---------------------------------------------------------
def test_catch_up_price_spreads_over_the_steps_left():
    price = CatchUpPrice()
    assert price.per_step(100, remaining=50, gained=2) == 0.0  # nothing measured yet
    price.record(100, 0.1)
    assert price.per_step(100, remaining=50, gained=2) == pytest.approx(0.1 / 25)  # spread over 25 steps
    assert price.per_step(100, remaining=1, gained=2) == pytest.approx(0.1)  # at least one step pays it all


def test_output_lengths_remaining():
    lengths = OutputLengths(prior=50.0)
    assert lengths.remaining(10) == 50.0  # nothing finished yet: the prior
    for n in (20, 40, 96, 96):
        lengths.record(n)
    assert lengths.remaining(30) == pytest.approx((10 + 66 + 66) / 3)
    assert lengths.remaining(0) == pytest.approx((20 + 40 + 96 + 96) / 4)
    assert lengths.remaining(200) == 50.0  # past every length seen


def test_row_lives_follow_rows_that_move_join_and_leave():
    from moa_hf.vllm.rows import RowLives

    lengths = OutputLengths()
    lives = RowLives(lengths, signature=4)
    a, b, c = np.arange(100), np.arange(1000, 1100), np.arange(2000, 2100)
    assert lives.update([a[:10], b[:20]]) == [1, 1]  # first seen: one token sampled after the prompt
    assert lives.update([b[:23], a[:12]]) == [4, 3]  # moved, and grew
    assert lives.update([a[:15], c[:7]]) == [6, 1]  # b left (finished), c joined
    assert list(lengths.finished) == [4]
    assert lives.update([c[:9]]) == [3]
    assert list(lengths.finished) == [4, 6]


def test_network_needing_a_long_catch_up_stays_off_when_few_tokens_are_left():
    p = VllmDraftPolicy(max_tokens=3, lookup=True, explore_every=10**6)
    _sources(p, 60, 0.001, 0.8)  # a strong, cheap network
    assert p.plan(1) == (3, True)
    p.catch_up.record(256, 0.256)  # 1 ms per token caught up
    assert p.catch_up.seconds(10) == pytest.approx(0.010)
    assert p.plan(1, catch_up=256, remaining=4)[1] is False  # 0.26 s for a row with ~2 steps left: lookup only
    assert p.plan(1, catch_up=256, remaining=10_000) == (3, True)  # spread over thousands of tokens it pays
    assert p.plan(1, catch_up=0, remaining=4) == (3, True)  # rows already followed: nothing to catch up


def test_network_not_explored_where_its_catch_up_could_not_pay():
    p = VllmDraftPolicy(max_tokens=3, lookup=True, explore_every=10**6)
    for _ in range(4):
        p.record_step(2, 0, 2, 0.020, 0.0)
        p.record_step(2, 0, 8, 0.022, 0.0)  # verifying 4 tokens per row costs about what 1 does
    p.catch_up.record(100, 1.0)  # 10 ms per token
    assert p.plan(2, catch_up=512, remaining=8) == (3, False)  # lookup only is measured, not the network
    assert p.plan(2, catch_up=0) == (3, True)  # with nothing to catch up the network is measured first
