"""The prefix cache: a radix tree of token runs -> KV slots (radix.py), a null object with the
same interface for `--disable-radix-cache` (null.py), and the slot ownership rule (base.py)."""

from services.executor.cache.base import InsertResult, MatchResult, PrefixCache, TreeNode
from services.executor.cache.null import NullCache
from services.executor.cache.radix import RadixCache

__all__ = ["InsertResult", "MatchResult", "NullCache", "PrefixCache", "RadixCache", "TreeNode"]
