"""The torch side of each model family (``<name>/family.py``: a ``BuildFamily``); ``registry`` maps to it."""
