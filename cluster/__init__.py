"""Cluster layer: config and topology presets, Ray bootstrap, placement of DEP groups, the
controller, the frontend, metrics, the autoscaler and the ``tandem`` command line."""
