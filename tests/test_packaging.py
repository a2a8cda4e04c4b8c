"""What a built wheel holds: setup.cfg finds packages by their __init__.py (``packages =
find:``), so a folder of modules without one is silently left out of the wheel while an editable
install still works (numflash/cuda and numflash/cpu were, until session 10)."""
import configparser
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_module_folder_is_a_package_the_wheel_takes():
    missing = [str(d.relative_to(ROOT)) for d in (ROOT / "numflash").rglob("*")
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
               and not (d / "__init__.py").exists()]
    assert missing == [], f"no __init__.py, so not in a wheel: {missing}"


def test_the_shipped_ptx_is_package_data():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    data = cfg["options.package_data"]["numflash.cuda"].split()
    shipped = list((ROOT / "numflash/cuda").glob("ptx/*"))
    assert shipped and all(any(p.match(pattern) for pattern in data) for p in shipped)
