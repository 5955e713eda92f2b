"""``python -m cgx``: the CGX_* variables, their values in effect and who set them."""

from cgx.config import describe

print(describe())
