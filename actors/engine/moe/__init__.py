"""Mixture-of-experts serving: the routed layer and what steers it while serving.

Mental model: `layer.SparseMoE` is Mixtral's top-k layer; a `control.MoEControl` installed on an
engine owns the model's routing state (`routing_table.RoutingState`: a per-expert bias table,
swapped between steps, with a per-layer safe mode), its live expert loads and a
small sample of router logits (`telemetry.py`), and the request-level expert budgets (`budget.py`).
The rule that turns router logits, a bias and a budget mask into chosen experts lives once, in
`routing.py`; the routing controller (cluster/moe/) checks candidate tables with it.
"""
