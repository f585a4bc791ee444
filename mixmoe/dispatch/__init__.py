"""Token movement strategies. ``local`` (one device) lives here; the expert-parallel strategies
(``a2a``, ``shadow``, ``mix``) sit beside it and share the same call signature."""

from mixmoe.dispatch.layout import RowLayout, counts_to_host, expert_row_layout
from mixmoe.dispatch.local import LocalDispatcher

__all__ = ["LocalDispatcher", "RowLayout", "counts_to_host", "expert_row_layout"]
