"""Notebook widgets (ipywidgets): the placement editor and the serving view.

Importing this package imports ipywidgets; ``import tfnb`` does not (``tfnb.PlacementEditor``
is resolved on first use).

Examples
--------
>>> from tfnb.models import tiny
>>> from tfnb.notebook.widgets import PlacementEditor
>>> editor = PlacementEditor(tiny("llama"), ["a", "b"])
>>> sorted(set(editor.plan.assignment.values())) <= ["a", "b"]
True
"""
from tfnb.notebook.widgets.dataflow import plan_svg
from tfnb.notebook.widgets.placement import PlacementEditor
from tfnb.notebook.widgets.serving_view import ServingView, serving_view

__all__ = ["PlacementEditor", "ServingView", "plan_svg", "serving_view"]
