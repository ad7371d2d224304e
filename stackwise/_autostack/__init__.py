"""Auto-stacking: an unmodified loop model, traced once, run with its repeated blocks as one
``lax.scan`` (:func:`autostack`). ``signature`` says when two equations are the same
computation, ``find`` finds the run and follows its data, ``diagnose`` words why a loop
could not be stacked, ``run`` re-emits the model, ``api`` is the public entry point."""

from stackwise._autostack.api import Autostacked, Found, autostack

__all__ = ["Autostacked", "Found", "autostack"]
