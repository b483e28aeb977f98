"""The recipes run end to end and do what they say."""

import re
import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_train_step_recipe_runs_and_loss_goes_down() -> None:
    result = subprocess.run(
        [sys.executable, str(RECIPES / "train_step_from_packed_rows.py")],
        capture_output=True, text=True, check=True, timeout=120,
    )
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 5
    assert losses[-1] < losses[0]
