"""``python -m proxy`` is the ``context-proxy`` command."""

from .cli import main

main()
