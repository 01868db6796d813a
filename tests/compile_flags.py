"""XLA flags of the test processes, set in the environment before JAX starts its CPU backend
(tests/conftest.py imports this first; subprocesses the tests start inherit it).

The suite compiles thousands of small programs and runs each for milliseconds: compiling is
most of its time. XLA:CPU's loop emitters compile them a quarter to a third faster than its
fusion emitters (the default code generator in jaxlib 0.10), measured on the same test files
one after the other; the tests' tolerances do not depend on which one generated the code. A
choice already in XLA_FLAGS is kept.
"""

import os

FLAGS = ("--xla_cpu_use_fusion_emitters=false",)

for _flag in FLAGS:
    _name = _flag.split("=")[0]
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
