"""One folder per model family (``v1``, ``v2``, ``v3``), each with its ``Family``; the ``registry``
maps a release directory or a model config to it. See docs/architecture.md."""
