"""Cluster-scale discrete-event simulator driving the real `cluster/` scheduler (`python -m bench.sim`)."""
