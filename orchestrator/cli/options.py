"""The eval settings (remote/contract/settings.py) as command-line options, for every command that runs evals."""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import typer

from remote.contract.settings import FIELDS, EvalSettings, SettingsError

PREFIX = "setting_"


def _option(f):
    default = f.cli_default if f.cli_default is not None else getattr(EvalSettings(), f.name)
    decls = [f.flag] + ([f.short] if f.short else [])
    help_text = f.help[0].upper() + f.help[1:] + "."
    if f.kind is bool:
        return bool, typer.Option(default, *decls, help=help_text)
    return Optional[f.kind], typer.Option(default, *decls, help=help_text, metavar=f.metavar)


def with_settings(command):
    """``command`` gets every eval setting as an option, and one ``settings`` argument (an
    :class:`EvalSettings`) in their place; settings a worker would refuse are refused here, before any
    host is touched. ``command`` takes its click context as ``ctx`` (which options were typed)."""
    from ..errors import InputError

    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "settings"]
    added = []
    for f in FIELDS:
        annotation, option = _option(f)
        added.append(inspect.Parameter(PREFIX + f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                       annotation=annotation))

    @functools.wraps(command)
    def run(*args, **kwargs):
        values = {f.name: kwargs.pop(PREFIX + f.name) for f in FIELDS}
        ctx = kwargs["ctx"]
        typed_mode = getattr(ctx.get_parameter_source(PREFIX + "mode"), "name", None) == "COMMANDLINE"
        if values["engine"] and values["mode"] == "offline" and typed_mode:
            raise InputError("--engine decodes online (the engine serves the prompts beside our own online "
                             "decoding): leave out --mode offline")
        try:
            settings = EvalSettings(**values)
        except SettingsError as e:
            raise InputError(str(e)) from None
        return command(*args, settings=settings, **kwargs)

    run.__signature__ = signature.replace(parameters=own + added)
    return run
