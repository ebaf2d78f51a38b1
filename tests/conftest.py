"""Hypothesis profiles: `ci` (the default) is derandomized and bounded, so CI is deterministic and
quick; `dev` explores more (HYPOTHESIS_PROFILE=dev pytest tests/test_fuzz.py)."""

from __future__ import annotations

import os

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the dev extra is not installed: only the fuzzers need it, and they say so
    settings = None

if settings is not None:
    _quiet = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True, print_blob=True,
                              suppress_health_check=_quiet)
    settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=_quiet)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
