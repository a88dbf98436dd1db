"""MkDocs hook: the reference pages written from the code at build time, so they cannot drift.

A page asks for generated text with a marker on a line of its own:

- `<!-- drlm:cli -->`: every `drlm` command, from the argparse parser `drlm` itself builds
  (`durable_rlm.cli.build_parser`): usage, arguments, defaults and help texts.
- `<!-- drlm:settings -->`: every setting of `durable_rlm.settings.Settings`: its environment
  variable, default, constraints and description.
- `<!-- drlm:include PATH -->`: a Markdown file of the repository outside `docs/` (one copy
  of BENCHMARKS.md, which `bench/run.py --report` rewrites in place), with the images it
  links to copied into the site.

A marker the hook does not know fails the build: a typo must not leave a page silently empty.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- drlm:(?P<kind>[a-z]+)(?: (?P<arg>\S+))? -->$", re.MULTILINE)
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<path>[^)\s]+)\)")


# --- the CLI --------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{option}`" for option in action.option_strings)
            if action.nargs != 0:
                metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
                name += f" `{metavar}`"
        else:
            metavar = formatter._get_default_metavar_for_positional(action)
            name = f"`{formatter._format_args(action, metavar)}`"
        help_text = formatter._expand_help(action) if action.help else ""
        if action.choices and not isinstance(action.choices, dict):
            help_text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
        default = action.default
        shown = (
            ""
            if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 or default == []
            else f"`{default}`"
        )
        rows.append(f"| {_cell(name)} | {_cell(shown)} | {_cell(help_text)} |")
    return rows


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the order `--help` lists them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def _command(name: str, help_text: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", "", f"{help_text}." if help_text else "", ""]
    if parser.description and parser.description != help_text:
        lines += [parser.description, ""]
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    usage = formatter.format_help().strip()
    lines += ["```", usage, "```", ""]
    rows = _argument_rows(parser)
    if rows:
        lines += ["| argument | default | meaning |", "| --- | --- | --- |", *rows, ""]
    if parser.epilog:
        lines += [parser.epilog, ""]
    for sub_name, sub_help, sub in _subcommands(parser):
        lines += _command(sub_name, sub_help, sub, level + 1)
    return lines


def cli_reference() -> str:
    from durable_rlm.cli import build_parser  # the package is importable only once installed

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps usage to the terminal: the page must not vary
    try:
        parser = build_parser()
        commands = _subcommands(parser)
        lines = ["| command | what it does |", "| --- | --- |"]
        lines += [f"| [`drlm {name}`](#drlm-{name}) | {_cell(text)} |" for name, text, _ in commands]
        lines.append("")
        for name, help_text, sub in commands:
            lines += _command(name, help_text, sub, 3)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(lines)


# --- the settings ---------------------------------------------------------------------------------


def _constraints(info: Any) -> str:
    words = []
    for item in info.metadata:
        for attribute, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attribute, None)
            if value is not None:
                words.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
    return ", ".join(words)


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")
    return re.sub(r"Literal\[([^\]]*)\]", r"one of \1", text)


def settings_reference() -> str:
    from durable_rlm.settings import SECRET_FIELDS, Settings  # importable only once installed

    lines = ["| variable | default | type | meaning |", "| --- | --- | --- | --- |"]
    for field, variable in Settings.variables().items():
        info = Settings.model_fields[field]
        default = info.default
        shown = "unset" if default in (None, "") else f"`{default}`"
        kind = _type_name(info.annotation)
        limits = _constraints(info)
        meaning = info.description or ""
        if field in SECRET_FIELDS:
            meaning += " (a secret: never printed, masked by `drlm config`)"
        type_cell = f"{kind}{', ' + limits if limits else ''}"
        lines.append(f"| `{variable}` | {_cell(shown)} | {_cell(type_cell)} | {_cell(meaning)} |")
    return "\n".join(lines)


# --- repository files included once -------------------------------------------------------------


def _include(arg: str) -> str:
    path = (ROOT / arg).resolve()
    if ROOT not in path.parents or not path.is_file():
        raise PluginError(f"drlm:include: no file {arg} in the repository")
    return path.read_text(encoding="utf-8")


def _included_images(config: Any) -> list[Path]:
    """Images the included files link to (relative to the repository's root)."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "/_" in page.as_posix().removeprefix((ROOT / "docs").as_posix()):
            continue
        for match in MARKER.finditer(page.read_text(encoding="utf-8")):
            if match["kind"] != "include" or not match["arg"]:
                continue
            for image in IMAGE.finditer(_include(match["arg"])):
                target = (ROOT / image["path"]).resolve()
                if target.is_file() and ROOT in target.parents:
                    found.append(target)
    return found


# --- MkDocs events ----------------------------------------------------------------------------------


def on_files(files: Files, config: Any) -> Files:
    # An included page sits at the docs' root, so its repository-relative image links resolve
    # there once the images are in the site under the same relative paths.
    for image in _included_images(config):
        uri = image.relative_to(ROOT).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(image)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    def expand(match: re.Match[str]) -> str:
        kind, arg = match["kind"], match["arg"]
        if kind == "cli":
            return cli_reference()
        if kind == "settings":
            return settings_reference()
        if kind == "include" and arg:
            return _include(arg)
        raise PluginError(f"{page.file.src_uri}: unknown marker {match.group(0)}")

    return MARKER.sub(expand, markdown)
