"""`--help` that reads well at 80 columns. typer's rich help keeps a docstring's single line
breaks in the list of commands (a description then breaks mid-sentence) and shows a typed
placeholder beside every option, `<bool>` beside an on/off flag included. :func:`tidy` walks the
command tree once, before help is drawn: each paragraph of a help text becomes one line (rich
wraps it to the terminal), an on/off flag shows no placeholder, and an option that takes a value
and has no metavar of its own names it: N (an integer), NUM (a number), else the option's name
(``--suite SUITE``).
"""
from __future__ import annotations

import inspect
import re
import typing

from typer._click import Context
from typer.core import TyperOption


def one_line_paragraphs(text: str | None) -> str | None:
    """Each paragraph (blank-line separated) of ``text`` on one line."""
    if not text:
        return text
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(text)))


def _metavar(option: TyperOption) -> str:
    annotation = option.type_descriptor.annotation
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    if annotation is int:
        return "N"
    if annotation is float:
        return "NUM"
    return max(option.opts, key=len).lstrip("-").upper().replace("-", "_")


def tidy(command) -> None:
    """Help texts as one line per paragraph, and placeholders that say what an option takes, on
    ``command`` and every command under it."""
    command.help = one_line_paragraphs(command.help)
    command.short_help = one_line_paragraphs(command.short_help)
    help_option = command.get_help_option(Context(command, info_name=command.name))  # made once, kept
    for param in [*command.params, *([help_option] if help_option else [])]:
        if isinstance(param, TyperOption):
            param.help = one_line_paragraphs(param.help)
            if param.is_flag:
                param.metavar = ""
            elif param.metavar is None:
                param.metavar = _metavar(param)
    for sub in getattr(command, "commands", {}).values():
        tidy(sub)
