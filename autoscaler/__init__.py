"""Autoscaling: a policy that reads the pools' metrics and decides, per pool, to add a group,
drain one, or hold. Pure Python: no Ray, no torch, no I/O inside the policy."""
