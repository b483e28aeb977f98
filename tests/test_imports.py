"""The core must not pull in heavy frameworks at import time."""

import subprocess
import sys


def test_import_zephon_torch_does_not_import_torch_lightning_or_ray() -> None:
    code = (
        "import sys, zephon_torch, zephon_torch.types, zephon_torch._training\n"
        "heavy = [m for m in ('torch', 'lightning', 'ray', 'torchdata') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == ""


def test_public_names_are_sorted_and_importable() -> None:
    import zephon_torch

    assert list(zephon_torch.__all__) == sorted(zephon_torch.__all__)
    for name in zephon_torch.__all__:
        assert hasattr(zephon_torch, name), name


def test_demo_runs_and_prints_training_tensors() -> None:
    result = subprocess.run([sys.executable, "-m", "zephon_torch.demo"], capture_output=True,
                            text=True, check=True)
    assert "labels: (4, 128) torch.int64" in result.stdout
    assert "cu_seqlens: (4, " in result.stdout
    assert "runner=threads x2 vs inline: identical output" in result.stdout
    assert "400 documents read" in result.stdout
