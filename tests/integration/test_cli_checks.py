"""The command line checks what it was given before any work (issue #51, item 6): a misspelt bundled name gets
"did you mean", a timm name needs --image, the help says so and answers without importing torch; the weights' origin
line is printed before a progress bar starts, never onto its line; ``vitcam-nb figure`` takes ``--pretrained``."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tqdm import tqdm as std_tqdm

from vitcam_nb.cli import bundled_model_names, check_model, main
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.progress import LOG_INTERVAL_S, progress_bar

ROOT = Path(__file__).resolve().parents[2]


def test_the_bundled_names_are_read_without_torch_and_are_those_of_the_models_module():
    from vitcam_nb.models import bundled_names

    assert bundled_model_names() == bundled_names() and "shapes-vit" in bundled_model_names()


@pytest.mark.parametrize(("typo", "meant"), [("shapes_vit", "shapes-vit"), ("shapes-vit-reg", "shapes-vit-reg4"),
                                             ("Shapes-ViT", "shapes-vit"),
                                             ("vit_tiny_patch16_22", "vit_tiny_patch16_224")])
def test_a_misspelt_model_name_is_refused_with_the_closest_name(typo, meant):
    with pytest.raises(ArgumentError, match=f"unknown model '{typo}'.*did you mean '{meant}'"):
        check_model(typo)


def test_a_name_close_to_nothing_is_refused_without_a_suggestion():
    with pytest.raises(ArgumentError, match="unknown model 'qqqqqqqq'") as err:
        check_model("qqqqqqqq")
    assert "did you mean" not in str(err.value)


def test_a_timm_name_needs_an_existing_image_and_a_bundled_name_does_not(tmp_path):
    assert check_model("shapes-vit") == "bundled"
    with pytest.raises(ArgumentError, match=r"image: a timm model \(vit_tiny_patch16_224\) needs --image PATH"):
        check_model("vit_tiny_patch16_224")
    with pytest.raises(ArgumentError, match="is not a file"):
        check_model("vit_tiny_patch16_224", str(tmp_path / "missing.png"))
    (tmp_path / "in.png").write_bytes(b"")
    assert check_model("vit_tiny_patch16_224.augreg_in21k", str(tmp_path / "in.png")) == "timm"


@pytest.mark.parametrize("command", ["demo", "ambiguity"])
def test_the_cli_refuses_a_typo_before_any_bar_or_file(tmp_path, capsys, command):
    out = tmp_path / "out"
    assert main([command, "--model", "shapes_vit", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"vitcam-nb {command}: model: unknown model 'shapes_vit'" in captured.err
    assert "did you mean 'shapes-vit'?" in captured.err
    assert "it/s" not in captured.err and "%|" not in captured.err  # no progress bar was drawn
    assert not out.exists()


def test_the_help_says_a_timm_name_needs_an_image(capsys):
    for argv in (["--help"], ["demo", "--help"], ["ambiguity", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "needs --image PATH" in " ".join(capsys.readouterr().out.split()), argv


def test_the_help_is_answered_without_importing_torch_timm_or_matplotlib():
    code = ("import sys\nfrom vitcam_nb.cli import main\n"
            "for argv in (['--help'], ['demo', '--help'], ['figure', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'timm', 'transformers', 'matplotlib', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"


class _Stop(Exception):
    pass


def test_the_demo_prints_the_weights_origin_before_its_progress_bar_starts(tmp_path):
    from vitcam_nb.demo import run_demo

    live = []

    def announce(line: str) -> None:
        live.append((line, len(std_tqdm._instances)))  # bars drawn (not disabled) at the moment of the line
        raise _Stop  # the rest of the demo is not this test's subject

    with pytest.raises(_Stop):
        run_demo(tmp_path / "out", progress=True, announce=announce)
    assert live and live[0][0].startswith("weights: bundled shapes-vit") and live[0][1] == 0


def test_the_origin_line_of_the_cli_lifts_a_drawn_bar_instead_of_writing_onto_its_line(capsys):
    from vitcam_nb.cli import _announce

    bar = std_tqdm(total=3, desc="busy", mininterval=60)  # on stderr, as the kit's bars are
    bar.update()
    _announce("weights: random-init")
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == ("weights: random-init (untrained: the maps explain no learned model; use --pretrained or "
                            "--weights PATH)\n")
    # Before the line the bar's text was blanked out (\r, spaces, \r) and after it the bar was drawn again: drawn at
    # start, redrawn after the line, drawn on closing. A plain print leaves the cursor after the bar's text.
    assert "\r" + " " * 20 in captured.err and captured.err.count("busy") == 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_in_a_log_redraws_rarely_and_one_on_a_terminal_as_tqdm_does():
    log, terminal = io.StringIO(), _Terminal()
    for stream in (log, terminal):
        for _ in progress_bar(range(40), file=stream, desc="work"):
            time.sleep(0.01)  # 0.4 s: tqdm's default (0.1 s) redraws several times
    assert progress_bar(total=1, file=log).mininterval == LOG_INTERVAL_S
    drawn_log, drawn_terminal = log.getvalue().count("work"), terminal.getvalue().count("work")
    assert drawn_log == 2  # the first draw and the closing one
    assert drawn_terminal > drawn_log


def test_figure_takes_pretrained_refuses_it_for_a_bundled_model_and_with_weights(tmp_path, capsys, monkeypatch):
    from vitcam_nb import audit_figure
    from vitcam_nb.cli import _figure_model

    assert _figure_model("auto", True) == audit_figure.AUDIT_MODEL and _figure_model("auto", False) == "auto"
    assert main(["figure", "--model", "shapes-vit", "--pretrained", "--out", str(tmp_path / "f")]) == 2
    assert "carries its own weights" in capsys.readouterr().err
    assert main(["figure", "--model", "shapes_vit", "--out", str(tmp_path / "f")]) == 2
    assert "did you mean 'shapes-vit'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["figure", "--pretrained", "--weights", "w.safetensors"])
    assert "not allowed with argument" in capsys.readouterr().err
    # --pretrained with auto: ViT-B/16 or a refusal, never the silent fallback to the bundled model.
    monkeypatch.setattr(audit_figure, "cached_weights", lambda name: None)
    assert main(["figure", "--pretrained", "--out", str(tmp_path / "f"), "--quiet"]) == 2
    assert "vit_base_patch16_224's pretrained weights are not on this machine" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()
