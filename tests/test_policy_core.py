"""The speculation policy's core (modeling/custom_generate/policy_core.py) and its three adapters: the engine's
`ShapePolicy`, vLLM's `VllmDraftPolicy` and the serving client's `ClientDraftPolicy`, all driven by one simulator
(tests/policy_sim.py). Each route's own behaviour is tested beside it (test_engine.py, test_vllm_parts.py,
test_serving.py)."""

import math

import pytest

from moa_hf.modeling.custom_generate.policy import Costs, ShapePolicy, TreeSettings
from moa_hf.modeling.custom_generate.policy_core import Backoff, CatchUpPrice, PositionRates, interpolate
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


def test_cost_parts():
    """The cost table's interpolation, the probes' back-off and catch-up pricing."""
    points = [(1, 1.0), (4, 2.0)]
    assert [interpolate(points, n) for n in (0, 1, 2.5, 7)] == [1.0, 1.0, 1.5, 3.0]
    assert interpolate(points, 8, beyond="proportional") == 4.0
    backoff = Backoff(most=4)
    assert [backoff.interval("a", 8) for _ in range(4) if backoff.lost("a") is None] == [16, 32, 32, 32]
    backoff.won("a")
    assert backoff.interval("a", 8) == 8 and Backoff().factor("b") == 1
    price = CatchUpPrice()
    assert price.per_step(100, remaining=50, gained=2) == 0.0  # nothing measured yet
    price.record(100, 0.1)
    assert price.per_step(100, remaining=50, gained=2) == pytest.approx(0.1 / 25)  # spread over 25 steps
    assert price.per_step(100, remaining=1, gained=2) == pytest.approx(0.1)  # at least one step pays it all
