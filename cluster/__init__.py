"""The cluster: topologies and presets, Ray bootstrap, placement of DEP groups, the rank actor
shell, groups (states, gang restart, drain), the controller and ``serve``."""
