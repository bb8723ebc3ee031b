import subprocess
import sys


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "rewind", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "rewind" in out.stdout


def test_blas_status_is_reported():
    out = subprocess.run([sys.executable, "-m", "rewind.blas"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.startswith("BLAS:")
