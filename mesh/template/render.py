"""Jinja rendering of template files: sandboxed, strict about undefined names.

Template files are data a user may have edited or downloaded, so they are rendered in a
:class:`~jinja2.sandbox.SandboxedEnvironment` (no attribute access to internals) whose loader
only reads files inside the template folder. A name the file uses but the context lacks is
an error (``StrictUndefined``), reported as a :class:`TemplateError` naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from mesh.template.manifest import TemplateError

__all__ = ["Renderer"]


class Renderer:
    """Renders the Jinja files of one template folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._env = SandboxedEnvironment(
            loader=jinja2.FileSystemLoader(str(root), followlinks=False),
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
            trim_blocks=True,
            lstrip_blocks=True,
        )

    def check(self, file: str, field: str) -> None:
        """Parse ``file`` (no rendering); a syntax error names the file, field and line."""
        try:
            self._env.get_template(file)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                self.root / file, field, f"Jinja syntax error on line {exc.lineno}: {exc.message}"
            ) from exc
        except jinja2.TemplateNotFound as exc:
            raise TemplateError(self.root / file, field, "file not found") from exc
        except UnicodeDecodeError as exc:
            raise TemplateError(
                self.root / file, field, f"not UTF-8 text (byte {exc.start}); is it binary?"
            ) from exc

    def render(self, file: str, context: Mapping[str, Any]) -> str:
        try:
            return self._env.get_template(file).render(dict(context))
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                self.root / file, None, f"Jinja syntax error on line {exc.lineno}: {exc.message}"
            ) from exc
        except jinja2.TemplateNotFound as exc:
            raise TemplateError(self.root / file, None, "file not found") from exc
        except jinja2.UndefinedError as exc:
            names = ", ".join(sorted(context))
            raise TemplateError(
                self.root / file, None, f"{exc.message} (names available: {names})"
            ) from exc
        except jinja2.TemplateError as exc:  # SecurityError and other render-time errors
            raise TemplateError(self.root / file, None, f"render failed: {exc}") from exc
