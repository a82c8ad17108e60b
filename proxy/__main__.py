"""``python -m proxy`` is the ``context-proxy`` command."""

from ._cli import main

main()
