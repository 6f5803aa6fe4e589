"""What one group delivers within its SLO, learned online from the deployment's own figures.

Prefill: the tokens per second one *busy* group computes, by prompt-length bucket (log2 of the
mean new prompt tokens per request), as an exponentially weighted mean of the ticks' ratios of
new prompt tokens per second to busy groups. The p90 time to first token a size would give is
predicted from an M/M/n queue of requests (service time: a mean prompt over one group's rate;
the wait's p90 from Sakasegawa's probability of waiting and the exponential wait that follows)
times a correction ``k``: the weighted mean ratio of observed to predicted p90 TTFT, clamped to
``[0.5, 8]`` so one odd window cannot swing it far. (A mean predicted against an observed p90
read every bursty window as a slow group: ``k`` at its bound.)

Decode: the inter-token latency as a least-squares fit ``a + b n + c n ctx`` over the ticks'
(sequences per group ``n``, mean context ``ctx``, ITL) samples; a group holds the most sequences
whose predicted ITL keeps the SLO, and no more than its KV holds: the sequences a full group
holds at the running mix, learned as the weighted mean of sequences per group over the KV usage
ratio (windows at least ``min_usage`` full), filled to the usage target; or, where the KV tokens
per group are known, those tokens over the context.

No profiling run: until a pool has been measured, its capacity is unknown (``None``) and the
planner leaves that pool to the reactive rules.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

K_BOUNDS = (0.5, 8.0)


def bucket_of(prompt_tokens: float) -> int:
    """The prompt-length bucket: ``floor(log2(tokens))`` (at least 0)."""
    return max(0, int(math.log2(max(1.0, prompt_tokens))))


def mmn_wait_quantile_s(arrival_per_s: float, service_s: float, servers: int, q: float = 0.9) -> float:
    """The ``q`` quantile of the wait in an M/M/n queue: a request waits with probability
    ``P`` (Sakasegawa's ``rho ** (sqrt(2 (n + 1)) - 1)``), then for an exponential time of rate
    ``n (1 - rho) / service``; ``inf`` at or past saturation, 0 while ``P <= 1 - q``."""
    if arrival_per_s <= 0:
        return 0.0
    rho = arrival_per_s * service_s / servers
    if rho >= 1:
        return math.inf
    waits = rho ** (math.sqrt(2 * (servers + 1)) - 1)
    if waits <= 1 - q:
        return 0.0
    return service_s / (servers * (1 - rho)) * math.log(waits / (1 - q))


@dataclass
class PrefillCapacity:
    """``alpha`` weighs each new sample; ``min_busy`` ignores windows where the pool was barely
    busy (their ratio says little)."""

    alpha: float = 0.3
    min_busy: float = 0.05
    per_bucket: dict[int, float] = field(default_factory=dict)
    k: float = 1.0

    def observe(self, tokens_per_s: float, busy_groups: float, prompt_tokens: float) -> None:
        if busy_groups < self.min_busy or tokens_per_s <= 0 or prompt_tokens <= 0:
            return
        rate = tokens_per_s / busy_groups
        bucket = bucket_of(prompt_tokens)
        old = self.per_bucket.get(bucket)
        self.per_bucket[bucket] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

    def per_group(self, prompt_tokens: float) -> float | None:
        """One busy group's tokens per second at this prompt length (the nearest measured
        bucket's when this one has none; ties go to the longer, slower bucket)."""
        if not self.per_bucket:
            return None
        bucket = bucket_of(prompt_tokens)
        nearest = min(self.per_bucket, key=lambda b: (abs(b - bucket), -b))
        return self.per_bucket[nearest]

    def raw_ttft_s(self, demand_tokens_per_s: float, prompt_tokens: float, groups: int) -> float | None:
        """TTFT's p90 by the queue model, uncorrected: the mean prompt's compute plus the wait's
        p90 (the SLO and the correction read TTFT's p90: like is compared with like)."""
        rate = self.per_group(prompt_tokens)
        if rate is None or groups < 1 or prompt_tokens <= 0:
            return None
        service_s = prompt_tokens / rate
        return service_s + mmn_wait_quantile_s(demand_tokens_per_s / prompt_tokens, service_s, groups)

    def predict_ttft_s(self, demand_tokens_per_s: float, prompt_tokens: float, groups: int) -> float | None:
        raw = self.raw_ttft_s(demand_tokens_per_s, prompt_tokens, groups)
        return None if raw is None else raw * self.k

    def correct(
        self, observed_ttft_s: float, demand_tokens_per_s: float, prompt_tokens: float, groups: int
    ) -> None:
        """Move ``k`` towards observed / predicted (a finite prediction only)."""
        raw = self.raw_ttft_s(demand_tokens_per_s, prompt_tokens, groups)
        if raw is None or not math.isfinite(raw) or raw <= 0 or observed_ttft_s <= 0:
            return
        ratio = min(max(observed_ttft_s / raw, K_BOUNDS[0]), K_BOUNDS[1])
        self.k = min(max((1 - self.alpha) * self.k + self.alpha * ratio, K_BOUNDS[0]), K_BOUNDS[1])


@dataclass
class DecodeCapacity:
    """``samples`` keeps the last ``history`` ticks; ``kv_tokens_per_group`` bounds the
    sequences a group holds at a context (``None``: no bound known)."""

    history: int = 240
    kv_tokens_per_group: float | None = None
    alpha: float = 0.3
    min_usage: float = 0.2
    full_seqs: float | None = None  # sequences a group holds with its KV full, at the running mix
    samples: deque[tuple[float, float, float]] = field(default_factory=deque)

    def observe_fill(self, seqs_per_group: float, kv_usage: float) -> None:
        if kv_usage < self.min_usage or seqs_per_group <= 0 or not math.isfinite(kv_usage):
            return
        full = seqs_per_group / kv_usage
        old = self.full_seqs
        self.full_seqs = full if old is None else (1 - self.alpha) * old + self.alpha * full

    def observe(self, seqs_per_group: float, context_tokens: float, itl_s: float) -> None:
        if seqs_per_group <= 0 or itl_s <= 0 or context_tokens < 0:
            return
        self.samples.append((seqs_per_group, context_tokens, itl_s))
        while len(self.samples) > self.history:
            self.samples.popleft()

    def fit(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of ``ITL = a + b n + c n ctx``; ``None`` until the samples span more than
        one batch size. Without context spread, ``c`` is 0 and ``b`` carries it."""
        if len({n for n, _, _ in self.samples}) < 2:
            return None
        rows = [(1.0, n, n * ctx) for n, ctx, _ in self.samples]
        ys = [itl for _, _, itl in self.samples]
        spread = len({round(ctx, 6) for _, ctx, _ in self.samples}) > 1
        columns = 3 if spread else 2
        solution = _least_squares([row[:columns] for row in rows], ys)
        if solution is None:
            return None
        a, b = solution[0], solution[1]
        c = solution[2] if spread else 0.0
        return a, b, c

    def predict_itl_s(self, seqs_per_group: float, context_tokens: float) -> float | None:
        fitted = self.fit()
        if fitted is None:
            return None
        a, b, c = fitted
        return a + b * seqs_per_group + c * seqs_per_group * context_tokens

    def seqs_per_group(self, itl_target_s: float, context_tokens: float, fill: float = 1.0) -> float | None:
        """The most sequences one group holds with its predicted ITL within ``itl_target_s``
        and its KV within ``fill`` of full; ``None`` unmeasured."""
        fitted = self.fit()
        if fitted is None:
            return None
        a, b, c = fitted
        slope = b + c * context_tokens
        by_latency = math.inf if slope <= 0 else max(0.0, (itl_target_s - a) / slope)
        by_kv = math.inf
        if self.kv_tokens_per_group is not None and context_tokens > 0:
            by_kv = fill * self.kv_tokens_per_group / context_tokens
        if self.full_seqs is not None:
            by_kv = min(by_kv, fill * self.full_seqs)
        most = min(by_latency, by_kv)
        return None if math.isinf(most) else most


def _least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> list[float] | None:
    """Solve the normal equations by Gaussian elimination; ``None`` when singular."""
    size = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(size)] for i in range(size)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(size)]
    m = [ata[i] + [aty[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(m[r][col]))
        scale = max(abs(m[r][col]) for r in range(size)) or 1.0
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(size):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][size] / m[i][i] for i in range(size)]
