"""The CosyVoice 3 family: ``family.py`` is its ``Family``; config, graphs, stages, verify drivers beside it."""
