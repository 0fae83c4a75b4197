"""The trt-cosy version: engines record it, and engines built by another version are refused as stale."""

__version__ = "0.3.0"
