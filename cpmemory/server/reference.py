"""The reference of ``cpmemory serve``'s configuration, generated from the config models (docs/reference/serve.md).

Every field of :class:`~cpmemory.server.config.ServerConfig`, nested sections included, with its config-file key,
its default, the flag or environment variable that sets it (where one does) and its description: the field's own
(``Field(description=...)``), else its entry in its model's ``Attributes:`` docstring section. Write the page with
``python -m cpmemory.server.reference`` (a unit test fails while the committed page is stale)."""
from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from cpmemory.server.config import HOLD_DEFAULTS, UPSTREAM_PRESETS, ServerConfig

PAGE = Path("docs/reference/serve.md")
"""Where the page lives, from the repository root."""

FLAGS: dict[str, str] = {
    "engines": "`--engine` (repeat)",
    "kv_events": "`--kv-events` (repeat)",
    "upstream": "`--upstream`",
    "upstream_kind": "`--upstream-kind`",
    "redis_url": "`--redis`",
    "api_keys": "`--api-keys-file`, `CPMEMORY_API_KEYS`",
    "cache_salt_secret": "`CPMEMORY_CACHE_SALT_SECRET`",
    "tokenizer": "`--tokenizer`",
    "router.policy": "`--router`",
    "hold.policy": "`--hold`",
    "fit.enabled": "`--fit/--no-fit`",
}
"""The config keys a flag or an environment variable sets (the rest: the ``--config`` file only)."""

_HEADER = """# `cpmemory serve`: configuration reference

Generated from the configuration models (`cpmemory/server/config.py`) by `python -m cpmemory.server.reference`;
do not edit by hand. How to run the proxy: [guides/serving.md](../guides/serving.md).

Every setting below can go in a `--config` file (TOML, or YAML with PyYAML installed) under its key; a flag given
on the command line overrides the file. Sections are TOML tables (`[hold]`, `[fit]`, ...). An unknown key is
refused. Secrets come from the environment (`CPMEMORY_CACHE_SALT_SECRET`, `CPMEMORY_API_KEYS` as a JSON object).
"""


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly or as ``Model | None``), else None."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(
        annotation) is typing.Union else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _attributes(model: type[BaseModel]) -> dict[str, str]:
    """The ``Attributes:`` section of a model's docstring, name -> text (continuation lines joined)."""
    doc = inspect.getdoc(model) or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    entries: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        match = re.match(r"^\s{4}(\w+):\s*(.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2).strip()
        elif current is not None and line.strip() and line.startswith(" " * 8):
            entries[current] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return entries


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"\b(?:[a-z_]+\.)+([A-Z]\w*)", r"\1", text).replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined:
        value = field.default_factory() if field.default_factory is not None else None
    else:
        value = field.default
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "unset"
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(model: type[BaseModel], prefix: str, sections: list[tuple[str, type[BaseModel]]]) -> list[str]:
    documented = _attributes(model)
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = _submodel(field.annotation)
        if nested is not None:
            sections.append((key, nested))
        description = field.description or documented.get(name, "")
        rows.append(f"| `{key}` | {_cell(_type_name(field.annotation))} | {_default(field)} | "
                    f"{FLAGS.get(key, '')} | {_cell(description)} |")
    return rows


def _table(model: type[BaseModel], prefix: str, sections: list[tuple[str, type[BaseModel]]]) -> list[str]:
    return ["| key | type | default | flag / environment | description |", "|---|---|---|---|---|",
            *_rows(model, prefix, sections)]


def _policies() -> list[str]:
    lines = ["## Hold policies", "", "What each `hold.policy` sets unless the `[hold]` section says otherwise:", "",
             "| policy | `max_in_flight` (per replica) | `token_bound` | `timeout_ms` |", "|---|---|---|---|",
             "| `off` | - | - | - |"]
    for policy, settings in HOLD_DEFAULTS.items():
        count = "none" if settings.max_in_flight is None else str(settings.max_in_flight)
        lines.append(f"| `{policy}` | {count} | {'on' if settings.token_bound else 'off'} | "
                     f"{settings.timeout_s * 1000:g} |")
    presets = ("What each `upstream_kind` sets unless `upstream_session` or `cache_salt` is given (`cache_salt` stays "
               "on with API keys):")
    lines += ["", "## Gateway presets", "", presets, "", "| upstream_kind | upstream_session | cache_salt |",
              "|---|---|---|"]
    for kind, preset in UPSTREAM_PRESETS.items():
        lines.append(f"| `{kind}` | {str(preset.session).lower()} | {str(preset.cache_salt).lower()} |")
    return lines


def render() -> str:
    """The whole page (pure: the same models give the same text)."""
    sections: list[tuple[str, type[BaseModel]]] = []
    lines = [_HEADER, "## Top level", "", *_table(ServerConfig, "", sections), ""]
    while sections:
        key, model = sections.pop(0)
        summary = (inspect.getdoc(model) or "").split("\n\n", 1)[0].replace("\n", " ")
        lines += [f"## `[{key}]`", "", summary, "", *_table(model, key + ".", sections), ""]
    lines += _policies()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the page (``--check``: exit 1 when the committed page differs instead)."""
    args = sys.argv[1:] if argv is None else argv
    page = render()
    if "--check" in args:
        return 0 if PAGE.exists() and PAGE.read_text(encoding="utf-8") == page else 1
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
