"""Loading templates: the shipped ones validate; broken ones name the file and the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mesh.template.loader import BUILTIN_TEMPLATES, TemplateError, export_template, load_template


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_shipped_templates_load(name: str) -> None:
    template = load_template(name)
    m = template.manifest
    assert m.name == name
    assert m.skills and m.prefix.sections
    assert "{{" not in template.instructions("t1", "Find the parcel model.")
    assert "Find the parcel model." in template.instructions("t1", "Find the parcel model.")
    result = template.tool_result(call="grep(text='x')", output="a.py:1: x", is_error=False, turn=1)
    assert "a.py:1: x" in result


def test_light_and_heavy_differ_in_weight() -> None:
    light, heavy = load_template("light").manifest, load_template("heavy").manifest
    assert light.prefix.target_tokens < heavy.prefix.target_tokens
    assert light.turns.max_tokens_per_turn < heavy.turns.max_tokens_per_turn
    assert light.tools.max_output_tokens < heavy.tools.max_output_tokens
    assert "delegate" in heavy.tools.enabled


def _copy(tmp_path: Path, name: str = "light") -> Path:
    return export_template(name, tmp_path / "mine")


def _edit(folder: Path, old: str, new: str) -> None:
    manifest = folder / "template.toml"
    text = manifest.read_text()
    assert old in text, old
    manifest.write_text(text.replace(old, new, 1))


def test_a_copied_template_loads_from_its_path(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    _edit(folder, 'name = "light"', 'name = "mine"')
    assert load_template(folder).name == "mine"
    assert load_template(str(folder)).root == folder.resolve()


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("target_tokens = 5632", "target_tokens = 12", "prefix.target_tokens"),
        ("max_turns = 4", "max_turns = 4\nmax_turnz = 5", "turns.max_turnz"),
        ('style = "call"', 'style = "xml"', "tool_calls.style"),
        ('mode = "full"', 'mode = "everything"', "prefix.sections[2].mode"),
        ('kind = "outline"', 'kind = "forest"', "prefix.sections[1]"),
        ('enabled = ["list_files"', 'enabled = ["rm_rf"', "tools.enabled[0]"),
        ('dist = "uniform", min = 20', 'dist = "uniform", min = 200', "tool_output_tokens"),
        ("sigma = 0.5", "sigma = 0.5, mean = 3", "scenario.tool_latency_s.mean"),
        ('id = "quick-look"', 'id = ""', "skills[0].id"),
    ],
)
def test_broken_manifest_names_file_and_field(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    folder = _copy(tmp_path)
    _edit(folder, old, new)
    with pytest.raises(TemplateError) as info:
        load_template(folder)
    assert info.value.file == str(folder.resolve() / "template.toml")
    assert info.value.field is not None and field in info.value.field
    assert field in str(info.value) and "template.toml" in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "template.toml").write_text("name = \n")
    with pytest.raises(TemplateError, match=r"template\.toml: invalid TOML"):
        load_template(folder)


def test_missing_manifest_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="no such directory"):
        load_template(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TemplateError, match=r"template\.toml: missing"):
        load_template(tmp_path / "empty")


def test_missing_template_file_names_the_field(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "tool_result.j2").unlink()
    with pytest.raises(TemplateError) as info:
        load_template(folder)
    assert info.value.field == "turns.tool_result"
    assert "tool_result.j2" in str(info.value)


def test_template_file_may_not_leave_the_folder(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (tmp_path / "outside.j2").write_text("hi")
    _edit(folder, 'file = "system.md.j2"', 'file = "../outside.j2"')
    with pytest.raises(TemplateError, match=r"prefix\.sections\[0\]\.file"):
        load_template(folder)
    _edit(folder, 'file = "../outside.j2"', 'file = "link.j2"')
    (folder / "link.j2").symlink_to(tmp_path / "outside.j2")
    with pytest.raises(TemplateError, match="leaves the template folder"):
        load_template(folder)


def test_jinja_errors_name_the_file(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "instructions.j2").write_text("{% if %}")
    with pytest.raises(TemplateError, match=r"instructions\.j2.*line 1"):
        load_template(folder)
    (folder / "instructions.j2").write_text("{{ subtask.instructions }} {{ no_such_name }}")
    with pytest.raises(TemplateError, match=r"instructions\.j2.*no_such_name"):
        load_template(folder)


def test_templates_render_in_a_sandbox(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "system.md.j2").write_text("{{ tools.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match=r"system\.md\.j2"):
        load_template(folder)


def test_export_refuses_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(TemplateError):
        export_template("medium", tmp_path / "x")
    shutil.rmtree(export_template("heavy", tmp_path / "h"))
