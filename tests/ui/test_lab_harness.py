"""The JupyterLab harness of the browser tests under pytest-xdist: a port taken between choosing it and binding it
(another worker's server) costs a new port, not a failed module."""

from __future__ import annotations

import socket

import pytest
from lab_harness import LabServer

pytestmark = pytest.mark.browser


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path):
    pytest.importorskip("jupyterlab")
    lab = LabServer(tmp_path / "root", startup_timeout=120)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", lab.port))  # as another process would, after the harness chose it
        taken.listen()
        with lab:
            assert lab.port != taken.getsockname()[1]
            assert lab.api("GET", "api/status")["started"]
    assert lab.proc is None
