"""Suite-wide settings: no test's verdict depends on how fast the machine is.

Hypothesis' per-example deadline and its too-slow health check judge the machine's speed, not the
code: CI machines are loaded, so both are off for every property test.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("flashcp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("flashcp")
