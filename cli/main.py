"""``fuyou`` command line: thin click commands over the library.

torch and the rest of the data path are imported inside commands, so ``fuyou --help`` is instant.
Errors Fuyou raises on purpose print as one line (no traceback unless ``--debug``), exit code 1.
"""

from __future__ import annotations

import sys

import click

from fuyou import __version__


class FuyouGroup(click.Group):
    """Turns FuyouError into a one-line message and exit code 1 (traceback with --debug)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as e:
            from fuyou.errors import FuyouError

            if isinstance(e, FuyouError) and not ctx.meta.get("fuyou.debug"):
                click.echo(f"error: {e}", err=True)
                sys.exit(1)
            raise


@click.group(cls=FuyouGroup)
@click.version_option(__version__, prog_name="fuyou")
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Full-parameter fine-tuning of LLMs larger than GPU memory, with state on NVMe SSDs."""
    ctx.meta["fuyou.debug"] = debug


@main.command()
@click.option("--ssd", "ssd_dirs", multiple=True, required=True, type=click.Path(), help="Store directory (repeat per SSD).")
def doctor(ssd_dirs: tuple[str, ...]) -> None:
    """Check the machine: SSD directories (writable, O_DIRECT, space), memlock, GPU, kvikio."""
    from rich.console import Console
    from rich.table import Table

    from fuyou.doctor import run_checks

    checks = run_checks(list(ssd_dirs))
    table = Table("check", "status", "detail", show_lines=False)
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    Console().print(table)
    if any(c.status == "fail" for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
