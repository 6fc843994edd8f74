"""Optional libraries, imported where a feature uses them: a missing one names the pip extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from cairn.handlers.errors import MissingDependencyError

# The distribution's top-level module -> the cairn-ckpt extra that installs it.
EXTRAS = {
    "absl": "grain",  # absl-py, which grain's workers read their flags from
    "boto3": "s3",
    "botocore": "s3",
    "google": "gcs",  # google-auth
    "grain": "grain",
    "jax": "jax",
    "matplotlib": "plot",
    "orbax": "orbax",
    "requests": "gcs",
    "speechbrain": "speechbrain",
    "tensorboard": "tensorboard",
    "tensorflow": "tf",
    "tensorstore": "jax",
    "torch": "torch",
}


def optional(module: str, *, feature: str) -> ModuleType:
    """Import `module` for `feature` (e.g. ``"tensorboard_dir="``); MissingDependencyError if
    its library is not installed, naming the extra. An ImportError from inside an installed
    library (a broken install) is raised as it is."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.partition(".")[0] != top:
            raise
        extra = EXTRAS.get(top)
        how = f"pip install 'cairn-ckpt[{extra}]'" if extra else f"pip install {top}"
        raise MissingDependencyError(
            f"{feature} needs {top}, which is not installed in this Python ({e}); install it "
            f"with: {how}"
        ) from e
