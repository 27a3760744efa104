"""The ``fuyou`` command line (installed as the package ``fuyou.cli``); thin over the library."""
