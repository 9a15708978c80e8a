"""What the viewer's tests share (tests/test_viewer.py, tests/test_viewer_filter_attacks.py): a tiny
trained run to view, and the viewer's own server on 127.0.0.1 in a thread, fetched over real HTTP."""

from __future__ import annotations

import http.client
import threading
from pathlib import Path

from tests.conftest import REPO_ROOT

BOUND_S = 60.0
TRACES = 3  # episodes per iteration logged as MLflow traces by `train_view_run`


def train_view_run(root: Path) -> Path:
    """Train configs/tiny.yaml for 2 iterations into `root` as run `view-run`; `root`."""
    from agent_core.validation import load_config
    from flows.train import train

    train(load_config(REPO_ROOT / "configs" / "tiny.yaml", [f"data_root={root}", "run_id=view-run", "iterations=2",
                                                            f"tracking.traces={TRACES}"]))
    return root


class Served:
    """The viewer's own server (flows/view_command.py's make_server) on a free port, in a thread;
    `app_options` go to create_app."""

    def __init__(self, root: Path, host: str = "127.0.0.1", uis=None, **app_options):
        from werkzeug.serving import make_server

        from agent_core.viewer.app import create_app

        self.server = make_server(host, 0, create_app(root, uis, **app_options), threaded=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(BOUND_S)

    def get(self, path: str) -> tuple[int, str]:
        status, _, body = self.fetch(path)
        return status, body

    def head(self, path: str) -> tuple[int, dict[str, str]]:
        """The status and headers of a GET (a redirect is not followed)."""
        status, headers, _ = self.fetch(path)
        return status, headers

    def fetch(self, path: str) -> tuple[int, dict[str, str], str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=BOUND_S)
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read().decode()
        connection.close()
        return response.status, dict(response.getheaders()), body
