"""`--token-file` (issue 20, Low: tokens as mounted files, not environment variables): the learner and the syncer
read the token from a file once at start, whitespace stripped, and refuse a missing or empty file naming the flag;
`--token-env` keeps working for those who use it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from diloco_trainer.learner.main import configure, options_from_args
from diloco_trainer.protocol.tokens import learner_token, read_bearer_token
from polling import wait_for

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
TOKEN = "file-token"


def _learner_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["--syncer", "http://127.0.0.1:8470", "--learner-id", "l0", *argv])


def test_a_token_file_is_read_with_its_whitespace_stripped_and_wins_over_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")  # a Secret written with `echo` ends in a newline
    monkeypatch.setenv("DILOCO_TOKEN", "from-the-environment")
    assert read_bearer_token(str(path), "DILOCO_TOKEN") == TOKEN
    assert options_from_args(_learner_args("--token-file", str(path))).token == TOKEN
    # Without --token-file the environment variable still serves, under the name --token-env gives.
    monkeypatch.setenv("OTHER", "other-token")
    assert options_from_args(_learner_args("--token-env", "OTHER")).token == "other-token"


@pytest.mark.parametrize("content,message", [(None, "cannot read the token"), ("", "the file is empty"),
                                             (" \n\t\n", "the file is empty"), (b"\xff\xfe", "cannot read")])
def test_a_missing_empty_or_unreadable_token_file_is_refused_naming_the_flag(tmp_path, monkeypatch, content, message):
    path = tmp_path / "token"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    monkeypatch.setenv("DILOCO_TOKEN", "t")  # never a silent fallback to the environment
    with pytest.raises(ValueError, match=f"--token-file {path}: {message}"):
        options_from_args(_learner_args("--token-file", str(path)))


def _get(url: str, token: str) -> int:
    try:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _syncer(tmp_path: Path, *argv: str) -> subprocess.Popen:
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\nseed: 1\nouter:\n  fragments: 2\n")
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_TOKEN"}  # as in the pods: no token in the environment
    env["PYTHONPATH"] = os.pathsep.join([str(TRAINER), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "diloco_trainer.cli", "syncer", "--config", str(config),
                             "--host", "127.0.0.1", "--port", "0", "--state-dir", str(tmp_path / "state"), *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_syncer_given_a_token_file_checks_that_token_and_refuses_a_missing_one_naming_the_flag(tmp_path):
    missing = _syncer(tmp_path, "--token-file", str(tmp_path / "absent"))
    out, _ = missing.communicate(timeout=120)
    assert missing.returncode == 2 and f"--token-file {tmp_path / 'absent'}: cannot read the token" in out

    (tmp_path / "token").write_text(TOKEN + "\n")
    proc = _syncer(tmp_path, "--token-file", str(tmp_path / "token"))
    try:
        endpoint = tmp_path / "state" / "endpoint.json"
        url = wait_for(lambda: endpoint.exists() and json.loads(endpoint.read_text())["url"], 120,
                       "the syncer to listen", 0.1)
        assert _get(f"{url}/v1/versions", TOKEN) == 200
        assert _get(f"{url}/v1/versions", learner_token(TOKEN, "learner-0")) == 200, "learner tokens derive from it"
        assert _get(f"{url}/v1/versions", TOKEN + "x") == 401 and _get(f"{url}/v1/versions", "other") == 401
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
