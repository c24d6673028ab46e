"""The drafting methods peagle trains, one module each (``peagle.methods.peagle``, ``.eagle3``), and
their interface (``base.DraftingMethod``). ``peagle.catalogue`` names them and loads a method's
module when a stage asks for it; this package imports none of its modules."""
