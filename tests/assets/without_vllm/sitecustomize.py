"""Put this directory on ``PYTHONPATH`` to run a process as on a machine without vLLM installed.

Python imports ``sitecustomize`` at start-up; this one marks vLLM unavailable
(:func:`pulseloco.integrations.skip_vllm_import`), so TRL, which imports vLLM whenever it is installed, skips it.
The tests use it for a user's unchanged TRL script that does not use vLLM: the import costs seconds of CPU per
process on the suite's two cores and changes nothing the test checks.
"""

import sys

if sys.modules.get("vllm") is None:
    sys.modules["vllm"] = None  # type: ignore[assignment]
