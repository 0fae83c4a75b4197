"""The torch side of the CosyVoice 2 family: ``family.py`` is its ``BuildFamily``; modules, reference loader, export plans, test-model writer beside it."""
