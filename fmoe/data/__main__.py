"""``python -m fmoe.data prepare ...`` (see ``fmoe.data.prepare``)."""

from .prepare import main

main()
