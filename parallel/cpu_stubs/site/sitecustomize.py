"""Installs megarl's CPU import stubs at interpreter start when MEGARL_CPU_STUBS=1.

This directory is put on PYTHONPATH by ``parallel.cpu_stubs.child_env()`` for processes that run
SGLang on CPU (the engine spawns scheduler/detokenizer children that must have the stubs before
their first import). See ``parallel/cpu_stubs/__init__.py`` for what is stubbed and why.
"""

import os

if os.environ.get("MEGARL_CPU_STUBS", "") == "1":
    from parallel.cpu_stubs import install_from_env

    install_from_env()
