"""A bundled model whose class comes from an optional package (``shapes-video``, ``shapes-yolos``, ``shapes-vlm``:
transformers)
is refused on an install without it by the kit's own error, naming the extra that installs the package; the
missing package is simulated (``sys.modules[name] = None`` makes its import fail as if it were not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

import vitcam_nb as vc
from vitcam_nb import models
from vitcam_nb.core.errors import MissingExtraError

ROOT = Path(__file__).resolve().parents[3]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
CARDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "vitcam_nb" / "data" / "models").glob("*.json"))}


def _package(card: dict) -> str | None:
    """The optional package a card's class is imported from, read from the card itself (None: timm or the kit)."""
    top = (card.get("hf_class") or card.get("timm_class") or "").split(".")[0]
    return None if top in ("timm", "vitcam_nb") else top


def test_the_cards_that_need_a_package_are_the_video_model_the_detector_and_the_vlm():
    # Guards the parametrisation below: a new bundled model with another optional class must be added here.
    assert {n for n, c in CARDS.items() if _package(c)} == {"shapes-video", "shapes-yolos", "shapes-vlm"}
    assert {_package(CARDS[n]) for n in ("shapes-video", "shapes-yolos", "shapes-vlm")} == {"transformers"}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_each_bundled_model_names_the_extra_that_installs_its_package(name, monkeypatch):
    package = _package(CARDS[name])
    row = next(r for r in vc.list_models() if r["name"] == name)
    if package is None:
        assert row["extra"] is None
        monkeypatch.setitem(sys.modules, "transformers", None)  # the base install builds it all the same
        assert isinstance(vc.load_model(name), __import__("torch").nn.Module)
        return
    extra = row["extra"]
    # The extra it names really installs the package (pyproject's own list, not the kit's mapping).
    assert any(req.split(">")[0].split("=")[0].split("[")[0] == package for req in EXTRAS[extra]), (extra, package)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(MissingExtraError) as info:
        vc.load_model(name)
    err = info.value
    assert isinstance(err, ImportError) and isinstance(err, vc.VitcamError) and isinstance(err, vc.ArgumentError)
    message = str(err)
    assert name in message and package in message and f"pip install -e '.[{extra}]'" in message
    assert isinstance(err.__cause__, ModuleNotFoundError)


def test_the_video_demo_without_transformers_says_which_extra_and_prints_no_traceback(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from vitcam_nb.cli import main\n"
            f"sys.exit(main(['demo', '--model', 'shapes-video', '--quiet', '--out', {str(tmp_path / 'out')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "pip install -e '.[hf]'" in done.stderr, done.stderr[-2000:]
    assert "shapes-video" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_models_listing_works_without_transformers_and_lists_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    rows = {r["name"]: r for r in models.list_models()}
    assert rows["shapes-video"]["extra"] == rows["shapes-yolos"]["extra"] == rows["shapes-vlm"]["extra"] == "hf"
    assert rows["shapes-vit"]["extra"] is None


def test_vitcam_nb_models_names_the_extra_of_each_model_that_needs_one(capsys):
    from vitcam_nb.cli import main

    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    for name, card in CARDS.items():
        needs = _package(card) is not None
        assert ("pip install -e '.[hf]'" in lines[name]) is needs, lines[name]
