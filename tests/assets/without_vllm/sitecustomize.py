"""Put this directory on ``PYTHONPATH`` to run a process as on a machine without vLLM installed.

Python imports ``sitecustomize`` at start-up; this one calls :func:`pulseloco.integrations.skip_vllm_import` (a
cheap import: the package loads its submodules on first use), so TRL, which imports vLLM whenever it is installed,
skips it. The tests use it for a user's unchanged TRL script that does not use vLLM: the import costs seconds of
CPU per process on the suite's two cores and changes nothing the test checks.
"""

from pulseloco.integrations import skip_vllm_import

skip_vllm_import()
