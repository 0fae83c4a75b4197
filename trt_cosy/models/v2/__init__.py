"""The CosyVoice 2 family: ``family.py`` is its ``Family``; config, graphs, stages, verify drivers beside it."""
