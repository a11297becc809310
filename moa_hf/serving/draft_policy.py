"""`DraftLengthPolicy`: how many tokens `MoAClient` drafts per call, chosen from measured costs and acceptance."""

from __future__ import annotations

from collections import deque

__all__ = ["DraftLengthPolicy"]


class DraftLengthPolicy:
    """Chooses the number of tokens to draft per call by maximising expected tokens per second.

    With per-token acceptance probability a, drafting k tokens yields E(k) = (1 - a^(k+1)) / (1 - a) tokens per call
    (accepted drafts plus the target's own token) and costs T(k) = network + server(k+1 tokens) + k * drafting; the
    policy takes the k in [min_length, max_length] with the largest E(k) / T(k). All terms are measured: network
    time per call and drafting time per token as moving averages, the server time as a line fitted to recent
    verification calls, the acceptance from recent cycles (decayed counts). k = 0 is plain decoding (a useless
    drafter on a fast link); then one call in `probe_every` still drafts one token to keep measuring the
    acceptance (the interval doubles, up to `max_probe_every`, while probes are rejected). `fixed` turns the
    adaptation off.
    """

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
        self._interval, self._probing = probe_every, False
        self.network_s: float | None = None
        self.draft_s = 0.005
        self.accepted, self.trials = 1.0, 2.0  # prior: acceptance 0.5
        self.server_points: deque[tuple[int, float]] = deque(maxlen=32)
        self._zeros = 0

    @property
    def acceptance(self) -> float:
        return min(0.99, max(0.01, self.accepted / self.trials))

    def server_model(self) -> tuple[float, float]:
        """(s0, s1): seconds per verification call ~ s0 + s1 * tokens in the forward (prior until measured)."""
        if not self.server_points:
            return 0.02, 0.002
        xs, ys = zip(*self.server_points)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        else:  # one forward size seen so far: assume a marginal token costs a tenth of a call
            slope = 0.1 * my / max(mx, 1.0)
        slope = max(0.0, slope)
        return max(0.0, my - slope * mx), slope

    def observe_call(
        self, network_s: float, server_s: float | None, forward_tokens: int, drafted: int, accepted: int
    ) -> None:
        """One answered call; `server_s` None for calls whose forward is a prefill (not a drafting cycle)."""
        network_s = max(0.0, network_s)
        self.network_s = network_s if self.network_s is None else 0.7 * self.network_s + 0.3 * network_s
        if server_s is not None:
            self.server_points.append((forward_tokens, server_s))
        if drafted > 0:
            self.accepted = 0.9 * self.accepted + accepted
            self.trials = 0.9 * self.trials + accepted + (1 if accepted < drafted else 0)
        if self._probing:
            self._probing = False
            self._interval = self.probe_every if accepted > 0 else min(2 * self._interval, self.max_probe_every)

    def observe_draft(self, seconds_per_token: float) -> None:
        self.draft_s = 0.8 * self.draft_s + 0.2 * seconds_per_token

    def choose(self, budget: int) -> int:
        """Tokens to draft now, at most `budget`."""
        budget = max(0, budget)
        if self.fixed is not None:
            return min(self.fixed, budget)
        a = self.acceptance
        s0, s1 = self.server_model()
        network = 0.02 if self.network_s is None else self.network_s
        best, best_rate = 0, -1.0
        for k in range(min(self.min_length, budget), min(self.max_length, budget) + 1):
            expected = (1.0 - a ** (k + 1)) / (1.0 - a)
            seconds = network + s0 + s1 * (k + 1) + k * self.draft_s
            rate = expected / max(seconds, 1e-6)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and budget > 0:
            self._zeros += 1
            if self._zeros >= self._interval:  # probe: keep the acceptance estimate alive
                self._zeros, self._probing = 0, True
                return 1
        else:
            self._zeros = 0
        return best
