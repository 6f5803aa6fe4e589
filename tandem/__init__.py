"""Tandem: disaggregated prefill/decode serving of DeepSeek-V3-architecture MoE models on Ray.

The repository keeps one top-level folder per part of the design (``cluster/``, ``prefill/``,
``decode/``, ...); they install as ``tandem.cluster``, ``tandem.prefill``, ... (setuptools
``package-dir`` in ``pyproject.toml``). The links beside this file give the same names inside a
checkout, for tools that read the source tree rather than the installed package (mypy, ruff).
"""
