"""``python -m fmoe.hf export CHECKPOINT --out DIR``: see ``fmoe.hf.export``."""

from .export import main

main()
