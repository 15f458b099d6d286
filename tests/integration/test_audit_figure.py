"""``vitcam-nb figure``, the audit's experiment, offline on the bundled model: the counts add up to the maps the
axes allow, every label is one of the four and is what label_map says of the map vc.cam computes, the line says
which model ran and why, and a folder holding a user's file is refused before any work."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb import audit_figure
from vitcam_nb.cli import main
from vitcam_nb.evaluate.audit.labels import LABELS, label_map

SMALL = ["--axes", "site=F1,F2", "--axes", "weighting=gradcam,eigencam", "--axes", "heads=channels,max"]
TINY = ["--axes", "site=F1", "--axes", "weighting=gradcam", "--axes", "heads=channels", "--axes",
        "weight_tokens=patch", "--axes", "target=logit", "--images", "1", "--no-photo"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Whatever this machine's cache holds, the tests take the path of a machine without ViT-B/16 weights.
    monkeypatch.setattr(audit_figure, "cached_weights", lambda name: None)


def test_figure_on_the_bundled_model_counts_every_valid_map(tmp_path, capsys):
    out = tmp_path / "fig"
    assert main(["figure", "--out", str(out), "--images", "2", "--quiet", *SMALL]) == 0
    printed = capsys.readouterr().out
    assert ("ran on the bundled known-answer model shapes-vit: vit_base_patch16_224's pretrained weights are not "
            "on this machine") in printed
    summary = json.loads((out / "audit_figure.json").read_text())
    assert (out / "audit_figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # By hand, per target: F1 takes gradcam x 3 token rules + eigencam = 4; F2 adds the head rule max to gradcam:
    # 3 x 2 + 1 = 7. So 11 x 3 targets = 33 of the 2 x 3 x 2 x 3 x 2 = 72 combinations, on 3 images.
    assert summary["recipes_per_image"] == 33 and summary["skipped_combinations"] == 72 - 33
    assert summary["maps"] == 99 == len(summary["per_map"]) == sum(summary["counts"].values())
    assert set(summary["counts"]) == set(LABELS) and {r["label"] for r in summary["per_map"]} <= set(LABELS)
    for field, per_value in summary["counts_per_axis"].items():
        assert sum(sum(c.values()) for c in per_value.values()) == 99, field
    assert summary["weights_origin"].startswith("bundled shapes-vit")
    assert [i["kind"] for i in summary["images"]] == ["bundled shape", "bundled shape", "photograph"]
    # The 64 x 64 shapes are the model's input as they are: their masks arrive unchanged.
    for i in range(2):
        assert summary["images"][i]["mask_share"] == pytest.approx(vc.sample_image("shapes", i, True)[2].mean())
    assert 0.4 < summary["images"][2]["mask_share"] < 0.75  # the person, after the resize and centre crop
    assert "say nothing about correct localisation" in summary["caveat"]


def test_each_label_is_label_map_of_the_map_vc_cam_computes(tmp_path):
    result = audit_figure.run_figure(tmp_path / "f", model="shapes-vit", images=1, photo=False, progress=False,
                                     axes={"site": ["F1", "F2", "F6"], "weighting": ["gradcam", "layercam"],
                                           "heads": ["channels"], "target": ["logit"]})
    img, _, mask = vc.sample_image("shapes", 0, with_mask=True)
    tr = vc.trace(vc.load_model("shapes-vit"), img, targets="top1")
    rows = result["summary"]["per_map"]
    assert len(rows) == 3 * 4  # gradcam with 3 token rules + layercam, at 3 sites
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        for row in rows:
            recipe = vc.Recipe(layer=-1, **{f: row[f] for f in audit_figure.AUDIT_AXES})
            m = vc.cam(tr, recipe)
            assert row["recipe_id"] == recipe.id
            assert label_map(m.values, mask)[0] == row["label"], recipe
            assert (row["label"] == "empty") == bool(m.attrs["degenerate"] or np.ptp(m.values) == 0)
    # The last block's patch tokens after attention do not reach the CLS output: F6 with patch-token weights is
    # degenerate (zeros), whatever the weighting.
    assert {r["label"] for r in rows if r["site"] == "F6" and r["weight_tokens"] == "patch"} == {"empty"}


def test_a_folder_with_a_users_file_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    out = tmp_path / "fig"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def no_model(*args):
        raise AssertionError("the model was loaded before the folder was checked")

    monkeypatch.setattr(audit_figure, "_choose_model", no_model)
    assert main(["figure", "--out", str(out), "--quiet", *TINY]) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    (out / "audit_figure.png").write_bytes(b"a user's picture")
    assert main(["figure", "--out", str(out), "--quiet", *TINY]) == 2
    assert (out / "audit_figure.png").read_bytes() == b"a user's picture"


def test_overwrite_writes_beside_other_files_and_a_rerun_replaces_its_own(tmp_path, capsys):
    out = tmp_path / "fig"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["figure", "--out", str(out), "--quiet", "--overwrite", *TINY]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    clean = tmp_path / "clean"
    assert main(["figure", "--out", str(clean), "--quiet", *TINY]) == 0
    assert main(["figure", "--out", str(clean), "--quiet", *TINY]) == 0  # its own earlier output: no refusal
    assert json.loads((clean / "audit_figure.json").read_text())["maps"] == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "vit_tiny_patch16_224"], "vit_tiny_patch16_224's pretrained weights are not on this machine"),
    (["--axes", "layer=0,1"], "'layer' is not an axis"),
    (["--images", "0", "--no-photo"], "nothing to run"),
    (["--weights", "no-such-file.safetensors"], "weights: no-such-file.safetensors is not a file"),
    (["--images", "16"], "images: at most the bundled sample images"),
    (["--weights", __file__], "is not a .safetensors file; the kit reads no pickled checkpoint"),
    (["--model", "no_such_vit"], "unknown model 'no_such_vit': not a bundled model"),
])
def test_bad_requests_get_a_clear_message(tmp_path, capsys, args, message):
    assert main(["figure", "--out", str(tmp_path / "f"), "--quiet", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "f").exists()


ONE = {"site": ["F1"], "weighting": ["gradcam"], "heads": ["channels"], "weight_tokens": ["patch"], "target": ["logit"]}


@pytest.fixture
def weights_file(tmp_path):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    net = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path / "w$1$.safetensors"  # two "$": matplotlib would read mathtext between them
    save_file(net.state_dict(), str(path))
    return path


def test_a_local_weights_file_runs_the_timm_model_at_its_input_size(tmp_path, weights_file):
    result = audit_figure.run_figure(tmp_path / "f", model="vit_tiny_patch16_224", images=1, progress=False,
                                     weights=str(weights_file), axes=ONE)
    summary = result["summary"]
    assert result["line"] == "ran on vit_tiny_patch16_224 with the weights of the local file w$1$.safetensors, as asked"
    # The file is named, although its norm layers hold timm's initial values: a file is what it is, checked by hash.
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    assert summary["weights_origin"] == f"file w$1$.safetensors (file sha256 {digest})"
    assert summary["maps"] == 2 and [i["kind"] for i in summary["images"]] == ["bundled shape", "photograph"]
    assert 0.4 < summary["images"][1]["mask_share"] < 0.75


def test_auto_takes_the_cached_weights_when_they_are_there(tmp_path, weights_file, monkeypatch):
    seen = []
    monkeypatch.setattr(audit_figure, "AUDIT_MODEL", "vit_tiny_patch16_224")
    monkeypatch.setattr(audit_figure, "cached_weights", lambda name: seen.append(name) or str(weights_file))
    result = audit_figure.run_figure(tmp_path / "f", images=1, photo=False, progress=False, axes=ONE)
    assert seen == ["vit_tiny_patch16_224"]
    assert result["line"] == ("ran on vit_tiny_patch16_224 with its pretrained weights from this machine's timm / "
                              "Hugging Face cache")
    assert result["summary"]["model"] == "vit_tiny_patch16_224" and result["summary"]["maps"] == 1


def test_a_weights_file_that_does_not_fit_the_model_is_refused_clearly(tmp_path, weights_file):
    with pytest.raises(ValueError, match=r"weights: w\$1\$.safetensors could not be loaded into vit_small_patch16_224"):
        audit_figure.run_figure(tmp_path / "f", model="vit_small_patch16_224", weights=str(weights_file), images=1,
                                photo=False, progress=False, axes=ONE)
