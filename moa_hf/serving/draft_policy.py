"""`ClientDraftPolicy`: how many tokens `MoAClient` drafts per call, an adapter over the policy core
(modeling/custom_generate/policy_core.py: `best`, `ProbeSchedule`) that prices a round trip.

A call verifying k drafts gains E(k) = 1 + a + ... + a^k tokens (accepted drafts and the target's own; the acceptance
a pooled over positions, since a client's calls are too few to keep one per position: `PositionRates` with one
position, older calls decayed) and costs T(k) = network + server(k + 1 tokens) + k x drafting: the round trip beyond
the server's time and the drafting time per token as moving averages, the server's time as `VerifyFit` of a prior
line to the calls' verifications. The core's `best` takes the k in [min_length, max_length] with the largest
E(k) / T(k). k = 0 is plain decoding (a useless drafter on a fast link); then one call in `probe_every` still drafts
one token to keep measuring the acceptance (`ProbeSchedule`, on the clock of calls: the interval doubles while probes
are rejected, up to `max_probe_every`). `fixed` turns the adaptation off.
"""

from __future__ import annotations

from ..modeling.custom_generate.policy_core import PositionRates, ProbeSchedule, VerifyFit, best

__all__ = ["ClientDraftPolicy"]

SERVER_PRIOR = (0.02, 0.002)  # seconds of a verification call ~ s0 + s1 x tokens in its forward, before measuring
PROBE = "probe"  # the probe schedule's one option: drafting (a token) while plain decoding is the best


class ClientDraftPolicy:
    """Chooses the number of tokens to draft per call by maximising expected tokens per second (see the module)."""

    def __init__(
        self,
        min_length: int = 0,
        max_length: int = 16,
        fixed: int | None = None,
        probe_every: int = 8,
        max_probe_every: int = 64,
    ):
        if fixed is None and not 0 <= min_length <= max_length:
            raise ValueError(f"need 0 <= min_length <= max_length, got {min_length} and {max_length}")
        self.min_length, self.max_length, self.fixed = min_length, max_length, fixed
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probes = ProbeSchedule(most=max_probe_every / probe_every)  # probes of k > 0 while plain decoding plays
        self.calls, self._probing = 0, False  # the probes' clock: choices made
        self.network_s: float | None = None
        self.draft_s = 0.005
        self.rates = PositionRates(1, decay=0.9, bounds=(0.01, 0.99))  # prior: acceptance 0.5
        s0, s1 = SERVER_PRIOR
        self.server = VerifyFit(lambda n: s0 + s1 * n, bounds=((1e-3, 1e3), (1e-3, 1e4)))

    @property
    def acceptance(self) -> float:
        return self.rates.rates(1)[0]

    @property
    def probe_interval(self) -> float:
        """Plain-decoding calls between two probes (doubled per rejected probe, at most `max_probe_every`)."""
        return self.probes.interval(PROBE, self.probe_every)

    def observe_call(
        self, network_s: float, server_s: float | None, forward_tokens: int, drafted: int, accepted: int
    ) -> None:
        """One answered call; `server_s` None for calls whose forward is a prefill (not a drafting cycle)."""
        network_s = max(0.0, network_s)
        self.network_s = network_s if self.network_s is None else 0.7 * self.network_s + 0.3 * network_s
        if server_s is not None:
            self.server.update(forward_tokens, server_s)
        self.rates.record(drafted, accepted)
        if self._probing:
            self._probing = False
            self.probes.won(PROBE) if accepted > 0 else self.probes.lost(PROBE)

    def observe_draft(self, seconds_per_token: float) -> None:
        self.draft_s = 0.8 * self.draft_s + 0.2 * seconds_per_token

    def choose(self, budget: int) -> int:
        """Tokens to draft now, at most `budget`."""
        budget = max(0, budget)
        if self.fixed is not None:
            return min(self.fixed, budget)
        network = 0.02 if self.network_s is None else self.network_s

        def tokens_per_second(k: int) -> float:
            seconds = network + self.server.seconds_of(k + 1) + k * self.draft_s
            return self.rates.expected_tokens(k) / max(seconds, 1e-6)

        k = best(range(min(self.min_length, budget), min(self.max_length, budget) + 1), tokens_per_second, default=0)
        self.calls += 1
        if k == 0 and budget > 0:  # plain decoding: a probe (one token) now and then keeps the acceptance measured
            if not self.probes.due(PROBE, self.calls, self.probe_every):
                return 0
            k, self._probing = 1, True
        self.probes.played(PROBE, self.calls)
        return k
