"""Importing kvcache, kvcache.reference or kvcache.memory must not import torch."""

import subprocess
import sys


def test_import_kvcache_does_not_import_torch():
    code = (
        "import sys, kvcache, kvcache.reference, kvcache.memory, kvcache.cli;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'numpy' not in sys.modules, 'numpy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
