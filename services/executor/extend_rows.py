"""Short extends run as decode rows, so that a CUDA graph replays them.

An extend step runs eagerly: on a GPU each of its few hundred kernels is launched from Python,
and for a few new tokens the host is the bottleneck. On an H200, a prompt of Llama-3.1-8B's
shapes whose prefix the radix cache holds (one token computed) took 22-29 ms to its first token
in bf16 and 42-45 ms with GGUF Q4_K weights (`loadtest/results/gpu_extend_host_h200_run1.txt`),
where a decode step, replayed from a graph, takes 4. As rows: 4.9 ms in bf16, 3.5 with GGUF
Q4_K (`loadtest/results/gpu_extend_rows_h200_run1.json`).

New token i of a request with prefix P attends to the keys at positions [0, P + i], its own
among them: exactly what a decode row with that request's table row, sequence length P + i + 1
and the token's slot computes, once every new token's K and V are in the pool, which a decode
step writes before its attention reads. So a step of N new tokens is a decode batch of N rows,
one a token, the rows of one request sharing its table row; its logits are read at each
request's last token. The kernels are the decode step's, rounded as decode rounds, not as the
extend kernels would.

Not taken when the step wants hidden states other than each request's last (prompt logprobs,
embeddings' pooling: the graphs return logits only), past the graphs' largest batch, or when
the rows would re-read too many keys: row i of a request reads its whole prefix, so a request
of n new tokens after P cached ones reads about (n - 1) * (P + n / 2) keys more than one
decode row does. In bf16 on an H200 (Llama-3.1-8B shapes, `--sections extend_rows_prefix`,
`loadtest/results/gpu_extend_rows_prefix_h200_run1.json`) the rows' time grew with the keys
re-read and the extend's stayed at 18-39 ms: 16 new tokens after 16,384 cached
18.6 ms as rows against 31.8 (246K keys re-read), 64 after 4,096 17.7 against 28.5 (260K),
256 after 1,024 18.8 against 25.7 (294K); 64 after 16,384 41.9 against 30.8 (1.03M) and 256
after 4,096 43.6 against 27.8 (1.08M) lost. `EXTRA_KEYS` (262,144) takes the first two and
leaves the third, a win, to the extend with the losses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the batch policy imports this module: no torch.distributed for it
    from services.executor.distributed.steps import StepTables

# keys a step's rows may read beyond one row per request (see above)
EXTRA_KEYS = 256 * 1024
# new tokens a step may run as rows (within the graphs' largest batch): on an H200, a new
# 256-token prompt's first token came in 10.2 ms as rows against 24.1 eager in bf16, 16.8
# against 37.8 with int4 AWQ weights (loadtest/results/gpu_extend_rows_h200_run1.json);
# longer ones are not measured
MAX_ROWS = 256


def re_read(prefix: int, new: int) -> int:
    """Keys the rows of a request's `new` tokens after `prefix` ones in the pool read beyond
    what one decode row reads: row i reads prefix + i + 1."""
    return (new - 1) * prefix + new * (new - 1) // 2


def counts_fit(prefix_lens: list[int], extend_lens: list[int], max_rows: int) -> bool:
    """Whether requests with these tokens in the pool and these new ones run as at most
    `max_rows` decode rows within EXTRA_KEYS (the runner's step, the policy's plan)."""
    return 0 < sum(extend_lens) <= max_rows and (
        sum(map(re_read, prefix_lens, extend_lens)) <= EXTRA_KEYS
    )


def fits(tables: StepTables, max_rows: int) -> bool:
    """Whether the extend step `tables` runs as decode rows, at most `max_rows` of them."""
    return (
        not tables.is_decode
        and not tables.extra
        and counts_fit(tables.prefix_lens, tables.extend_lens, max_rows)
    )


def as_rows(tables: StepTables) -> tuple[list[int], list[int]]:
    """Each new token's table row and sequence length as a decode row: (rows, seq_lens)."""
    rows = [r for r, n in zip(tables.rows, tables.extend_lens, strict=True) for _ in range(n)]
    return rows, [p + 1 for p in tables.positions]
