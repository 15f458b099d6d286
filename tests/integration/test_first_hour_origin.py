"""Issue #36, "untrained weights must be impossible to miss": the README's first command prints where the weights
came from before any result, every CLI command and ``load_model`` say it (random-init with a warning when the
architecture has published weights), ``--pretrained`` / ``--weights PATH`` choose them, offline ``pretrained=True``
fails at once naming the file looked for, and every output file carries the origin."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

import vitcam_nb as vc
from vitcam_nb.cli import main
from vitcam_nb.core.errors import RandomWeightsWarning, WeightsError
from vitcam_nb.core.provenance import weights_origin

ROOT = Path(__file__).resolve().parents[2]
TINY = {"img_size": 32, "patch_size": 8, "depth": 2}  # vit_tiny_patch16_224's layout, small enough for a test
TAG = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # timm's default published weights of vit_tiny_patch16_224


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trained_state(**kw) -> dict[str, torch.Tensor]:
    """A state dict of the tiny layout whose norm layers moved off their initial values (as training moves them)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kw)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.mul_(1.25)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def _readme_first_command() -> list[str]:
    """The words after ``&&`` on the first line of the README's first bash block (what .ci/run also reads)."""
    block = re.search(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M).group(1)
    first = [line for line in block.splitlines() if line.strip()][0]
    install, _, command = first.partition("&&")
    assert install.strip() == "pip install -e ." and command.split()[0] == "vitcam-nb", first
    return command.split()[1:]


@pytest.mark.slow
def test_the_readme_install_and_demo_line_prints_the_weights_origin_before_any_result(tmp_path):
    args = _readme_first_command()
    assert args == ["demo"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    # `vitcam-nb` is cli.main; run through this interpreter, with this checkout first on the path (no install).
    done = subprocess.run([sys.executable, "-m", "vitcam_nb.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    origin = f"bundled shapes-vit (file sha256 {_sha(ROOT / 'vitcam_nb/data/models/shapes-vit.safetensors')})"
    lines = done.stdout.splitlines()
    assert lines[0] == f"weights: {origin}"
    assert lines[1] == "vitcam-nb demo wrote:"
    out = tmp_path / "vitcam-demo"
    assert vc.load(out / "trace.nc").attrs["weights_origin"] == origin
    for name in ("gallery.png", "atlas.png"):
        with Image.open(out / name) as im:
            assert im.text["Title"].endswith(f"; weights: {origin}"), name
    assert f"Model: shapes-vit; weights: {origin}." in (out / "report.html").read_text()


def test_load_model_of_a_timm_name_without_weights_warns_that_they_are_random(recwarn):
    model = vc.load_model("vit_tiny_patch16_224", **TINY)
    caught = [w for w in recwarn if issubclass(w.category, RandomWeightsWarning)]
    assert len(caught) == 1 and issubclass(RandomWeightsWarning, UserWarning)
    text = str(caught[0].message)
    assert "random-init" in text and TAG in text and "pretrained=True" in text and "weights=PATH" in text
    assert caught[0].filename == __file__  # points at the user's line, where a notebook shows it
    assert weights_origin(model) == "random-init"


def test_a_timm_model_with_no_published_weights_is_built_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = vc.load_model("vit_base_patch16_gap_224", img_size=32, patch_size=8, depth=1, embed_dim=64,
                              num_heads=2)
    assert weights_origin(model) == "random-init"
    with pytest.raises(WeightsError, match="timm has no published weights for 'vit_base_patch16_gap_224'"):
        vc.load_model("vit_base_patch16_gap_224", pretrained=True)


def test_weights_path_loads_a_safetensors_state_dict_and_names_the_file(tmp_path):
    state = _trained_state(**TINY)
    path = tmp_path / "mine.safetensors"
    save_file(state, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = vc.load_model("vit_tiny_patch16_224", weights=path, **TINY)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items()) and set(loaded) == set(state)
    origin = f"file mine.safetensors (file sha256 {_sha(path)})"
    assert weights_origin(model) == origin
    tr = vc.trace(model, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F1"], layers=[-1])
    assert tr.attrs["weights_origin"] == origin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)  # the text is stated whatever the map holds
        assert origin in vc.cam(tr, vc.Recipe(site="F1", layer=-1)).attrs["methods"]
    with torch.no_grad():  # weights changed after loading are no longer the file's
        model.head.bias.add_(1.0)
    assert weights_origin(model) == "unknown"


def test_weights_path_refuses_pickle_files_and_state_dicts_of_another_model(tmp_path):
    pickled = tmp_path / "model.bin"
    pickled.write_bytes(b"not read")
    with pytest.raises(WeightsError, match=r"weights: model\.bin is not a \.safetensors file"):
        vc.load_model("vit_tiny_patch16_224", weights=pickled, **TINY)
    other = tmp_path / "other.safetensors"
    save_file(_trained_state(img_size=32, patch_size=8, depth=3), str(other))
    with pytest.raises(WeightsError, match=r"other\.safetensors does not fit vit_tiny_patch16_224.*blocks\.2"):
        vc.load_model("vit_tiny_patch16_224", weights=other, **TINY)
    with pytest.raises(ValueError, match="one source of weights"):
        vc.load_model("vit_tiny_patch16_224", pretrained=True, weights=other)
    with pytest.raises(ValueError, match="takes no keyword arguments"):
        vc.load_model("shapes-vit", pretrained=True)


def test_offline_pretrained_fails_at_once_naming_the_weights_and_how_to_supply_them(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tried = []

    def no_network(address, *a, **k):  # what an offline machine answers, without waiting
        tried.append(address)
        raise OSError("Name or service not known")

    def no_download(*a, **k):
        raise AssertionError("the hub must not be asked (it retries for about a minute offline)")

    monkeypatch.setattr("socket.create_connection", no_network)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_download)
    monkeypatch.setattr("timm.models._hub.hf_hub_download", no_download)
    with pytest.raises(WeightsError) as err:
        vc.load_model("vit_tiny_patch16_224", pretrained=True)
    text = str(err.value)
    assert f"hf-hub:timm/{TAG}" in text and str(tmp_path) in text and "model.safetensors" in text
    assert "weights=PATH" in text and "--weights PATH" in text
    assert tried == [("huggingface.co", 443)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline declared: not even the one probe
    with pytest.raises(WeightsError, match="cannot be reached"):
        vc.load_model("vit_tiny_patch16_224", pretrained=True)
    assert len(tried) == 1


def test_pretrained_weights_in_the_cache_load_without_the_network_and_name_their_source(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The Hugging Face cache layout: models--<org>--<name>/refs/main holds the commit of snapshots/<commit>/.
    repo = tmp_path / f"models--timm--{TAG}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    state = _trained_state(**TINY)
    save_file(state, str(snapshot / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = vc.load_model("vit_tiny_patch16_224", pretrained=True, **TINY)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert weights_origin(model) == (f"pretrained {TAG} from hf-hub:timm/{TAG} "
                                     f"(file sha256 {_sha(snapshot / 'model.safetensors')})")


@pytest.mark.slow
def test_ambiguity_cli_on_random_init_weights_says_so_first_and_in_every_file(tmp_path, capsys):
    image = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "amb"
    with pytest.warns(RandomWeightsWarning, match="vit_tiny_patch16_224 was built with random-init weights"):
        code = main(["ambiguity", "--model", "vit_tiny_patch16_224", "--image", str(image), "--out", str(out),
                     "--reported", "site=F1", "layer=-1", "target=logit", "weight_tokens=patch", "relu=after"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("weights: random-init (untrained") and "--pretrained" in lines[0]
    summary = json.loads((out / "ambiguity.json").read_text())
    assert summary["weights_origin"] == "random-init"
    assert summary["report"].startswith("Model vit_tiny_patch16_224, weights random-init. The description")
    assert lines[1] == summary["report"]
    with Image.open(out / "ambiguity.png") as im:
        assert im.text["Title"] == "vitcam_nb ambiguity of vit_tiny_patch16_224; weights: random-init"


@pytest.mark.slow
def test_demo_cli_with_a_weights_file_states_the_file_everywhere(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    save_file(_trained_state(), str(path))
    image = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(image)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RandomWeightsWarning)
        code = main(["demo", "--model", "vit_tiny_patch16_224", "--weights", str(path), "--image", str(image),
                     "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 0
    origin = f"file w.safetensors (file sha256 {_sha(path)})"
    assert capsys.readouterr().out.splitlines()[0] == f"weights: {origin}"
    out = tmp_path / "out"
    assert vc.load(out / "trace.nc").attrs["weights_origin"] == origin
    with Image.open(out / "gallery.png") as im:
        assert im.text["Title"] == f"vitcam_nb gallery of vit_tiny_patch16_224; weights: {origin}"
    assert f"weights: {origin}" in (out / "report.html").read_text()


def test_cli_refuses_pretrained_and_weights_together_and_models_says_the_weights_are_bundled(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--pretrained", "--weights", "x.safetensors"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["models"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("weights: bundled with vitcam_nb")


def test_a_timm_name_without_an_image_is_refused_before_its_weights_are_built(tmp_path, capsys, recwarn):
    assert main(["demo", "--out", str(tmp_path), "--model", "vit_tiny_patch16_224", "--quiet"]) == 2
    assert main(["ambiguity", "--out", str(tmp_path), "--model", "vit_tiny_patch16_224"]) == 2
    assert capsys.readouterr().err.count("--image") == 2
    assert not [w for w in recwarn if issubclass(w.category, RandomWeightsWarning)]
