"""A fleet: several replicas of one engine behind vLLM's router (``vllm-router``), on loopback.

``processes.py`` starts and stops the replicas and the router (``Fleet``); ``trace.py`` is the
built-in trace and its replay through the router; ``__main__.py`` is ``python -m tools.fleet``.
The routing lab (``tools/routing_lab.py``) replays the trace under each policy in turn.
"""

from tools.fleet.processes import POLICIES, Fleet, metrics_of, router_binary, router_venv

__all__ = ["POLICIES", "Fleet", "metrics_of", "router_binary", "router_venv"]
