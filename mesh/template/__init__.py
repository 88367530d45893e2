"""Templates: the data that shapes the prefix, the turns and the scenario of a mesh.

A template is a folder (``template.toml`` + Jinja/Markdown files). ``light`` and ``heavy``
ship in ``mesh/template/builtin/``; a user copies one (:func:`export_template`), edits it and
passes its path. See :mod:`mesh.template.manifest` for the schema and
:mod:`mesh.template.prefix` for how the project prefix is composed.
"""

from mesh.template.loader import (
    BUILTIN_TEMPLATES,
    Template,
    default_project_dir,
    export_template,
    load_template,
    sample_project_dir,
)
from mesh.template.manifest import Manifest, TemplateError, ToolCallSyntax
from mesh.template.prefix import CountTokens, IncludedFile, Prefix, SkippedFile, build_prefix

__all__ = [
    "BUILTIN_TEMPLATES",
    "CountTokens",
    "IncludedFile",
    "Manifest",
    "Prefix",
    "SkippedFile",
    "Template",
    "TemplateError",
    "ToolCallSyntax",
    "build_prefix",
    "default_project_dir",
    "export_template",
    "load_template",
    "sample_project_dir",
]
