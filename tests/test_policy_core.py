"""The speculation policy's core (modeling/custom_generate/policy_core.py: the decision, `best` and `ProbeSchedule`,
and its parts) and its three adapters: the engine's `ShapePolicy` (with tree.py's `cut_to_budget`), vLLM's
`VllmDraftPolicy` and the serving client's `ClientDraftPolicy`, all driven by one simulator (tests/policy_sim.py).
Each route's own behaviour is tested beside it (test_engine.py, test_vllm_parts.py, test_serving.py)."""

import math

import pytest
import torch

from moa_hf.modeling.custom_generate.policy import Costs, ShapePolicy, TreeSettings
from moa_hf.modeling.custom_generate.policy_core import (
    PositionRates,
    ProbeSchedule,
    VerifyFit,
    best,
    interpolate,
    unmeasured,
)
from moa_hf.modeling.custom_generate.tree import Tree, cut_to_budget
from moa_hf.serving.draft_policy import ClientDraftPolicy
from moa_hf.vllm.policy import VllmDraftPolicy

from policy_sim import World, drive_client, drive_engine, drive_vllm

FLAT_COSTS = Costs(verify={1: 1.0, 64: 1.0}, step={1: 0.01, 8: 0.01})

# memory-bound verification (a token more costs 5% of a step) and a good drafter: drafting pays; compute-bound (a
# step costs as much per token as a decode step) and a useless drafter: it does not
PAYS = {"verify": lambda n: 0.010 + 0.0005 * n, "accept": 0.9}
LOSES = {"verify": lambda n: 0.010 * n, "accept": 0.05}


@pytest.mark.parametrize("world,drafts", [(PAYS, True), (LOSES, False)], ids=["drafting pays", "drafting loses"])
def test_one_world_one_verdict_on_every_route(world, drafts):
    """The same target and drafter costs and acceptance, priced by each route's adapter over the core: all three
    draft where it pays and decode plainly where it does not (probes aside)."""
    played = drive_engine(ShapePolicy(TreeSettings(), FLAT_COSTS, batch=1, lookup=False), World(**world), 300)
    assert sum(arm != "plain" for arm in played[-100:]) >= 85 if drafts else played[-100:].count("plain") >= 85
    plans = drive_vllm(VllmDraftPolicy(max_tokens=3, explore_every=10**6), World(**world), 100)
    assert all(k > 0 for k, _ in plans[-20:]) if drafts else all(k == 0 for k, _ in plans[-20:])
    chosen = drive_client(ClientDraftPolicy(max_length=8), World(**world), 100)
    assert all(k > 0 for k in chosen[-20:]) if drafts else sum(k > 0 for k in chosen[-20:]) <= 1


def test_position_rates_decay_pool_and_carry():
    """Classes of proposal length keep their rates apart; positions past the table share its last entry (the
    client's one pooled rate); `decay` forgets older proposals; `load` weighs an earlier state as at most `max_tries`
    tries."""
    lookup = PositionRates(4, classes=3)
    for _ in range(50):
        lookup.record(4, 4)  # long proposals right, 1-token ones wrong
        lookup.record(1, 0)
    assert [lookup.length_class(n) for n in (1, 2, 3, 4, 16)] == [0, 1, 1, 2, 2]
    assert lookup.rates(1, length=4)[0] > 0.9 > 0.1 > lookup.rates(1, length=1)[0]
    assert lookup.rates(1, length=2) == [0.5]  # nothing recorded for 2-3 tokens: the prior
    pooled = PositionRates(1, decay=0.5)
    pooled.record(4, 2)  # the prior (1 in 2) halved, then 3 reached (2 right, the third wrong) at the one position
    assert pooled.tried == [[4.0]] and pooled.right == [[2.5]]
    pooled.record(1, 0)
    assert pooled.tried == [[3.0]] and pooled.right == [[1.25]]
    assert pooled.expected_tokens(3) == pytest.approx(1 + sum((1.25 / 3) ** i for i in (1, 2, 3)))
    carried = PositionRates(2)
    carried.load([([90.0, 9.0], [100.0, 10.0])], max_tries=20)
    assert carried.tried == [[20.0, 10.0]] and carried.rates(2) == pytest.approx([0.9, 0.9])
    assert carried.log_probs(2) == pytest.approx([math.log(0.9), 2 * math.log(0.9)])


def test_cost_table_interpolation():
    points = [(1, 1.0), (4, 2.0)]
    assert [interpolate(points, n) for n in (0, 1, 2.5, 7)] == [1.0, 1.0, 1.5, 3.0]
    assert interpolate(points, 8, beyond="proportional") == 4.0


def test_best_is_the_most_tokens_per_second_first_of_equals():
    """`best`: the largest tokens per second (modelled) or the fewest seconds per token (measured), unrated options
    skipped, the first of equals, `default` where none is rated."""
    rates = {"plain": 10.0, "chain": 12.0, "tree": 12.0, "lookup": None}
    assert best(rates, rates.get) == "chain"  # tied with the tree: the first listed
    assert best(rates, seconds_per_token=lambda o: None if rates[o] is None else 1 / rates[o]) == "chain"
    assert best(["lookup"], rates.get, default="plain") == "plain"
    assert best([], rates.get) is None


def test_probe_schedule():
    """Every option is measured `needed` times first (`unmeasured`); then an option is due `base` x 2^(probes it lost
    in a row) steps (at most `most` x) after it last played; of the due ones the one played longest ago; a won probe
    resets the interval."""
    measured = {"tree": 2, "chain": 1, "plain": 0}
    assert unmeasured(measured, measured.get, 2) == "chain" and unmeasured(measured, measured.get, 0) is None
    probes = ProbeSchedule(most=4)
    assert [probes.interval("a", 8) for _ in range(4) if probes.lost("a") is None] == [16, 32, 32, 32]
    probes.won("a")
    assert probes.interval("a", 8) == 8 and ProbeSchedule().factor("b") == 1
    probes.played("a", 10)
    assert not probes.due("a", 17, 8) and probes.due("a", 18, 8) and probes.due("b", 8, 8)  # b: never played
    assert probes.probe({"a": 8, "b": 8}, 18) == "b" and probes.probe({"a": 8, "b": 100}, 18) == "a"
    assert probes.probe({"a": 8}, 17) is None
    probes.lost("a")
    assert not probes.due("a", 18, 8) and probes.due("a", 26, 8)


# a drafter's right rates by position, a target's seconds verifying n tokens per row, and the draft length they make
# best: well apart from the runner-up (the engine's cut prices in float32)
GOOD, FADING, FIRST_ONLY, USELESS = [0.9] * 6, [0.85, 0.8, 0.7, 0.3, 0.2, 0.1], [0.95] + [0.1] * 5, [0.05] * 6


def memory_bound(n: int) -> float:
    return 0.010 + 0.0005 * n


def between(n: int) -> float:
    return 0.010 + 0.004 * n


def compute_bound(n: int) -> float:
    return 0.010 * n


SAME_PRICES = {
    "max": (GOOD, memory_bound, 6),
    "fading": (FADING, between, 3),
    "first": (FIRST_ONLY, between, 1),
    "useless": (USELESS, between, 0),
    "compute-bound": (GOOD, compute_bound, 0),
}


@pytest.mark.parametrize("right,verify,expected", SAME_PRICES.values(), ids=SAME_PRICES)
def test_every_route_makes_the_same_choice_from_the_same_rates_and_costs(right, verify, expected):
    """One decision: given the same right rates by position and the same verification costs (drafting free), the
    engine's cut of a drafted chain, vLLM's draft length and the client's choose the same k, the core's `best` of
    E(k) / T(k + 1 tokens verified per row)."""
    K = len(right)
    rates = PositionRates(K)
    rates.load([([100.0 * a for a in right], [100.0] * K)], max_tries=1e9)
    core = best(range(K + 1), lambda k: rates.expected_tokens(k) / verify(k + 1))

    engine = ShapePolicy(TreeSettings(), Costs({n: verify(n) for n in range(1, K + 2)}, {1: 0.001}), 1, lookup=False)
    chain = torch.arange(K)[None]  # [1, K]: node i the parent of node i + 1
    scores = torch.tensor(rates.log_probs(K))[None]  # [1, K]: log of each node's path probability
    tree = Tree(chain, chain - 1, chain + 1, scores, chain >= 0, chain < 0)
    cut = cut_to_budget(tree, None, max_budget=K, seconds=engine.cycle_seconds(K, draft_s=0.0)).size

    vllm = VllmDraftPolicy(max_tokens=K, explore_every=10**6)
    vllm.network_rates = rates
    for _ in range(vllm.samples):  # every k measured at batch 1: the engine's and the proposer's (free) seconds
        for k in range(K + 1):
            vllm.record_step(1, k, 1 + k, verify(1 + k), 0.0)

    client = ClientDraftPolicy(max_length=K)
    client.rates, client.server, client.network_s, client.draft_s = rates, VerifyFit(verify), 0.0, 0.0

    assert (core, cut, vllm.plan(1), client.choose(K)) == (expected, expected, (expected, True), expected)
