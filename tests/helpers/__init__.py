"""Helpers shared by the test folders (``from helpers.tuning_helpers import stated_profile``):
fake plugin distributions, planted wrong backends, the CPU kernel's builds, tiny Hugging Face models,
Triton run modes, tuning fixtures, and a loader for the scripts under ``scripts/``. ``tests/`` is on
``sys.path`` (``[tool.pytest.ini_options] pythonpath``); this package holds no tests."""
