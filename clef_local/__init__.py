"""clef-local: run Clef decision models offline, quantized, and prove the decisions did not change.

    >>> import clef_local
    >>> model = clef_local.load("path/to/release")          # or clef_local.default_model_path()
    >>> model.decide({"model": "clef", "state": "...", "questions": {...}})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["ClefModel", "Prediction", "__version__", "default_model_path", "load"]

if TYPE_CHECKING:
    from clef_local.demo.default import default_model_path
    from clef_local.model import ClefModel, Prediction, load


# lazy, so that importing clef_local loads neither torch nor transformers
def __getattr__(name: str) -> Any:
    if name in ("load", "ClefModel", "Prediction"):
        from clef_local import model

        return getattr(model, name)
    if name == "default_model_path":
        from clef_local.demo.default import default_model_path

        return default_model_path
    raise AttributeError(f"module 'clef_local' has no attribute {name!r}")
