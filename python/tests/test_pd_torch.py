"""The two-process P/D example with torch tensors, run as a user would."""
import os
import subprocess
import sys

from conftest import EXAMPLES


def test_pd_torch_example_transfers_byte_exact():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, str(EXAMPLES / "pd_torch.py")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decode: request req-1 finished" in out.stdout
    assert "compared byte-exact: OK" in out.stdout
    assert "prefill: request req-1 released (read)" in out.stdout
    assert "parent: P/D transfer OK" in out.stdout
