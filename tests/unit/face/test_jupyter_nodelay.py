"""The vitcam_nb_nodelay Jupyter server extension: it swaps in a connection class that turns Nagle's algorithm off
on the kernel websocket before anything is written to it, and leaves a server's own connection class alone."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

pytest.importorskip("jupyter_server")
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection  # noqa: E402

import vitcam_nb_nodelay  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _server(connection_class: type) -> SimpleNamespace:
    return SimpleNamespace(web_app=SimpleNamespace(settings={"kernel_websocket_connection_class": connection_class}),
                           log=logging.getLogger("test-nodelay"))


def test_loading_replaces_the_default_connection_class_with_a_subclass():
    server = _server(ZMQChannelsWebsocketConnection)
    vitcam_nb_nodelay._load_jupyter_server_extension(server)
    cls = server.web_app.settings["kernel_websocket_connection_class"]
    assert cls is vitcam_nb_nodelay.NoDelayConnection and issubclass(cls, ZMQChannelsWebsocketConnection)


def test_a_configured_connection_class_is_left_alone():
    class Custom(ZMQChannelsWebsocketConnection):
        pass

    server = _server(Custom)
    vitcam_nb_nodelay._load_jupyter_server_extension(server)
    assert server.web_app.settings["kernel_websocket_connection_class"] is Custom


def test_connect_sets_nodelay_on_the_websocket_before_connecting(monkeypatch):
    calls = []
    monkeypatch.setattr(ZMQChannelsWebsocketConnection, "connect", lambda self: calls.append("connect") or "future")
    handler = SimpleNamespace(set_nodelay=lambda value: calls.append(("set_nodelay", value)))
    conn = object.__new__(vitcam_nb_nodelay.NoDelayConnection)  # its traits need a live kernel manager
    conn.__dict__["_trait_values"] = {"websocket_handler": handler}
    assert vitcam_nb_nodelay.NoDelayConnection.connect(conn) == "future"
    assert calls == [("set_nodelay", True), "connect"]


def test_the_extension_does_not_import_vitcam_nb_or_torch():
    # A Jupyter server loads it at start: importing vitcam_nb would load torch into the server process.
    code = ("import sys, vitcam_nb_nodelay; vitcam_nb_nodelay.NoDelayConnection; "
            "print(sorted(m for m in ('vitcam_nb', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_install_enables_it_through_the_server_config_directory():
    config = json.loads((ROOT / "jupyter-config" / "jupyter_server_config.d" / "vitcam_nb_nodelay.json").read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"vitcam_nb_nodelay": True}}}
    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    assert data_files["etc/jupyter/jupyter_server_config.d"] == [
        "jupyter-config/jupyter_server_config.d/vitcam_nb_nodelay.json"]
    assert vitcam_nb_nodelay._jupyter_server_extension_points() == [{"module": "vitcam_nb_nodelay"}]
