"""`splitfeed local`'s sidecar fork server (local/forkserver.py), as a real process."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from splitfeed.local import forkserver

pytestmark = pytest.mark.timeout(180)


def test_forked_commands_get_their_environment_log_session_and_exit_code(tmp_path):
    server = forkserver.Server(str(tmp_path / "server.log"))
    try:
        env = {**os.environ, "SPLITFEED_STORAGE_OPTIONS_DIR": "", "MARKER": "x"}
        bad = server.spawn(["sidecar", "--config", str(tmp_path / "missing.json")], env, str(tmp_path / "bad.log"))
        assert bad.wait(120) == 2  # a UserError: the CLI's own exit code, through the server
        log = (tmp_path / "bad.log").read_text()
        assert "missing.json" in log and "Traceback" not in log, log
        assert "fork support is experimental" not in log

        helped = server.spawn(["--help"], env, str(tmp_path / "help.log"))
        assert helped.wait(60) == 0
        assert "usage" in (tmp_path / "help.log").read_text()
        with pytest.raises(subprocess.TimeoutExpired):
            forkserver.Forked(server, 999_999_999).wait(0.3)  # no such child: never reported
    finally:
        server.close()
    assert server.proc.returncode == 0


def test_a_killed_server_reports_its_children_as_killed(tmp_path):
    server = forkserver.Server(str(tmp_path / "server.log"))
    try:
        child = server.spawn(["--help"], dict(os.environ), str(tmp_path / "help.log"))
        child.wait(60)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert forkserver.Forked(server, 12345).poll() == -signal.SIGKILL
    finally:
        server.close()
