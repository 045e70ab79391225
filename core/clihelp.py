"""`--help` with the options under headings: click lists them in one block, so a verb with
many options (`gqakit convert`, `gqakit eval`) uses `GroupedCommand` and names its groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

OTHER = "Other options"  # the heading of any option no group names


class GroupedCommand(click.Command):
    """A click command whose `--help` writes its options in sections, in the order of
    `option_groups`: (heading, parameter names) pairs, where "help" names the help option;
    options no group names come last, under "Other options". Every section shares one
    column width, so the help lines up."""

    def __init__(self, *args: Any, option_groups: Sequence[tuple[str, Sequence[str]]] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.option_groups = [(title, tuple(names)) for title, names in option_groups]

    def sections(self, ctx: click.Context) -> list[tuple[str, list[tuple[str, str]]]]:
        """(heading, [(option, help)]) in the order `--help` writes them."""
        records, help_option = {}, self.get_help_option(ctx)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None and param.name is not None:
                records["help" if param is help_option else param.name] = record  # (click's own name varies)
        out, placed = [], set()
        for title, names in [*self.option_groups, (OTHER, tuple(records))]:
            rows = [records[n] for n in names if n in records and n not in placed]
            placed.update(names)
            if rows:
                out.append((title, rows))
        return out

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = self.sections(ctx)
        # click's own limit (30): a longer option goes on a line of its own, its help below
        width = max((len(term) for _, rows in sections for term, _ in rows if len(term) <= 30), default=30)
        for title, rows in sections:
            with formatter.section(title):
                formatter.write_dl([(term.ljust(width), text) for term, text in rows], col_max=width)
