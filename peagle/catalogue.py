"""The drafting methods peagle trains, by name (one module of ``peagle.methods`` each).

Every stage asks the method object (``get_method(cfg.train.method)``) what differs between
methods (``peagle.methods.base.DraftingMethod``) instead of comparing names. Adding a method
is one module defining ``METHOD`` plus its line in ``CATALOGUE``; ``register_method`` adds
one in the running process only (a test, a notebook: the training launcher's own processes
import just the catalogue). Method modules are imported on first use, by name: listing the
names (config validation) imports neither torch nor anything above the config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peagle.methods.base import DraftingMethod

CATALOGUE = {
    "peagle": "peagle.methods.peagle",
    "eagle3": "peagle.methods.eagle3",
}
# The method of a head when none is named (train.method's default).
DEFAULT_METHOD = "peagle"
# The method train.eagle3_baseline trains beside the head, on the same data.
BASELINE = "eagle3"

_registered: dict[str, DraftingMethod] = {}


def available_methods() -> list[str]:
    """Names ``train.method`` accepts."""
    return sorted({*CATALOGUE, *_registered})


def register_method(method: DraftingMethod) -> DraftingMethod:
    """Make ``method`` available by its name in this process; a name already taken is refused."""
    # Asked of the object, not of its class: the catalogue sits below the methods it names.
    if not callable(getattr(method, "objective", None)) or not callable(getattr(method, "draft", None)):
        raise TypeError(f"{method!r} is not a drafting method: subclass peagle.methods.base.DraftingMethod")
    for attr in ("name", "label", "display_name", "parallel_drafting"):
        if not hasattr(method, attr):
            raise ValueError(f"drafting method {type(method).__name__} lacks {attr!r}")
    if method.name in available_methods():
        raise ValueError(f"a drafting method named {method.name!r} exists already; choose another name")
    taken = {get_method(name).label for name in available_methods()}
    if method.label in taken:
        raise ValueError(f"the label {method.label!r} is taken by another method; results are keyed by it")
    _registered[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Forget a method added with ``register_method`` (catalogue methods stay)."""
    _registered.pop(name, None)


def get_method(method: str | DraftingMethod) -> DraftingMethod:
    """The method object for a name (a method object is returned as it is)."""
    if not isinstance(method, str):  # a method object (a DraftingMethod) is its own answer
        return method
    if method in _registered:
        return _registered[method]
    if method not in CATALOGUE:
        raise ValueError(f"unknown drafting method {method!r}; available: {', '.join(available_methods())}")
    return importlib.import_module(CATALOGUE[method]).METHOD


def trained_methods(train) -> list[DraftingMethod]:
    """The methods a pipeline run trains: ``train.method``'s, then the EAGLE-3 baseline when
    ``train.eagle3_baseline`` asks for it (and the head is not EAGLE-3 itself)."""
    head = get_method(train.method)
    baseline = get_method(BASELINE) if train.eagle3_baseline else None
    return [head] if baseline is None or baseline is head else [head, baseline]


__all__ = [
    "BASELINE",
    "CATALOGUE",
    "DEFAULT_METHOD",
    "available_methods",
    "get_method",
    "register_method",
    "trained_methods",
    "unregister_method",
]
