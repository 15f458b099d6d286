"""A Jupyter server extension that sends kernel messages to the browser as soon as they are written.

jupyter_server writes each kernel message to the browser's websocket with Nagle's algorithm left on (tornado's
default). A widget's answer follows the kernel's "busy" status within a few milliseconds, so it waits in the
server until the browser acknowledges the status, and browsers delay that acknowledgement by up to 40 ms. Measured
with JupyterLab 4.6 / jupyter_server 2.21 on one machine: a widget echo took 14-23 ms or 48-61 ms, about half the
time each; with the flag set, 14-34 ms (``benchmarks/widget_latency.py`` records both). This extension sets
``TCP_NODELAY`` on every kernel websocket when it opens, through jupyter_server's own
``kernel_websocket_connection_class`` setting, and changes nothing else. It imports no part of vitcam_nb, so the
server does not load torch.

Installing vitcam_nb enables it (``etc/jupyter/jupyter_server_config.d/vitcam_nb_nodelay.json``); turn it off
with ``jupyter server extension disable vitcam_nb_nodelay``. A server configured with its own connection class
keeps it.

Example:
    >>> _jupyter_server_extension_points()
    [{'module': 'vitcam_nb_nodelay'}]
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["NoDelayConnection"]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "vitcam_nb_nodelay"}]


@functools.cache
def _connection_class() -> type:
    from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

    class NoDelayConnection(ZMQChannelsWebsocketConnection):
        """jupyter_server's kernel websocket connection with Nagle's algorithm off on the browser's socket.

        Example:
            >>> NoDelayConnection.__mro__[1].__name__  # doctest: +SKIP
            'ZMQChannelsWebsocketConnection'
        """

        def connect(self) -> Any:
            # Called from the handler's open(): the websocket exists and nothing has been written to it yet.
            self.websocket_handler.set_nodelay(True)
            return super().connect()

    return NoDelayConnection


def __getattr__(name: str) -> Any:
    # The class subclasses jupyter_server's, which only a Jupyter server (or a test) has imported.
    if name == "NoDelayConnection":
        return _connection_class()
    raise AttributeError(name)


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

    settings = serverapp.web_app.settings
    current = settings.get("kernel_websocket_connection_class")
    if current is ZMQChannelsWebsocketConnection:
        settings["kernel_websocket_connection_class"] = _connection_class()
        serverapp.log.info("vitcam_nb_nodelay: kernel websockets send without Nagle's delay")
    else:
        serverapp.log.info("vitcam_nb_nodelay: left the configured kernel websocket connection class %r alone",
                           current)
