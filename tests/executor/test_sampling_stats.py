"""The sampler draws from exactly the distribution its parameters describe (chi-square
goodness of fit against an independent reference, at a fixed seed), and the logits processors
(logit bias, min tokens, penalties) compute exactly vLLM's formulas, row by row."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from services.executor.request import Req
from services.executor.sampling.processors import LogitsProcessor, needs_history
from services.executor.sampling.sampler import SamplingTensors, filter_probs, sample
from shared.messages.common import SamplingParams

CPU = torch.device("cpu")

# --- sampler: reference distribution and goodness of fit ----------------------------------

# Token PERM[i] gets the i-th largest probability, so vocab order is not rank order.
PROBS = [0.26, 0.19, 0.15, 0.12, 0.09, 0.07, 0.05, 0.04, 0.02, 0.01]
PERM = [3, 7, 0, 9, 5, 1, 8, 2, 6, 4]
LOGITS_A = [0.0] * len(PROBS)
for rank, tok in enumerate(PERM):
    LOGITS_A[tok] = math.log(PROBS[rank]) + 1.7  # a shift changes nothing
LOGITS_B = [-2.3, 0.4, 1.9, -0.7, 1.1, -4.0, 0.8, 2.6, -1.5, 0.05]
MARGIN = 2e-3  # parameters keep this clear of top-p / min-p cut points, where rounding decides


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """The sampler's documented distribution, in float64: softmax(logits / temperature); keep
    the top_k most likely; of those (renormalised) keep each token while the mass before it is
    < top_p; then drop tokens below min_p * the most likely; renormalise."""
    vocab = len(logits)
    if temperature == 0 or top_k == 1:
        best = max(range(vocab), key=lambda t: logits[t])
        return [1.0 if t == best else 0.0 for t in range(vocab)]
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    p = [w / sum(weights) for w in weights]
    order = sorted(range(vocab), key=lambda t: -p[t])
    if top_k > 0:
        order = order[:top_k]
    mass = sum(p[t] for t in order)
    kept: list[int] = []
    before = 0.0
    for t in order:
        if top_p < 1:
            assert abs(before - top_p) > MARGIN, "top_p sits on a cut point"
            if before >= top_p:
                break
        kept.append(t)
        before += p[t] / mass
    threshold = min_p * p[kept[0]]
    if min_p > 0:
        assert all(abs(p[t] - threshold) > MARGIN * p[kept[0]] for t in kept), "min_p on a cut"
    kept = [t for t in kept if p[t] >= threshold]
    total = sum(p[t] for t in kept)
    return [p[t] / total if t in kept else 0.0 for t in range(vocab)]


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """p-value of observed `counts` against `probs` (over the support), pooling the bins whose
    expected count is under 5 into one."""
    n = sum(counts)
    bins: list[tuple[float, float]] = []  # (observed, expected)
    pooled_o = pooled_e = 0.0
    for o, p in zip(counts, probs, strict=True):
        if p == 0:
            continue
        if n * p < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + n * p
        else:
            bins.append((o, n * p))
    if pooled_e > 0:
        bins.append((pooled_o, pooled_e))
    if len(bins) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    q = torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    )
    return float(q)


def test_chi_square_p_rejects_a_wrong_distribution() -> None:
    """The goodness-of-fit helper itself: a fair sample passes, a skewed one does not."""
    probs = [0.5, 0.3, 0.2]
    assert chi_square_p([5030, 2980, 1990], probs) > 0.5
    assert chi_square_p([5300, 2800, 1900], probs) < 1e-3
    # df = 2, stat = 2 * ln(1000): the upper tail of chi-square(2) is exp(-stat / 2) = 1e-3.
    assert torch.special.gammaincc(
        torch.tensor(1.0, dtype=torch.float64), torch.tensor(math.log(1000), dtype=torch.float64)
    ).item() == pytest.approx(1e-3)


# (logits, temperature, top_k, top_p, min_p): every filter alone, in combination, and greedy.
CONFIGS: list[tuple[list[float], float, int, float, float]] = [
    (LOGITS_A, 1.0, -1, 1.0, 0.0),
    (LOGITS_A, 0.6, -1, 1.0, 0.0),
    (LOGITS_B, 1.8, -1, 1.0, 0.0),
    (LOGITS_A, 1.0, 4, 1.0, 0.0),
    (LOGITS_B, 1.0, 3, 1.0, 0.0),
    (LOGITS_A, 1.0, -1, 0.7, 0.0),
    (LOGITS_B, 1.0, -1, 0.8, 0.0),
    (LOGITS_A, 1.0, -1, 1.0, 0.3),
    (LOGITS_B, 0.8, -1, 1.0, 0.12),
    (LOGITS_A, 0.7, 6, 0.85, 0.0),
    (LOGITS_A, 1.3, 5, 0.9, 0.2),
    (LOGITS_B, 1.2, 6, 0.75, 0.05),
    (LOGITS_A, 0.9, -1, 0.8, 0.25),
    (LOGITS_A, 2.5, 8, 1.0, 0.05),
    (LOGITS_A, 0.0, -1, 0.5, 0.1),  # temperature 0: argmax whatever the filters
    (LOGITS_B, 1.0, 1, 1.0, 0.0),  # top_k 1: argmax
]
DRAWS = 20_000


def test_mixed_batch_samples_the_reference_distribution_per_row() -> None:
    """One batch, one row per draw, every row with its own parameters: each configuration's
    draws stay inside its support and fit its proportions."""
    logits = torch.tensor([c[0] for c in CONFIGS], dtype=torch.float32)
    logits = logits.repeat_interleave(DRAWS, dim=0)  # [len(CONFIGS) * DRAWS, vocab]
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for _, t, k, p, m in CONFIGS
        for _ in range(DRAWS)
    ]
    vocab = logits.shape[1]
    st = SamplingTensors.build(params, vocab, CPU)
    assert not st.all_greedy and st.need_filter
    tokens = sample(logits, st, torch.Generator().manual_seed(2024))
    assert tokens.shape == (len(params),) and tokens.dtype == torch.int64
    for i, (row, t, k, p, m) in enumerate(CONFIGS):
        ref = reference_probs(row, t, k, p, m)
        counts = torch.bincount(tokens[i * DRAWS : (i + 1) * DRAWS], minlength=vocab).tolist()
        outside = [tok for tok in range(vocab) if ref[tok] == 0 and counts[tok]]
        assert not outside, f"config {i}: sampled {outside} outside the support"
        pval = chi_square_p(counts, ref)
        assert pval > 1e-3, f"config {i}: counts {counts} vs {ref}, p = {pval:.2e}"


def test_reference_supports_are_what_the_configs_intend() -> None:
    """Guards the test itself: each filter really cuts something where it is meant to."""
    a_order = PERM  # tokens of LOGITS_A, most likely first
    assert sum(reference_probs(LOGITS_A, 1.0, -1, 1.0, 0.0)) == pytest.approx(1.0)
    support = [{t for t, q in enumerate(reference_probs(*c)) if q > 0} for c in CONFIGS]
    assert support[0] == set(range(10))
    assert support[3] == set(a_order[:4])
    assert support[5] == set(a_order[:4])  # 0.26 + 0.19 + 0.15 + 0.12 = 0.72 >= 0.7
    assert support[7] == set(a_order[:5])  # 0.3 * 0.26 = 0.078: 0.09 stays, 0.07 goes
    assert support[14] == {a_order[0]}
    assert support[15] == {max(range(10), key=lambda t: LOGITS_B[t])}
    assert all(1 < len(s) < 10 for s in support[4:14])


def test_temperature_zero_and_top_k_one_take_the_argmax() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 300, generator=g) * 4
    argmax = logits.argmax(dim=-1)
    greedy = [SamplingParams(temperature=0.0, top_p=0.3)] * 64
    st = SamplingTensors.build(greedy, 300, CPU)
    assert st.all_greedy
    assert torch.equal(sample(logits, st), argmax)
    # Mixed with sampled rows: even rows greedy (temperature 0 or top_k 1), odd rows sample.
    mixed = [
        SamplingParams(temperature=0.0)
        if i % 4 == 0
        else SamplingParams(temperature=1.5, top_k=1)
        if i % 4 == 2
        else SamplingParams(temperature=5.0)
        for i in range(64)
    ]
    st = SamplingTensors.build(mixed, 300, CPU)
    assert not st.all_greedy
    tokens = sample(logits, st, torch.Generator().manual_seed(6))
    assert torch.equal(tokens[0::2], argmax[0::2])
    assert not torch.equal(tokens[1::2], argmax[1::2])  # temperature 5 over 300 tokens


def test_seeded_rows_sample_the_same_tokens_alone_and_in_a_batch() -> None:
    vocab, steps = 50, 40
    batch = [
        SamplingParams(temperature=1.0, top_k=10),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1234),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=77),  # no filter: alone it skips filter_probs
        SamplingParams(temperature=1.2, min_p=0.1),
    ]
    seeded = [1, 3]
    logit_gen = torch.Generator().manual_seed(11)
    steps_logits = [torch.randn(len(batch), vocab, generator=logit_gen) * 2 for _ in range(steps)]

    def run(rows: list[int], global_seed: int, seeds: dict[int, int]) -> list[list[int]]:
        gens: list[torch.Generator | None] = [
            torch.Generator().manual_seed(seeds[r]) if r in seeds else None for r in rows
        ]
        g = torch.Generator().manual_seed(global_seed)
        st = SamplingTensors.build([batch[r] for r in rows], vocab, CPU)
        out = [sample(lg[rows], st, g, gens).tolist() for lg in steps_logits]
        return [[step[j] for step in out] for j in range(len(rows))]

    together = run(list(range(len(batch))), 1, {1: 1234, 3: 77})
    for r in seeded:
        alone = run([r], 2, {r: batch[r].seed or 0})[0]
        assert alone == together[r]
        assert len(set(alone)) > 5  # it really samples
        assert run([r], 2, {r: 999})[0] != alone  # and from its own generator
    assert together[0] != run(list(range(len(batch))), 3, {1: 1234, 3: 77})[0]


def test_rows_that_filter_nothing_keep_every_probability() -> None:
    """In a batch where another row filters, a row with top_k off, top_p 1 and min_p 0 comes
    back bit-identical (float cumsum may reach 1 before a long tail: top_p 1 must not cut it)."""
    vocab = 4000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([20, vocab, vocab, vocab, vocab, vocab])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = filter_probs(probs, top_k, top_p, min_p)
    assert torch.equal(out[1:5], probs[1:5])
    assert (out[0] > 0).sum() == 20 and (out[5] > 0).sum() < vocab


# --- logits processors --------------------------------------------------------------------

EOS = 2


@dataclass
class Row:
    """A TokenHistory without the rest of a request."""

    sampling: SamplingParams
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset({EOS})
    pending: int = 0  # output tokens still on the device, after `output_ids`

    @property
    def position(self) -> int:
        """The output index of the token this row samples."""
        return len(self.output_ids) + self.pending


def make_row(
    prompt: list[int],
    output: list[int],
    pending: int = 0,
    stop: set[int] | None = None,
    **sp: Any,
) -> Row:
    stops = frozenset({EOS} if stop is None else stop)
    return Row(SamplingParams(**sp), prompt, output, stops, pending)


def build(rows: list[Row], vocab: int) -> LogitsProcessor | None:
    return LogitsProcessor.build(rows, [r.position for r in rows], vocab, CPU)


def reference_process(logits: list[float], row: Row) -> list[float]:
    """vLLM's formulas, one token at a time."""
    out = list(logits)
    vocab = len(out)
    p = row.sampling
    for t, b in p.logit_bias.items():
        if 0 <= t < vocab:
            out[t] += b
    if row.position < p.min_new_tokens:  # tokens still on the device count
        for t in row.stop_ids:
            out[t] = -math.inf
    generated = list(row.output_ids)
    if p.repetition_penalty != 1.0:
        for t in set(row.input_ids) | set(generated):
            if out[t] > 0:
                out[t] /= p.repetition_penalty
            else:
                out[t] *= p.repetition_penalty
    for t in set(generated):
        out[t] -= p.frequency_penalty * generated.count(t)
        out[t] -= p.presence_penalty
    return out


def check_processed(rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
    """Apply the processor to a copy of `logits`; every row equals the reference, and every
    value the reference leaves alone is bit-identical. Returns the processed logits."""
    got = logits.clone()
    proc = build(rows, logits.shape[1])
    assert proc is not None
    proc.apply(got)
    for i, row in enumerate(rows):
        ref = reference_process(logits[i].tolist(), row)
        ref_t = torch.tensor(ref, dtype=torch.float32)
        torch.testing.assert_close(got[i], ref_t, rtol=1e-6, atol=1e-6, msg=f"row {i}")
        same = torch.tensor([r == x for r, x in zip(ref, logits[i].tolist(), strict=True)])
        assert torch.equal(got[i][same], logits[i][same]), f"row {i}: untouched values moved"
    return got


def test_needs_history_only_for_penalties() -> None:
    assert not needs_history(SamplingParams())
    assert not needs_history(SamplingParams(logit_bias={3: 1.0}, min_new_tokens=5))
    assert needs_history(SamplingParams(repetition_penalty=1.1))
    assert needs_history(SamplingParams(frequency_penalty=-0.5))
    assert needs_history(SamplingParams(presence_penalty=0.3))


def test_build_is_none_when_no_row_needs_anything() -> None:
    rows = [
        make_row([1, 2, 3], [4], pending=1),
        make_row([5], [], temperature=0.5, top_k=3),
        make_row([6, 7], [8, 9], pending=1, min_new_tokens=3),  # at the threshold: done
    ]
    assert build(rows, 16) is None
    assert build([], 16) is None


def test_hand_computed_order_bias_mask_repetition_frequency_presence() -> None:
    """Exact numbers, worked by hand, so the reference above cannot share a mistake."""
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0, -2.0]])
    row = make_row(
        [0, 1],
        [1, 4, 4],
        pending=1,
        stop={5},
        min_new_tokens=5,
        logit_bias={1: 3.0, 3: -1.5},
        repetition_penalty=2.0,
        frequency_penalty=0.25,
        presence_penalty=0.5,
    )
    proc = build([row], 6)
    assert proc is not None
    proc.apply(logits)
    expected = [
        0.5,  # prompt: 1 / 2
        0.25,  # bias -1 + 3 = 2 (positive now), / 2 = 1, - 0.25 * 1 - 0.5
        2.0,  # untouched
        -1.0,  # bias 0.5 - 1.5 = -1; in no history
        0.5,  # 3 / 2 = 1.5, - 0.25 * 2 - 0.5
        -math.inf,  # stop id while 4 outputs (the pending one included) < 5
    ]
    assert logits[0].tolist() == expected


def test_mixed_batch_matches_the_reference_row_by_row() -> None:
    vocab = 24
    rows = [
        make_row([1, 3], [5, 6], pending=1),  # nothing
        make_row(
            [7, 7, 8, 9, 10, 11, 12], [8, 13, 13, 14, 15, 16], pending=1, repetition_penalty=1.3
        ),
        make_row([1], [5, 5, 5, 7, 9, 17], pending=2, frequency_penalty=0.5),
        make_row([1], [18, 18, 19, 20, 21], presence_penalty=0.75),
        make_row([3], [], logit_bias={3: 2.5, 8: -100.0, 0: 0.125, vocab + 5: 1.0}),
        make_row([4], [9], pending=2, stop={EOS, 11}, min_new_tokens=4),  # 3 < 4
        make_row([4], [9], pending=2, stop={EOS, 11}, min_new_tokens=3),  # at it: off
        make_row(
            [2, 6, 6, 22],
            [6, 2, 22, 23, 23, 6],
            pending=1,
            stop={EOS, 23},
            min_new_tokens=9,
            logit_bias={EOS: 5.0, 6: 1.0, 12: -3.0},
            repetition_penalty=1.7,
            frequency_penalty=0.4,
            presence_penalty=0.3,
        ),
        make_row([9, 10], [10, 11, 11, 12], repetition_penalty=0.8, frequency_penalty=-0.6),
        make_row([1, 2, 3], [], temperature=0.0, min_new_tokens=0),  # nothing
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(8)) * 3
    # Penalised tokens on both sides of zero, in rows 1 and 7.
    for i in (1, 7):
        seen = set(rows[i].input_ids) | set(rows[i].output_ids)
        values = [logits[i, t].item() for t in seen]
        assert min(values) < 0 < max(values)
    got = check_processed(rows, logits)
    for i in (0, 6, 9):
        assert torch.equal(got[i], logits[i])
    assert got[5, EOS] == -math.inf and got[5, 11] == -math.inf
    assert got[7, EOS] == -math.inf and got[7, 23] == -math.inf  # the mask beats the bias
    assert not torch.equal(got[4], logits[4])


def test_pending_placeholders_count_for_min_tokens_not_for_penalties() -> None:
    vocab = 12
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9))
    base: dict[str, Any] = {"frequency_penalty": 0.7, "repetition_penalty": 1.4}
    base["min_new_tokens"] = 3
    with_pending = make_row([1, 4], [4, 6], pending=1, **base)
    resolved = make_row([1, 4], [4, 6], **base)

    def run(row: Row) -> torch.Tensor:
        out = logits.clone()
        proc = build([row], vocab)
        assert proc is not None
        proc.apply(out)
        return out

    a, b = run(with_pending), run(resolved)
    assert a[0, EOS] != -math.inf  # three outputs, one still on the device: min reached
    assert b[0, EOS] == -math.inf
    a[0, EOS] = b[0, EOS] = 0.0
    assert torch.equal(a, b)  # otherwise the placeholder changes nothing
    check_processed([with_pending, resolved], logits.repeat(2, 1))


def test_penalties_see_every_occurrence_of_a_repeated_token() -> None:
    vocab = 8
    logits = torch.full((3, vocab), 2.0)
    rows = [
        make_row([0], [5, 5, 5, 5], frequency_penalty=0.5),
        make_row([0], [5, 5, 5, 5], presence_penalty=0.5),
        make_row([5, 5, 5], [5, 5], repetition_penalty=2.0),
    ]
    got = check_processed(rows, logits)
    assert got[:, 5].tolist() == [0.0, 1.5, 1.0]  # 2 - 4 * 0.5, 2 - 0.5, once 2 / 2


def test_min_tokens_keep_stop_ids_out_of_the_sampler() -> None:
    vocab = 10
    logits = torch.zeros(500, vocab)
    logits[:, EOS] = 20.0  # EOS would win almost every draw
    rows = [make_row([1], [3] * (i % 4), min_new_tokens=3) for i in range(500)]
    proc = build(rows, vocab)
    assert proc is not None
    proc.apply(logits)
    st = SamplingTensors.build([r.sampling for r in rows], vocab, CPU)
    tokens = sample(logits, st, torch.Generator().manual_seed(4))
    under = torch.tensor([len(r.output_ids) < 3 for r in rows])
    assert not (tokens[under] == EOS).any()
    assert (tokens[~under] == EOS).all()


def test_req_is_a_token_history_and_wrong_logits_are_refused() -> None:
    req = Req(
        rid="r",
        input_ids=[1, 2],
        sampling=SamplingParams(presence_penalty=1.0),
        max_new_tokens=8,
        stop_ids=frozenset({EOS}),
        detok_stream="d",
        deadline=0.0,
        seq=0,
        output_ids=[3],
        pending=1,
    )
    proc = LogitsProcessor.build([req], [len(req.output_ids) + req.pending], 6, CPU)
    assert proc is not None
    logits = torch.zeros(1, 6)
    proc.apply(logits)
    assert logits[0].tolist() == [0.0, 0.0, 0.0, -1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="float32"):
        proc.apply(torch.zeros(1, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[1, 6\]"):
        proc.apply(torch.zeros(2, 6))
