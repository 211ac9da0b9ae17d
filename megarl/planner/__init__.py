"""The memory planner: will a config fit on its GPUs, and which layouts do if it does not.

Pure arithmetic (no processes, no tensors) over the config (:mod:`megarl.config`) and the layout
(:mod:`megarl.parallel.layout`), behind ``megarl plan`` and the fit warning of ``megarl config
validate`` and ``megarl train`` (:func:`memory_warnings`). The residency schedule it sums
(:mod:`megarl.planner.residency`) is the one the trainer applies.
"""

from megarl.planner.fit_warning import memory_warnings
from megarl.planner.memory_plan import Cluster, MemoryPlan, plan_memory
from megarl.planner.memory_search import Proposal, search_layouts

__all__ = ["Cluster", "MemoryPlan", "Proposal", "memory_warnings", "plan_memory", "search_layouts"]
