"""Every folder of the package is a package: a wheel built by setuptools' find_packages leaves
out folders without __init__.py, and a non-editable install would then fail to import them."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ortspec"


def test_every_source_folder_has_an_init():
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert folders, "no sources found"
    assert sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists()) == []
