"""radixserve: an LLM serving engine built as asyncio services over Redis streams, and the
same engine in-process (`radixserve.Engine`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixserve.engine.api import Engine
    from radixserve.engine.pipeline import RequestError

__all__ = ["Engine", "RequestError", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `radixserve gateway` and the CLI never load torch for it.
    if name == "Engine":
        from radixserve.engine.api import Engine

        return Engine
    if name == "RequestError":
        from radixserve.engine.pipeline import RequestError

        return RequestError
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
