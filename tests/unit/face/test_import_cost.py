"""``import vitcam_nb`` leaves out what only some uses need (anywidget with ipywidgets and IPython, scipy): a script,
the command line and every fresh dask worker pay the import. Each check runs in a fresh interpreter, so what an
earlier test imported cannot hide an eager import."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_widgets_load_when_one_is_first_named_by_any_route():
    _run("import sys, vitcam_nb as vc\n"
         "assert 'anywidget' not in sys.modules and 'IPython' not in sys.modules, 'import vitcam_nb imported them'\n"
         "assert {'Compare', 'Explorer', 'Gallery'} <= set(dir(vc)) and 'GalleryGrid' in dir(vc.widgets)\n"
         "from vitcam_nb.widgets.explorer import Explorer\n"
         "from vitcam_nb import Compare\n"
         "assert vc.Explorer is vc.widgets.Explorer is Explorer and 'anywidget' in sys.modules\n"
         "assert Compare.__module__ == 'vitcam_nb.widgets.compare', Compare\n"
         "try:\n    vc.widgets.Explore\nexcept AttributeError as e:\n    assert 'Explore' in str(e)\n"
         "else:\n    raise AssertionError('a misspelt widget resolved')\n")


def test_scipy_loads_when_a_metric_first_needs_it():
    # Spearman of two maps ranked in opposite orders is -1 exactly (ranks 1..4 against 4..1).
    _run("import sys, numpy as np, vitcam_nb as vc\n"
         "assert not [m for m in sys.modules if m.split('.')[0] == 'scipy'], 'import vitcam_nb imported scipy'\n"
         "a = np.array([[1.0, 2.0], [3.0, 4.0]])\n"
         "assert vc.evaluate.spearman(a, -a) == -1.0 and 'scipy.stats' in sys.modules\n")
