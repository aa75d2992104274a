"""What `make install` leaves out of the venv, and why it matters to every run's start."""

from __future__ import annotations

import subprocess
import sys


def test_building_a_model_imports_no_sklearn() -> None:
    """scripts/install.sh removes scikit-learn (mlflow's model flavour needs it; rlpost does not): with it, every
    engine and policy process that imports transformers' model classes imports sklearn and scipy.stats too."""
    code = ("import sys; from transformers import AutoModelForCausalLM, GenerationMixin; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy', 'triton'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
