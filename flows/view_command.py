"""`agentr1 view`: serve the trace viewer (agent_core/viewer) over a data root until Ctrl-C.

127.0.0.1 unless --host says otherwise (the tables hold prompts and answers: exposing them is a choice)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_view_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765; 0: any free port)")
    cmd.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 exposes the tables)")
    cmd.add_argument("--mlflow-ui", default="http://127.0.0.1:5000", metavar="URL",
                     help="MLflow's UI over the same data root, linked from each run while it answers (default "
                     "http://127.0.0.1:5000, `mlflow ui`'s; '' for no link)")
    cmd.add_argument("--prefect-ui", default="http://127.0.0.1:4200", metavar="URL",
                     help="Prefect's UI over the same data root, linked likewise (default http://127.0.0.1:4200, "
                     "`prefect server start`'s; '' for no link)")


def view_command(args: argparse.Namespace, data_root: Path) -> int:
    from werkzeug.serving import make_server

    from agent_core.io.ui_links import ExternalUIs, ui_url
    from agent_core.viewer.app import create_app

    if not (data_root / "runs").is_dir():
        raise FileNotFoundError(f"no runs under {data_root} (start one with `agentr1 train`, or point --data-root "
                                "at an existing data root)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535, not {args.port}")
    uis = ExternalUIs(ui_url(args.mlflow_ui), ui_url(args.prefect_ui))
    server = make_server(args.host, args.port, create_app(data_root, uis), threaded=True)
    host, port = server.server_address[:2]
    print(f"agentr1: viewing {data_root} at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"agentr1: warning: listening on {args.host}: anyone who can reach this machine can read the tables",
              file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
