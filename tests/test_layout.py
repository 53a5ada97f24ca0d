"""Guards for the repository layout that keep imports honest."""

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_operator_from_repo_root_is_the_standard_library():
    out = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__); from operator import or_"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert str(ROOT) not in out.stdout
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not list((ROOT / "operator").glob("*.py")), "operator/ must hold only its package folder"


def test_diloco_help_answers_fast_without_importing_torch():
    code = "import sys; from diloco_trainer.cli import main; main(['--help']); print('torch' in sys.modules)"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False"), "diloco --help imported torch"
    assert "local" in out.stdout and "syncer" in out.stdout
    assert time.monotonic() - started < 5.0
