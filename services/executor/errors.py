"""Errors raised while reading a model: callers tell "we can't run this" from "this is broken"."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but names an architecture (or feature) we don't implement."""


class ModelLoadError(RuntimeError):
    """The checkpoint is missing, unreadable, or its weights don't match its config."""


class UnsupportedQuantizationError(UnsupportedModelError, ModelLoadError):
    """A checkpoint's (or --quantization's) weight format that radixserve cannot run: both an
    unsupported feature and a model that will not load, so either `except` catches it."""
