"""``python -m fuyou …``: the ``fuyou`` command (``fuyou.cli.main``)."""

from fuyou.cli.main import main  # type: ignore[import-not-found]  # the cli/ package, installed as fuyou.cli

main()
