"""What each drafting method does, by name: ``METHODS`` maps ``train.method``'s values to the
behaviour of ``peagle.methods.peagle`` and ``peagle.methods.eagle3`` (on the interface
``peagle.methods.base.DraftingMethod``). What a method is, torch-free, is its description in
``peagle.catalogue``; importing this package imports torch.
"""

from __future__ import annotations

from peagle.catalogue import describe
from peagle.methods.base import DraftingMethod
from peagle.methods.eagle3 import METHOD as EAGLE3_METHOD
from peagle.methods.peagle import METHOD as PEAGLE_METHOD

METHODS: dict[str, DraftingMethod] = {m.name: m for m in (PEAGLE_METHOD, EAGLE3_METHOD)}


def get_method(name: str) -> DraftingMethod:
    """The behaviour of the method named ``name`` (one of ``peagle.catalogue.available_methods()``)."""
    describe(name)  # an unknown name is refused with the names there are
    return METHODS[name]


__all__ = ["METHODS", "DraftingMethod", "get_method"]
