"""The shipped answer tables' writer: both tables byte-identical to the package's own."""

from pathlib import Path

import pytest

from klpo.lab import tables

ASSETS = Path(tables.__file__).parents[1] / "assets"


def test_the_writer_writes_the_shipped_tables_unchanged(tmp_path, capsys):
    assert tables.main(["--out", str(tmp_path)]) == 0
    for file in ("explain.json", "explain_teacher.json"):
        assert (tmp_path / file).read_bytes() == (ASSETS / file).read_bytes(), file
    assert capsys.readouterr().out.count("wrote ") == 2


def test_one_table_by_name(tmp_path):
    assert tables.main(["explain", "--out", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["explain.json"]


def test_bad_arguments_are_said(tmp_path, capsys):
    assert tables.main(["lineage", "--out", str(tmp_path)]) == 2
    assert "unknown table 'lineage'; the tables are explain, teacher" in capsys.readouterr().err
    assert tables.main(["--out"]) == 2
    with pytest.raises(ValueError, match="no shipped table 'x'"):
        tables.write("x", tmp_path)
    assert list(tmp_path.iterdir()) == []
