"""Templates: the data that shapes the prefix, the turns and the scenario of a mesh.

A template is a folder (``template.toml`` + Jinja/Markdown files). ``light`` and ``heavy``
ship in ``mesh/template/builtin/``; a user copies one (:func:`export_template`), edits it and
passes its path. See :mod:`mesh.template.loader` for the schema and
:mod:`mesh.template.prefix` for how the project prefix is composed.
"""
