"""radixserve: an LLM serving engine built as asyncio services over Redis streams."""

__version__ = "0.1.0"
